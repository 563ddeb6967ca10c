"""Fixtures for the organizer: a real inbox folder and state folder under tmp_path (helpers in trees.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bastion.config import InboxConfig
from bastion.organizer import Organizer


@pytest.fixture
def inbox_dir(tmp_path: Path) -> Path:
    path = tmp_path / "inbox"
    path.mkdir()
    return path


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    path = tmp_path / "state"
    path.mkdir()
    return path


@pytest.fixture
def organizer(inbox_dir: Path, state_dir: Path) -> Iterator[Organizer]:
    built = Organizer(InboxConfig(id="inbox", path=inbox_dir), state_dir)
    assert built.open() is None
    yield built
    built.close()
