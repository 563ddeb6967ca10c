"""The organizer tools through the SDK's real client on the real server built from the demo config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mcp import Client

from bastion.app import Services
from bastion.safety.audit import verify
from bastion.tools.server import ORGANIZER
from tests.helpers import call

pytestmark = pytest.mark.anyio

TOOLS = ("list_files", "plan_organize", "apply_plan", "move_file", "undo_last_action", "redo_last_action")


def _inbox(services: Services) -> Path:
    return services.config.inbox[0].path


async def test_tools_are_listed_under_the_organizer_scope(client: Client) -> None:
    listed = {tool.name: tool for tool in (await client.list_tools()).tools}
    for name in TOOLS:
        assert name in listed
        annotations = listed[name].annotations
        assert annotations is not None
        assert annotations.destructive_hint is False


def test_tools_carry_the_organizer_scope(services: Services) -> None:
    from bastion.app import build_server

    server = build_server(services, caller="test")
    assert {name: server.tool_scopes[name] for name in TOOLS} == dict.fromkeys(TOOLS, ORGANIZER)


async def test_plan_apply_undo_redo_over_mcp(client: Client, services: Services) -> None:
    inbox = _inbox(services)
    (inbox / "report.pdf").write_bytes(b"pdf")
    (inbox / "cat.png").write_bytes(b"png")
    (inbox / "setup.exe").write_bytes(b"exe")

    listed = await call(client, "list_files")
    assert listed["ok"] is True
    by_name = {e["name"]: e for e in listed["detail"]["entries"]}
    assert by_name["setup.exe"]["code"] == "NEEDS_EXPLICIT_REQUEST"

    planned = await call(client, "plan_organize")
    assert planned["ok"] is True
    assert not (inbox / "Documents").exists()
    plan_id = planned["detail"]["plan_id"]

    applied = await call(client, "apply_plan", plan_id=plan_id)
    assert applied["ok"] is True, applied
    assert (inbox / "Documents" / "report.pdf").read_bytes() == b"pdf"
    again = await call(client, "apply_plan", plan_id=plan_id)
    assert again["code"] == "NOT_FOUND"

    moved = await call(client, "move_file", src="setup.exe", dest="Installers/setup.exe")
    assert moved["ok"] is True, moved
    undone = await call(client, "undo_last_action")
    assert undone["ok"] is True
    assert (inbox / "setup.exe").exists()
    undone = await call(client, "undo_last_action")
    assert undone["ok"] is True
    assert sorted(p.name for p in inbox.iterdir()) == ["cat.png", "report.pdf", "setup.exe"]
    redone = await call(client, "redo_last_action")
    assert redone["ok"] is True
    assert (inbox / "Images" / "cat.png").exists()

    report = verify(services.config.audit_path)
    assert report.ok, report
    records = [json.loads(line) for line in services.config.audit_path.read_text().splitlines()]
    ends = [r for r in records if r.get("event") == "end" and r["tool"] == "apply_plan"]
    assert ends[0]["code"] == "OK"
    assert "report.pdf" in ends[0]["files"]
    starts = [r for r in records if r.get("event") == "start"]
    assert {r["tool"] for r in starts} >= {"apply_plan", "move_file", "undo_last_action", "redo_last_action"}


async def test_conflict_and_unknown_inbox_are_typed_refusals(client: Client, services: Services) -> None:
    inbox = _inbox(services)
    (inbox / "a.txt").write_bytes(b"a")
    (inbox / "b.txt").write_bytes(b"b")
    refused = await call(client, "move_file", src="a.txt", dest="b.txt")
    assert refused["code"] == "CONFLICT"
    assert (inbox / "b.txt").read_bytes() == b"b"
    unknown = await call(client, "list_files", inbox="nope")
    assert unknown["code"] == "SANDBOX_NOT_FOUND"
    extra = await call(client, "list_files", root="/")
    assert extra["code"] == "INVALID_REQUEST"
    nothing = await call(client, "undo_last_action")
    assert nothing["code"] == "NOT_FOUND"


@pytest.mark.parametrize("tool", ["list_files", "plan_organize", "undo_last_action"])
async def test_an_unknown_inboxs_huge_id_is_cut_in_the_answer_and_its_record(client: Client, tool: str) -> None:
    """Found by review (twenty-seventh session): the refusal quoted the inbox id whole (`{inbox!r}`): a 1.3 M
    zero-width-space id (3.9 MB) came back as a 20.8 MB answer over HTTP, and two such clients held another
    grant's ping up to 747 ms. Invariant: the refusal is typed and small."""
    refused = await call(client, tool, inbox="\u200b" * 200_000)
    assert refused["code"] == "SANDBOX_NOT_FOUND", refused
    assert len(json.dumps(refused)) < 2048, len(json.dumps(refused))


