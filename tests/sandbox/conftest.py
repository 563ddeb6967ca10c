"""A bare warm sandbox (no cgroups, no server) for the backend's own tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bastion.sandbox import SandboxSpec
from bastion.sandbox.warm import WarmSandbox


@pytest.fixture
async def sandbox(tmp_path: Path) -> AsyncIterator[WarmSandbox]:
    ws = tmp_path / "ws"
    ws.mkdir()
    box = WarmSandbox(SandboxSpec(workspace=str(ws)))
    yield box
    box.close()
