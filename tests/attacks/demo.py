"""The attack tests' demo: a demo layout in a temporary folder, and the real server behind the real MCP client."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mcp import Client

from bastion.app import Services, build_server, build_services
from bastion.config import Config, load_config
from tests.helpers import Payload, demo_config_at


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


def configure(demo: Path, **keys: object) -> Path:
    """The demo config with `keys` set in [sandboxes] (values as TOML literals) and no warm pool."""
    path = demo_config_at(demo)
    lines = "".join(f"{key} = {value}\n" for key, value in {"warm_pool": 0, **keys}.items())
    text = path.read_text()
    for key in keys:  # the demo sets some of them: its line goes, the test's is the one
        text = re.sub(rf"(?m)^{key} = .*\n", "", text)
    assert "[sandboxes]\nenabled = true\n" in text
    path.write_text(text.replace("[sandboxes]\nenabled = true\n", f"[sandboxes]\nenabled = true\n{lines}", 1))
    return path


@contextlib.asynccontextmanager
async def serve(config_path: Path) -> AsyncIterator[tuple[Client, Services]]:
    services = build_services(load_config(config_path))
    try:
        async with Client(build_server(services, caller="test")) as client:
            yield client, services
    finally:
        services.close()


def detail(result: Payload) -> dict[str, Any]:
    found = result["detail"]
    assert isinstance(found, dict)
    return found
