"""Shared fixtures: a real demo config in a temp folder, and the real server built from it."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from mcp import Client

from bastion.app import Services, build_server, build_services
from bastion.config import Config, load_config
from tests.helpers import demo_config_at


@pytest.fixture(autouse=True)
def _passable_tmp_path(request: pytest.FixtureRequest) -> None:
    """A root server's sandboxes run as ids of their own and must pass through the folders above
    their state folder (o+x); pytest makes its temp folders 0700. Opened the way an administrator
    would open /var/lib: passable, not listable."""
    if os.geteuid() != 0 or "tmp_path" not in request.fixturenames:
        return
    path: Path = request.getfixturevalue("tmp_path")
    for folder in (path, *path.parents):
        if folder == Path("/tmp"):  # noqa: S108 - pytest's base: stop at the system's
            break
        folder.chmod(folder.stat().st_mode | 0o111)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# The python-data template's environment, built by `make install`; without it the demo has no template.
DATA_ENV = Path(__file__).resolve().parents[1] / ".venv-python-data"


@pytest.fixture
def demo_config_path(tmp_path: Path) -> Path:
    return demo_config_at(tmp_path / "demo", DATA_ENV if (DATA_ENV / "pyvenv.cfg").is_file() else None)


@pytest.fixture
def demo_config(demo_config_path: Path) -> Config:
    return load_config(demo_config_path)


@pytest.fixture
def workspace(demo_config: Config) -> Path:
    return demo_config.workspace[0].path


@pytest.fixture
def services(demo_config: Config) -> Iterator[Services]:
    built = build_services(demo_config)
    yield built
    built.close()


@pytest.fixture
async def client(services: Services) -> AsyncIterator[Client]:
    """The SDK's real client, connected in-process to the real server (real sandbox, jail, audit)."""
    async with Client(build_server(services, caller="test")) as connected:
        yield connected
