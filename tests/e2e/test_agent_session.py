"""A realistic agent session over stdio, driven only by what tools/list says (issue 15).

The client knows nothing but the tools' descriptions: it picks the template that holds
matplotlib from create_sandbox's description, writes a small package with tests, installs
pytest from the registry, runs the tests, starts a web server with `&` in one command and
fetches from it in the next, edits and searches files, plots, snapshots, restores and closes.
Every step's result is asserted, and nothing of the sandbox survives its close.
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path
from typing import Any

import pytest
from mcp import Client, StdioServerParameters
from mcp_types import ImageContent

from bastion.safety.audit import verify
from tests.helpers import BASTION, call, processes_with, registry_reachable, spawned_env

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap, pytest.mark.network]

CALC = "def add(a, b):\n    return a + b\n"
TESTS = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"


def template_holding(description: str, package: str) -> str | None:
    """The name of the template whose line in create_sandbox's description names `package`."""
    for line in description.splitlines():
        found = re.match(r"- ([\w.-]+)(?: \(default\))?: (.*)", line)
        if found and re.search(rf"\b{re.escape(package)}\b", found.group(2)):
            return found.group(1)
    return None


async def ok(client: Client, tool: str, **args: object) -> dict[str, Any]:
    payload = await call(client, tool, **args)
    assert payload["ok"], (tool, payload)
    detail = payload["detail"]
    assert isinstance(detail, dict)
    return detail


async def run(client: Client, box: str, command: str) -> str:
    detail = await ok(client, "run_command", sandbox_id=box, command=command)
    assert detail["exit_status"] == 0, (command, detail)
    stdout = detail["stdout"]
    assert isinstance(stdout, str)
    return stdout


async def test_an_agent_session_from_the_descriptions_alone(demo_config_path: Path) -> None:
    if not registry_reachable():
        pytest.skip("the package registry (pypi.org:443) is not reachable from this machine")
    marker = f"e2e-{secrets.token_hex(6)}"
    params = StdioServerParameters(
        command=str(BASTION), args=["serve", "--config", str(demo_config_path), "--stdio"], env=spawned_env()
    )
    async with Client(params) as client:
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
        description = tools["create_sandbox"].description or ""
        template = template_holding(description, "matplotlib")
        if template is None:
            pytest.skip("no template with matplotlib: `make install` builds the python-data environment")
        box = (await ok(client, "create_sandbox", template=template, labels={"task": marker}))["sandbox_id"]
        listed = await ok(client, "list_sandboxes", label=f"task={marker}")
        assert [entry["sandbox_id"] for entry in listed["sandboxes"]] == [box]

        await ok(client, "write_file", sandbox_id=box, path="/workspace/calc/calc.py", content=CALC)
        await ok(client, "write_file", sandbox_id=box, path="calc/test_calc.py", content=TESTS)
        await ok(client, "install_package", sandbox_id=box, name="pytest")
        assert "1 passed" in await run(client, box, "cd calc && python -m pytest -q")

        # A daemon started with '&' outlives its command; the next command reaches it.
        await run(client, box, f"mkdir -p {marker} && python3 -m http.server 8001 -d {marker} >/dev/null 2>&1 &")
        fetched = "curl -s --retry 20 --retry-connrefused -o /dev/null -w '%{http_code}' http://127.0.0.1:8001/"
        assert await run(client, box, fetched) == "200"
        leftovers = (await ok(client, "list_processes", sandbox_id=box))["processes"]
        assert any(marker in " ".join(p.get("argv", [])) for p in leftovers), leftovers
        assert processes_with(marker), "the daemon runs on the host's side of the sandbox"

        diff = (await ok(client, "edit_file", sandbox_id=box, path="calc/calc.py", old="a + b", new="b + a"))["diff"]
        assert "-    return a + b" in diff
        assert "+    return b + a" in diff
        found = await ok(client, "search_files", sandbox_id=box, pattern="def add")
        assert [(m["path"], m["line"]) for m in found["matches"]] == [("calc/calc.py", 1)], found
        assert "1 passed" in await run(client, box, "cd calc && python -m pytest -q")

        plotted = await client.call_tool(
            "execute_code", {"sandbox_id": box, "code": "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\n1 + 1"}
        )
        assert plotted.structured_content is not None
        assert plotted.structured_content["ok"], plotted
        assert plotted.structured_content["detail"]["value"] == "2"
        images = [item for item in plotted.content if isinstance(item, ImageContent)]
        assert len(images) == 1
        assert images[0].mime_type == "image/png"

        snapshot = (await ok(client, "snapshot_sandbox", sandbox_id=box))["snapshot_id"]
        await ok(client, "edit_file", sandbox_id=box, path="calc/calc.py", old="b + a", new="a - b")
        await ok(client, "close_sandbox", sandbox_id=box)
        assert not processes_with(marker), "a process of the closed sandbox survived"

        restored = (await ok(client, "restore_sandbox", snapshot_id=snapshot))["sandbox_id"]
        assert "return b + a" in (await ok(client, "read_file", sandbox_id=restored, path="calc/calc.py"))["content"]
        assert "1 passed" in await run(client, restored, "cd calc && python -m pytest -q")
        await ok(client, "close_sandbox", sandbox_id=restored)
        assert (await ok(client, "list_sandboxes"))["sandboxes"] == []
    report = verify(demo_config_path.parent / "state" / "audit.jsonl")
    assert report.ok, report.first_error
