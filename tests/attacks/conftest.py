"""Fixtures for the attack corpus: a fresh demo layout and the real server behind the real MCP client."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.attacks.demo import Demo
from tests.helpers import demo_config_at


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def demo(tmp_path: Path) -> Demo:
    config_path = demo_config_at(tmp_path / "demo")  # runnable unprivileged too (no disk quota)
    outside = tmp_path / "outside"
    outside.mkdir()
    return Demo(root=config_path.parent, config_path=config_path, outside=outside)
