"""Preview tokens (`bastion.workbench.previews`) through the real tools, in-process, with real sandboxes.

What this proves: without a preview listener (HTTP without `preview_listen`, or a stdio server) the
preview tools are not listed and the instructions say why; a token is 256 bits, dies with its sandbox
(close and the idle reaper), at its lifetime's end and with unexpose_port, and a new URL for a port
replaces the old. What it does not prove: the HTTP side (tests/transports/http/test_preview.py).
"""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from mcp import Client

from bastion.app import Services, build_server, build_services
from bastion.config import load_config
from tests.helpers import call, create

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]

BASE = "http://127.0.0.1:1"


def served(services: Services) -> Services:
    assert services.previews is not None
    services.previews.base_url = BASE
    return services


def token_of(url: str) -> str:
    return url.removeprefix(f"{BASE}/preview/").removesuffix("/")


PREVIEW_TOOLS = {"expose_port", "unexpose_port", "list_exposed_ports"}


@pytest.fixture
def demo_config_path(demo_config_path: Path) -> Path:
    """The demo config with a preview listener, as `serve --http` would serve it."""
    text = demo_config_path.read_text()
    demo_config_path.write_text(text.replace("[http]\n", '[http]\npreview_listen = "127.0.0.1:1"\n', 1))
    return demo_config_path


@pytest.mark.parametrize("caller", ["http", "stdio"])
async def test_without_a_listener_the_preview_tools_are_not_listed_and_the_instructions_say_what_to_set(
    demo_config_path: Path, caller: str
) -> None:
    text = demo_config_path.read_text()
    demo_config_path.write_text(text.replace('preview_listen = "127.0.0.1:1"\n', ""))
    why = "[http] preview_listen is not set: an administrator sets it, and an admin password, to serve them"
    services = build_services(load_config(demo_config_path))
    try:
        async with Client(build_server(services, caller=caller)) as client:
            names = {tool.name for tool in (await client.list_tools()).tools}
            instructions = client.instructions or ""
    finally:
        services.close()
    assert not names & PREVIEW_TOOLS
    assert f"expose_port and the other preview tools ({why})" in instructions


async def test_a_token_is_256_bits_and_dies_with_its_sandbox(client: Client, services: Services) -> None:
    previews = served(services).previews
    assert previews is not None
    sandbox_id = await create(client)
    url = (await call(client, "expose_port", sandbox_id=sandbox_id, port=8000))["detail"]["url"]
    token = token_of(url)
    assert len(base64.urlsafe_b64decode(token + "=")) == 32
    assert previews.lookup(token) is not None
    assert (await call(client, "close_sandbox", sandbox_id=sandbox_id))["ok"]
    assert previews.lookup(token) is None


async def test_a_token_dies_when_the_reaper_closes_its_sandbox(client: Client, services: Services) -> None:
    previews = served(services).previews
    assert previews is not None
    sandbox_id = await create(client)
    token = token_of((await call(client, "expose_port", sandbox_id=sandbox_id, port=8000))["detail"]["url"])
    services.sandboxes.get(sandbox_id).last_used = -1e9  # idle for ages
    assert sandbox_id in await services.sandboxes.reap()
    assert previews.lookup(token) is None


async def test_preview_traffic_and_other_sandboxes_previews_are_not_a_use_of_a_sandbox(
    client: Client, services: Services
) -> None:
    """Found by review (twenty-seventh session): a preview's liveness was checked with the manager's `get`, which
    counts as a use: each request through a preview URL, and each expose_port or list_exposed_ports of any other
    sandbox (they look at every preview), reset each previewed sandbox's idle time, so the reaper never closed
    them, against docs/configuration.md ("a sandbox no tool call has used"). Invariant: the reaper closes an idle
    sandbox whatever its previews see; its token dies with it."""
    previews = served(services).previews
    assert previews is not None
    idle, other = await create(client), await create(client)
    token = token_of((await call(client, "expose_port", sandbox_id=idle, port=8000))["detail"]["url"])
    services.sandboxes.get(idle).last_used = -1e9  # idle for ages
    assert previews.lookup(token) is not None  # a request through its preview URL
    assert (await call(client, "expose_port", sandbox_id=other, port=8001))["ok"]
    assert (await call(client, "list_exposed_ports", sandbox_id=other))["ok"]
    assert idle in await services.sandboxes.reap()
    assert previews.lookup(token) is None


async def test_a_token_dies_at_its_lifetimes_end(client: Client, services: Services) -> None:
    previews = served(services).previews
    assert previews is not None
    previews.lifetime_s = 0
    sandbox_id = await create(client)
    token = token_of((await call(client, "expose_port", sandbox_id=sandbox_id, port=8000))["detail"]["url"])
    assert previews.lookup(token) is None
    assert (await call(client, "list_exposed_ports", sandbox_id=sandbox_id))["detail"]["previews"] == []


async def test_a_new_url_for_a_port_replaces_the_old_one(client: Client, services: Services) -> None:
    previews = served(services).previews
    assert previews is not None
    sandbox_id = await create(client)
    first = token_of((await call(client, "expose_port", sandbox_id=sandbox_id, port=8000))["detail"]["url"])
    second = token_of((await call(client, "expose_port", sandbox_id=sandbox_id, port=8000))["detail"]["url"])
    assert first != second
    assert previews.lookup(first) is None
    assert previews.lookup(second) is not None


async def test_host_workspaces_have_no_preview_urls(client: Client, services: Services) -> None:
    served(services)
    result = await call(client, "expose_port", sandbox_id="default", port=8000)
    assert result["code"] == "FORBIDDEN"
