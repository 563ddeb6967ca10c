"""Fixtures for the attack corpus: a fresh demo layout and the real server behind the real MCP client."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from mcp import Client

from bastion.app import build_server, build_services
from bastion.config import Config, load_config
from bastion.demo import init_demo


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class Demo:
    """A demo layout in a private temporary folder, plus a folder outside every workspace.

    ``outside`` stands in for host paths an attack must not reach (e.g. ``/tmp/outside``);
    it exists, so a server that followed a link there would succeed in creating files.
    """

    root: Path
    config_path: Path
    outside: Path
    _config: Config | None = field(default=None, repr=False)

    def set_env(self, env: dict[str, str]) -> None:
        """Give the workspace extra environment variables; only before the config is loaded."""
        assert self._config is None, "set_env must run before the config is loaded"
        text = self.config_path.read_text(encoding="utf-8")
        assert text.count("env = {}") == 1, "the demo config no longer has one 'env = {}' line"
        pairs = ", ".join(f"{name} = {json.dumps(value)}" for name, value in env.items())
        self.config_path.write_text(text.replace("env = {}", f"env = {{ {pairs} }}"), encoding="utf-8")

    def load(self) -> Config:
        if self._config is None:
            self._config = load_config(self.config_path)
        return self._config

    @property
    def workspace(self) -> Path:
        return self.load().workspace[0].path

    @contextlib.asynccontextmanager
    async def client(self) -> AsyncIterator[Client]:
        """Build the services and the server from the config and connect the SDK's client in-process."""
        services = build_services(self.load())
        try:
            server = build_server(services, caller="attack-corpus")
            async with Client(server) as client:
                yield client
        finally:
            services.close()


@pytest.fixture
def demo(tmp_path: Path) -> Demo:
    config_path = init_demo(tmp_path / "demo")
    outside = tmp_path / "outside"
    outside.mkdir()
    return Demo(root=config_path.parent, config_path=config_path, outside=outside)