def test_demo_inbox_has_the_default_categories_and_rules(services: Services) -> None:
    from bastion.config import DEFAULT_CATEGORIES, DEFAULT_SKIP_RULES

    inbox = services.config.inbox[0]
    assert inbox.categories == DEFAULT_CATEGORIES
    assert inbox.skip == DEFAULT_SKIP_RULES


def test_start_up_rolls_back_an_interrupted_apply(demo_config_path: Path) -> None:
    """build_services runs the journal's recovery: a begin record without its end, with half
    of the moves done, is rolled back before any tool can run."""
    import os

    from bastion.app import build_services
    from bastion.config import load_config
    from bastion.organizer.inbox import journal_path
    from bastion.organizer.journal import Journal, Move, Txn

    config = load_config(demo_config_path)
    inbox = config.inbox[0].path
    names = [f"f{i}.pdf" for i in range(4)]
    for name in names:
        (inbox / name).write_bytes(name.encode())
    moves = tuple(
        Move(name, f"Documents/{name}", os.stat(inbox / name).st_dev, os.stat(inbox / name).st_ino) for name in names
    )
    journal = Journal(journal_path(config.state_dir, "inbox"))
    journal.open()
    journal.begin(Txn(txn=1, kind="apply", action=1, moves=moves, mkdirs=("Documents",)))
    journal.close()
    (inbox / "Documents").mkdir()
    for name in names[:2]:
        os.rename(inbox / name, inbox / "Documents" / name)

    services = build_services(config)
    try:
        assert sorted(p.name for p in inbox.iterdir()) == names
        assert services.organizers["inbox"].history.done == []
    finally:
        services.close()


async def test_plan_id_from_before_a_restart_is_a_typed_refusal(demo_config_path: Path) -> None:
    """Plans live in memory (a known limit, by choice): after a server restart apply_plan is
    NOT_FOUND telling the client to plan again, and nothing moves; undo history survives."""
    from bastion.app import build_server, build_services
    from bastion.config import load_config

    config = load_config(demo_config_path)
    inbox = config.inbox[0].path
    (inbox / "a.pdf").write_bytes(b"a")
    (inbox / "b.png").write_bytes(b"b")
    services = build_services(config)
    try:
        async with Client(build_server(services, caller="test")) as client:
            moved = await call(client, "move_file", src="b.png", dest="Pictures/b.png")
            assert moved["ok"] is True, moved
            planned = await call(client, "plan_organize")
            plan_id = planned["detail"]["plan_id"]
    finally:
        services.close()
    before = sorted(str(p.relative_to(inbox)) for p in inbox.rglob("*"))
    services = build_services(config)
    try:
        async with Client(build_server(services, caller="test")) as client:
            refused = await call(client, "apply_plan", plan_id=plan_id)
            assert refused["code"] == "NOT_FOUND", refused
            assert "server restarted" in str(refused["reason"])
            assert "plan again" in str(refused["reason"])
            assert sorted(str(p.relative_to(inbox)) for p in inbox.rglob("*")) == before
            undone = await call(client, "undo_last_action")
            assert undone["ok"] is True, undone
            assert (inbox / "b.png").read_bytes() == b"b"
    finally:
        services.close()
