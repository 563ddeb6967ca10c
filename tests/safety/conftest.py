"""Fixtures of the jail's tests: a workspace folder, a folder outside it holding a secret, and a jail on
the workspace (test_paths_view.py makes its own, with a sandbox's view)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bastion.safety.paths import Jail


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    return root


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "secret.txt").write_text("OUTSIDE-SECRET")
    return folder


@pytest.fixture
def jail(ws: Path) -> Iterator[Jail]:
    with Jail(ws) as j:
        yield j
