"""What a model learns from tools/list and the initialize result alone: the config's templates in
create_sandbox's description, only tools that can work, a title for every tool, hints that match
what each tool does, and instructions that say which toolsets are off and why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import asyncssh
import pytest
from mcp import Client

from bastion.app import build_server, build_services
from bastion.config import load_config
from tests.helpers import call
from tests.workbench.test_catalog import fake_venv

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]

BISCUIT_TOOLS = {f"biscuit_{name}" for name in ("actions", "status", "logs", "deploy", "restart", "rollback")}
SANDBOX_TOOLS = {"create_sandbox", "list_templates", "list_sandboxes", "execute_code", "list_processes"}
ORGANIZER_TOOLS = {"list_files", "plan_organize", "apply_plan", "move_file", "undo_last_action", "redo_last_action"}

TEMPLATES = """
[[template]]
name = "data"
python_env = "{env}"
read_only = [{{ source = "{inputs}", dest = "/data" }}]

[[template]]
name = "strict"
[template.policy]
allow = ["ls"]
"""

MINIMAL = """
state_dir = "state"
default_workspace = "default"

[[workspace]]
id = "default"
path = "workspace"
[workspace.policy]
allow = ["ls"]

[sandboxes]
enabled = false
"""


async def served(config_path: Path) -> tuple[dict[str, Any], str]:
    """tools/list by name, and the instructions, as a real client sees them."""
    services = build_services(load_config(config_path))
    try:
        async with Client(build_server(services, caller="test")) as client:
            listed = await client.list_tools()
            instructions = client.instructions or ""
    finally:
        services.close()
    tools = {tool.name: tool.model_dump(mode="json", by_alias=True, exclude_none=True) for tool in listed.tools}
    return tools, instructions


def pin_host_key(config_path: Path) -> None:
    key = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
    text = config_path.read_text().replace('# host_key = "ssh-ed25519 AAAA..."', f'host_key = "{key}"')
    config_path.write_text(text)


async def test_gateway_tools_are_listed_only_with_a_pinned_host_key(demo_config_path: Path) -> None:
    """Without host_key every gateway call is refused: its six tools are not listed, and the instructions say why."""
    tools, instructions = await served(demo_config_path)
    assert not BISCUIT_TOOLS & set(tools)
    assert "biscuit_* gateway tools (gateway 'biscuit' has no pinned host_key)" in instructions
    pin_host_key(demo_config_path)
    tools, instructions = await served(demo_config_path)
    assert set(tools) >= BISCUIT_TOOLS
    assert "biscuit" not in instructions
    assert tools["biscuit_actions"]["annotations"]["openWorldHint"] is False  # it reads the config only
    assert tools["biscuit_deploy"]["annotations"]["destructiveHint"] is True
    assert tools["biscuit_deploy"]["title"] == "biscuit: deploy"


async def test_a_config_without_sandboxes_or_inboxes_lists_only_what_works(tmp_path: Path) -> None:
    (tmp_path / "workspace").mkdir()
    config_path = tmp_path / "bastion.toml"
    config_path.write_text(MINIMAL)
    tools, instructions = await served(config_path)
    assert not (SANDBOX_TOOLS | ORGANIZER_TOOLS) & set(tools)
    assert {"run_command", "read_file", "write_file", "explain_command"} <= set(tools)
    assert "sandbox, process, terminal, preview and code tools ([sandboxes] enabled = false)" in instructions
    assert "organizer tools (no [[inbox]] is configured)" in instructions
    assert "create_sandbox" not in instructions
    # run_command describes only the tier this server has: no sh -c, no background.
    assert "sh -c" not in tools["run_command"]["description"]
    assert "pipes, redirections" in tools["run_command"]["description"]


async def test_an_empty_registry_drops_install_package(demo_config_path: Path) -> None:
    demo_config_path.write_text(demo_config_path.read_text() + "\n[sandboxes.network]\nregistry = []\n")
    tools, instructions = await served(demo_config_path)
    assert "install_package" not in tools
    assert "execute_code" in tools
    assert "install_package ([sandboxes.network] registry is empty)" in instructions


async def test_snapshot_caps_of_zero_drop_snapshot_sandbox(demo_config_path: Path) -> None:
    """Every snapshot would be refused; a crashed server's snapshots can still be listed and restored."""
    text = demo_config_path.read_text()
    assert "max_snapshots = 64" in text
    demo_config_path.write_text(text.replace("max_snapshots = 64", "max_snapshots = 0"))
    tools, instructions = await served(demo_config_path)
    assert "snapshot_sandbox" not in tools
    assert {"restore_sandbox", "list_snapshots", "delete_snapshot"} <= set(tools)
    assert "snapshot_sandbox (a [sandboxes] snapshot cap is 0)" in instructions


