"""Start-up refusals for inboxes, and the `inbox` argument with several inboxes."""

from __future__ import annotations

from pathlib import Path

import pytest
from mcp import Client

from bastion.app import build_server, build_services
from bastion.config import load_config
from bastion.safety.errors import ConfigError
from tests.helpers import call


def _add_inbox(config: Path, inbox_id: str, path: str) -> None:
    with config.open("a", encoding="utf-8") as handle:
        handle.write(f'\n[[inbox]]\nid = "{inbox_id}"\npath = "{path}"\n')


def test_inbox_inside_state_dir_is_refused(demo_config_path: Path) -> None:
    (demo_config_path.parent / "state" / "in").mkdir()
    _add_inbox(demo_config_path, "second", "state/in")
    with pytest.raises(ConfigError, match="overlap"):
        load_config(demo_config_path)


def test_overlapping_inboxes_are_refused(demo_config_path: Path) -> None:
    (demo_config_path.parent / "inbox" / "sub").mkdir()
    _add_inbox(demo_config_path, "second", "inbox/sub")
    with pytest.raises(ConfigError, match="inboxes 'inbox' and 'second' overlap"):
        load_config(demo_config_path)


def test_skip_rule_without_layer_is_refused(demo_config_path: Path) -> None:
    text = demo_config_path.read_text(encoding="utf-8")
    demo_config_path.write_text(text.replace('layer = "restraint"\n', "", 1), encoding="utf-8")
    with pytest.raises(ConfigError, match="layer"):
        load_config(demo_config_path)


@pytest.mark.anyio
async def test_inbox_argument_picks_the_inbox(demo_config_path: Path) -> None:
    second = demo_config_path.parent / "downloads"
    second.mkdir()
    _add_inbox(demo_config_path, "downloads", "downloads")
    (second / "a.pdf").write_bytes(b"a")
    (demo_config_path.parent / "inbox" / "b.pdf").write_bytes(b"b")
    services = build_services(load_config(demo_config_path))
    try:
        async with Client(build_server(services, caller="test")) as client:
            moved = await call(client, "move_file", src="a.pdf", dest="Docs/a.pdf", inbox="downloads")
            assert moved["ok"] is True, moved
            assert (second / "Docs" / "a.pdf").exists()
            default = await call(client, "list_files")
            names = [e["name"] for e in default["detail"]["entries"]]
            assert names == ["b.pdf"]
            undone = await call(client, "undo_last_action")
            assert undone["code"] == "NOT_FOUND"  # the default inbox has nothing to undo
            undone = await call(client, "undo_last_action", inbox="downloads")
            assert undone["ok"] is True
            assert (second / "a.pdf").exists()
    finally:
        services.close()
