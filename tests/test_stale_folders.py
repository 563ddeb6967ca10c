"""A host workspace or inbox folder deleted or renamed and re-created under a running server is
refused with UNAVAILABLE (restart the server), never served from the old folder."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
from mcp import Client

from bastion.app import build_server, build_services
from bastion.config import load_config
from tests.helpers import call

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]

HOW = ["deleted", "renamed"]


def _replace(folder: Path, how: str) -> Path | None:
    """Delete (or rename aside) `folder` and make a new one at its path, same owner and mode.

    Returns where the old folder's files are now (None: deleted)."""
    info = folder.stat()
    aside = None
    if how == "deleted":
        shutil.rmtree(folder)
    else:
        aside = folder.with_name(folder.name + "-old")
        folder.rename(aside)
    folder.mkdir(mode=info.st_mode & 0o7777)
    os.chown(folder, info.st_uid, info.st_gid)
    return aside


def _files(folder: Path | None) -> list[str]:
    return [] if folder is None else sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _unavailable(result: dict[str, object], what: str) -> None:
    assert result["code"] == "UNAVAILABLE", result
    reason = str(result["reason"])
    assert what in reason, reason
    assert "while the server ran" in reason
    assert "restart the server" in reason


@pytest.mark.parametrize("how", HOW)
async def test_workspace_folder_replaced_under_server_answers_unavailable(
    demo_config_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Invariant: once the configured folder of a host workspace is deleted or renamed and a new
    one made at its path, every tool on that workspace answers UNAVAILABLE saying to restart (one
    error line in the server log), nothing is written to the old folder or the new one, and a
    restarted server serves the new folder. Does not prove anything about a replacement racing a
    call already past the check (the check is point-in-time)."""
    config = load_config(demo_config_path)
    workspace = config.workspace[0].path
    services = build_services(config)
    try:
        async with Client(build_server(services, caller="test")) as client:
            assert (await call(client, "write_file", path="before.txt", content="x"))["ok"] is True
            aside = _replace(workspace, how)
            (workspace / "new.txt").write_text("new\n")
            old_files = _files(aside)
            with caplog.at_level(logging.ERROR, logger="bastion.workspaces"):
                listed = await call(client, "list_directory", path=".")
                wrote = await call(client, "write_file", path="after.txt", content="x")
                ran = await call(client, "run_command", command="touch ran.txt")
                read = await call(client, "read_file", path="new.txt")
            for result in (listed, wrote, ran, read):
                _unavailable(result, f"workspace 'default': its folder {workspace} was")
            assert _files(workspace) == ["new.txt"]
            assert _files(aside) == old_files
    finally:
        services.close()
    errors = [r for r in caplog.records if r.name == "bastion.workspaces" and r.levelno == logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    services = build_services(config)
    try:
        async with Client(build_server(services, caller="test")) as client:
            listed = await call(client, "list_directory", path=".")
    finally:
        services.close()
    assert [e["name"] for e in listed["detail"]["entries"]] == ["new.txt"]


@pytest.mark.parametrize("how", HOW)
async def test_inbox_folder_replaced_under_server_answers_unavailable(
    demo_config_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Invariant: once an inbox folder is deleted or renamed and a new one made at its path, every
    organizer tool answers UNAVAILABLE saying to restart (not an empty listing, "moved: 0" or
    NOT_FOUND), one error line is logged, nothing moves in either folder, an earlier plan is not
    spent, and a restarted server organizes the new folder."""
    config = load_config(demo_config_path)
    inbox = config.inbox[0].path
    (inbox / "old.pdf").write_bytes(b"old")
    services = build_services(config)
    try:
        async with Client(build_server(services, caller="test")) as client:
            planned = await call(client, "plan_organize")
            assert planned["ok"] is True, planned
            aside = _replace(inbox, how)
            (inbox / "new.pdf").write_bytes(b"new")
            old_files = _files(aside)
            with caplog.at_level(logging.ERROR, logger="bastion.organizer"):
                results = [
                    await call(client, "list_files"),
                    await call(client, "plan_organize"),
                    await call(client, "apply_plan", plan_id=planned["detail"]["plan_id"]),
                    await call(client, "move_file", src="new.pdf", dest="Documents/new.pdf"),
                    await call(client, "undo_last_action"),
                    await call(client, "redo_last_action"),
                ]
            for result in results:
                _unavailable(result, f"the inbox folder {inbox} was")
            assert _files(inbox) == ["new.pdf"]
            assert _files(aside) == old_files
    finally:
        services.close()
    errors = [r for r in caplog.records if r.name == "bastion.organizer" and r.levelno == logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    services = build_services(config)
    try:
        async with Client(build_server(services, caller="test")) as client:
            moved = await call(client, "move_file", src="new.pdf", dest="Documents/new.pdf")
    finally:
        services.close()
    assert moved["ok"] is True, moved
    assert (inbox / "Documents" / "new.pdf").read_bytes() == b"new"
