"""Gateway tools named as another tool (found by attacking the gateway, 2026-12-06).

A gateway's tools are named `<gateway>_<action>` and `<gateway>_actions`, and both names may hold `_`.
Gateway "biscuit" action "web_deploy" and gateway "biscuit_web" action "deploy" made one tool name: the
SDK kept the first tool's body while the scope map kept the last one's, so a deploy that waits for a human
was callable with `gateway:read`. Gateway "run" action "command" took the workbench's `run_command` under
`gateway:read` the same way.

What this proves: such configs are refused at load or at `serve`, in one line naming both; a server never
registers one name twice. What it does not prove: scope checks themselves (test_http_scopes.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bastion.app import build_server, build_services
from bastion.config import load_config
from bastion.safety.errors import ConfigError
from bastion.tools.server import GATEWAY_READ
from tests.helpers import refused_stdio_start

from .lab import GatewayLab

ACTION = """
[[gateway.action]]
name = "{name}"
approval = {approval}
args = [{{ name = "project", pattern = "[a-z]+" }}]
"""


def _with(lab: GatewayLab, name: str, text: str) -> Path:
    path = lab.config_path.with_name(name)
    path.write_text(text)
    return path


def test_two_gateways_making_one_tool_name_are_refused_at_load(lab: GatewayLab) -> None:
    """Attack: gateway "biscuit_web" action "deploy" (no approval) named as "biscuit" action "web_deploy"
    (approval): the approval-needing tool answered to the read scope."""
    text = lab.config_path.read_text()
    gateway = text[text.index("[[gateway]]") :]
    head = gateway[: gateway.index("[[gateway.action]]")]
    second = head.replace('name = "biscuit"', 'name = "biscuit_web"') + ACTION.format(name="deploy", approval="false")
    config = _with(lab, "bastion-collide.toml", text + ACTION.format(name="web_deploy", approval="true") + second)
    with pytest.raises(ConfigError) as refused:
        load_config(config)
    assert str(refused.value) == (
        "gateway 'biscuit' action 'web_deploy' and gateway 'biscuit_web' action 'deploy' both make the tool "
        "'biscuit_web_deploy': rename one of them"
    )


def test_a_gateway_tool_named_as_bastions_own_is_refused_at_serve(lab: GatewayLab) -> None:
    """Attack: gateway "run" action "command" took the workbench's run_command under gateway:read."""
    text = lab.config_path.read_text().replace('name = "biscuit"\nhost', 'name = "run"\nhost', 1)
    config = _with(lab, "bastion-run.toml", text + ACTION.format(name="command", approval="false"))
    line = refused_stdio_start(config)
    assert line == (
        "bastion: gateway 'run' action 'command' makes the tool 'run_command', which bastion already has: "
        "rename the gateway or action"
    )


def test_a_server_never_registers_one_tool_name_twice(lab: GatewayLab) -> None:
    """The SDK keeps a name's first tool and would have taken the second's scope: a second is refused."""
    services = build_services(load_config(lab.config_path))
    try:
        server = build_server(services, caller="agent")
        scopes = dict(server.tool_scopes)
        with pytest.raises(ValueError, match="tool 'run_command' is registered twice"):
            server.tool("run_command", description="Another.", scope=GATEWAY_READ)
        assert server.tool_scopes == scopes
    finally:
        services.close()
