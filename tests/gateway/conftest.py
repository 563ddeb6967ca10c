"""Fixtures: one real OpenSSH server playing the production host, shared by the gateway tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .lab import GatewayLab, HeldLab


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayLab]:
    started = GatewayLab.start(tmp_path_factory.mktemp("gateway") / "lab")
    yield started
    started.stop()


@pytest.fixture
def held(tmp_path: Path) -> Iterator[HeldLab]:
    lab = GatewayLab.start(tmp_path / "lab")
    held = HeldLab(lab)
    try:
        yield held
    finally:
        held.settle()
        lab.stop()