async def test_create_sandbox_describes_every_template_and_list_templates_agrees(
    demo_config_path: Path, tmp_path: Path
) -> None:
    env = fake_venv(tmp_path / "data-env", {"numpy": "2.4.6", "pandas": "3.1.1"})
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    demo_config_path.write_text(demo_config_path.read_text() + TEMPLATES.format(env=env, inputs=inputs))
    tools, _ = await served(demo_config_path)
    create = tools["create_sandbox"]
    text = create["description"]
    default = next(line for line in text.splitlines() if line.startswith("- "))
    assert default.startswith(("- default (default): the system's Python", "- python-data (default)"))
    assert "- data: Python packages numpy, pandas (in /opt/bastion/env, on PATH); read-only /data; no network" in text
    assert "- strict: the system's Python, no extra packages; no network; a restricted command policy" in text
    assert str(tmp_path) not in text  # host paths stay on the host
    template_field = create["inputSchema"]["properties"]["template"]["description"]
    assert "data" in template_field
    assert "strict" in template_field
    assert "(default)" in template_field
    services = build_services(load_config(demo_config_path))
    try:
        async with Client(build_server(services, caller="test")) as client:
            listed = await call(client, "list_templates")
    finally:
        services.close()
    by_name = {t["name"]: t for t in listed["detail"]["templates"]}
    assert set(by_name) >= {"data", "strict"}
    assert by_name["data"]["python_packages"] == [
        {"name": "numpy", "version": "2.4.6"},
        {"name": "pandas", "version": "3.1.1"},
    ]
    assert by_name["data"]["read_only"] == ["/data"]
    assert by_name["strict"]["restricted_commands"] is True
    assert [t["name"] for t in listed["detail"]["templates"] if t["default"]] == [
        listed["detail"]["templates"][0]["name"]
    ]


# What each named tool does, as its hints must say (issue 15: these were wrong or missing).
EXPECTED_HINTS: dict[str, dict[str, bool]] = {
    "create_sandbox": {"readOnlyHint": False, "destructiveHint": False},
    "pause_sandbox": {"readOnlyHint": False, "destructiveHint": False, "idempotentHint": True},
    "resume_sandbox": {"readOnlyHint": False, "destructiveHint": False, "idempotentHint": True},
    "snapshot_sandbox": {"destructiveHint": False, "idempotentHint": False},
    "restore_sandbox": {"destructiveHint": False},
    "close_sandbox": {"destructiveHint": True, "idempotentHint": True},
    "delete_snapshot": {"destructiveHint": True, "idempotentHint": True},
    "install_package": {"openWorldHint": True, "destructiveHint": False, "readOnlyHint": False},
    "list_templates": {"readOnlyHint": True, "openWorldHint": False},
    "list_sandboxes": {"readOnlyHint": True},
    "get_sandbox_status": {"readOnlyHint": True},
    "read_file": {"readOnlyHint": True, "destructiveHint": False},
    "write_file": {"readOnlyHint": False, "destructiveHint": True},
    "run_command": {"readOnlyHint": False, "destructiveHint": True, "openWorldHint": False},
    "execute_code": {"readOnlyHint": False, "openWorldHint": False},
    "kill_process": {"destructiveHint": True, "idempotentHint": True},
    "create_run_close": {"destructiveHint": False, "readOnlyHint": False},
    "move_file": {"destructiveHint": False},
}


async def test_every_tool_has_a_title_and_the_named_ones_the_right_hints(demo_config_path: Path) -> None:
    """The demo has no network allowed: run_command and execute_code reach nothing outside (openWorldHint false)."""
    tools, _ = await served(demo_config_path)
    titles = {name: tool.get("title", "") for name, tool in tools.items()}
    assert all(titles.values()), [name for name, title in titles.items() if not title]
    assert len(set(titles.values())) == len(titles), "two tools share a title"
    for name, hints in EXPECTED_HINTS.items():
        annotations = tools[name]["annotations"]
        assert {key: annotations[key] for key in hints} == hints, name
    for name, tool in tools.items():
        annotations = tool["annotations"]
        assert set(annotations) >= {"readOnlyHint", "destructiveHint", "idempotentHint", "openWorldHint"}, name
        if annotations["readOnlyHint"]:
            assert not annotations["destructiveHint"], name


async def test_allowed_network_makes_command_tools_open_world(demo_config_path: Path) -> None:
    demo_config_path.write_text(demo_config_path.read_text() + '\n[sandboxes.network]\nallow = ["example.org"]\n')
    tools, _ = await served(demo_config_path)
    for name in ("run_command", "execute_code", "create_run_close"):
        assert tools[name]["annotations"]["openWorldHint"] is True, name
    assert "network_allow names destinations" in tools["create_sandbox"]["description"]


async def test_run_command_says_what_differs_between_a_host_workspace_and_a_sandbox(demo_config_path: Path) -> None:
    tools, instructions = await served(demo_config_path)
    text = tools["run_command"]["description"]
    assert "In a sandbox (sandbox_id from create_sandbox) it runs with sh -c" in text
    assert "In a host workspace no shell runs" in text
    assert "sh -c" in tools["create_sandbox"]["description"]
    assert "Not offered" in instructions  # the demo's gateway has no host key


async def test_every_template_named_to_the_model_can_be_created(demo_config_path: Path) -> None:
    """Before, "default" was named nowhere but was also refused by name (NOT_FOUND) when no template had it;
    now each name list_templates gives creates a sandbox of that template, and an unknown one says where to look."""
    demo_config_path.write_text(
        demo_config_path.read_text() + '\n[[template]]\nname = "strict"\n[template.policy]\nallow = ["ls"]\n'
    )
    services = build_services(load_config(demo_config_path))
    try:
        async with Client(build_server(services, caller="test")) as client:
            listed = await call(client, "list_templates")
            names = [t["name"] for t in listed["detail"]["templates"]]
            assert "strict" in names
            assert len(names) >= 2
            for name in names:
                created = await call(client, "create_sandbox", template=name)
                assert created["ok"], created
                assert created["detail"]["template"] == name
            unknown = await call(client, "create_sandbox", template="nope")
            assert unknown["code"] == "NOT_FOUND"
            assert "list_templates" in unknown["reason"]
    finally:
        services.close()
