"""`tools/list` is a contract with every client: names, descriptions, schemas and annotations only
change on purpose. The list served for the demo config is compared byte for byte with a committed
snapshot; to change it deliberately, run with BASTION_UPDATE_TOOLS_SNAPSHOT=1 and review the diff.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from mcp import Client

from bastion.app import build_server, build_services
from bastion.config import load_config
from tests.helpers import demo_config_at

SNAPSHOT = Path(__file__).with_name("tools_list.json")

pytestmark = pytest.mark.bwrap


async def _served(tmp_path: Path) -> str:
    config = load_config(demo_config_at(tmp_path / "demo", None))
    services = build_services(config)
    try:
        async with Client(build_server(services, caller="test")) as client:
            listed = await client.list_tools()
    finally:
        services.close()
    tools = [tool.model_dump(mode="json", by_alias=True, exclude_none=True) for tool in listed.tools]
    return json.dumps(sorted(tools, key=lambda tool: tool["name"]), indent=1, ensure_ascii=False) + "\n"


@pytest.mark.anyio
async def test_tools_list_is_the_committed_snapshot(tmp_path: Path) -> None:
    served = await _served(tmp_path)
    if os.environ.get("BASTION_UPDATE_TOOLS_SNAPSHOT") == "1":
        SNAPSHOT.write_text(served)
    assert served == SNAPSHOT.read_text(), "tools/list changed: if on purpose, update the snapshot (see the docstring)"
