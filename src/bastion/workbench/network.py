"""A sandbox's way out: its egress proxy on the host and the forwarder inside.

Every sandbox sees a folder of the host read-only at /run/bastion. When the sandbox
gets network (an allowlist at creation, or the package registry during an install),
the host's egress proxy (`bastion.egress.proxy`) listens on a unix socket in that
folder and a forwarder (`bastion.sandbox.inside.forwarder`) runs inside as a background
process, relaying 127.0.0.1:3128 to it. Commands get ``HTTP(S)_PROXY`` pointing there.
The proxy decides every destination; a program that ignores the variables has no route.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Final

from bastion.config import AllowRule
from bastion.egress.proxy import EgressService
from bastion.safety.errors import SandboxNotFound, Unavailable
from bastion.sandbox import EGRESS_DIR, EGRESS_SOCKET_NAME, FORWARDER_PATH, sandbox_python
from bastion.sandbox.backend import Process
from bastion.workbench.workspace import HostWorkspace

logger = logging.getLogger("bastion.network")

INSIDE_DIR: Final = EGRESS_DIR
SOCKET_NAME: Final = EGRESS_SOCKET_NAME
PROXY_PORT: Final = 3128
PROXY_URL: Final = f"http://127.0.0.1:{PROXY_PORT}"
READY_TIMEOUT_S: Final = 10.0


def proxy_environment() -> dict[str, str]:
    """What commands need to find the proxy (upper and lower case: tools read one or the other)."""
    env = {"NO_PROXY": "localhost,127.0.0.1,::1", "no_proxy": "localhost,127.0.0.1,::1"}
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        env[name] = PROXY_URL
    return env


class SandboxNetwork:
    """The egress of one sandbox: its allowlist, its proxy, its forwarder."""

    def __init__(
        self,
        sandbox_id: str,
        socket_dir: Path,
        egress: EgressService | None,
        rules: Sequence[AllowRule],
        owner: tuple[int, int] | None = None,
    ) -> None:
        self.sandbox_id = sandbox_id
        self._owner = owner  # who may connect to the proxy's socket: the sandbox's host identity
        self.rules = tuple(rules)
        self._socket = socket_dir / SOCKET_NAME
        self._egress = egress
        self._proxy_running = False
        self._forwarder: Process | None = None
        self._lock = asyncio.Lock()
        self._stopping: asyncio.Task[None] | None = None
        self._closed = False

    def summary(self) -> list[str]:
        return [str(rule) for rule in self.rules]

    async def enable(self, workspace: HostWorkspace) -> None:
        """Start the proxy with the sandbox's own allowlist, if it has one."""
        if self.rules:
            async with self._lock:
                await self._open(workspace, self.rules)

    @contextlib.asynccontextmanager
    async def widened(self, workspace: HostWorkspace, extra: Sequence[AllowRule]) -> AsyncIterator[None]:
        """The sandbox's allowlist plus `extra` (the package registry) for the duration of the block."""
        async with self._lock:
            try:
                # Inside: an open that fails after widening (the forwarder does not start) narrows too.
                await self._open(workspace, (*self.rules, *extra))
                yield
            finally:
                # A cancelled install (the client gave up) cancels every await in this scope: the
                # narrowing runs shielded, so it never depends on how far it got before that.
                await asyncio.shield(self._narrow())

    async def _open(self, workspace: HostWorkspace, rules: Sequence[AllowRule]) -> None:
        if self._egress is None:
            raise Unavailable("network egress is not available on this server")
        if self._closed:
            # Found by attack: an install that reached here after its sandbox closed started a proxy for it
            # that nothing would stop (a listener and its task for the server's life, repeatable at will).
            raise Unavailable("the sandbox was closed")
        if self._proxy_running:
            await self._egress.set_rules_async(self.sandbox_id, rules)
        else:
            # Owed a stop and a narrowing from here: a caller cancelled during this await leaves the start
            # to finish on the egress thread.
            self._proxy_running = True
            try:
                await self._egress.start_async(self.sandbox_id, rules, self._socket, self._owner)
            except Exception:
                self._proxy_running = False  # refused: it did not start
                raise
        if self._forwarder is None or self._forwarder.exited:
            self._forwarder = await _start_forwarder(workspace, f"{INSIDE_DIR}/{SOCKET_NAME}")
        workspace.extra_env.update(proxy_environment())

    async def _narrow(self) -> None:
        # Back to the sandbox's own allowlist; with none, nothing is reachable once the install is over.
        if self._egress is not None and self._proxy_running:
            with contextlib.suppress(SandboxNotFound):  # a start cancelled on its way that then failed
                await self._egress.set_rules_async(self.sandbox_id, self.rules)

    def close(self, *, stop_proxy: bool = True) -> None:
        """Stop the proxy: in the background when an event loop runs (a stop can take seconds
        to end open connections), else here. `stop_proxy=False`: the whole service is closing."""
        self._closed = True
        if self._egress is None or not self._proxy_running:
            return
        self._proxy_running = False
        if not stop_proxy:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._stop_now(self._egress)
            return
        self._stopping = loop.create_task(self._stop_later(self._egress))

    def _stop_now(self, egress: EgressService) -> None:
        try:
            egress.stop(self.sandbox_id)
        except Exception:
            logger.exception("egress proxy of %s did not stop cleanly", self.sandbox_id)

    async def _stop_later(self, egress: EgressService) -> None:
        try:
            await egress.stop_async(self.sandbox_id)
        except Exception:
            if egress.closed:  # the server closed meanwhile, and the service's close stopped every proxy
                return
            logger.exception("egress proxy of %s did not stop cleanly", self.sandbox_id)


async def _start_forwarder(workspace: HostWorkspace, socket_path: str) -> Process:
    python = sandbox_python()
    argv = [python, "-I", "-S", FORWARDER_PATH, str(PROXY_PORT), socket_path]
    process = await workspace.sandbox.spawn(
        python, argv, cwd="/", env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, ring_bytes=4096
    )
    try:
        async with asyncio.timeout(READY_TIMEOUT_S):
            while b"ready" not in process.stdout.read(0, 64)[1]:
                if process.exited:
                    break
                await asyncio.sleep(0.001)  # a create waits for this line: a coarser poll only adds to it
    except TimeoutError:
        pass
    if process.exited or b"ready" not in process.stdout.read(0, 64)[1]:
        _, err = process.stderr.read(0, 4096)
        await workspace.sandbox.kill(process)
        tail = err.decode("utf-8", "replace").strip().splitlines()
        raise Unavailable("the sandbox's network forwarder did not start" + (f": {tail[-1]}" if tail else ""))
    return process
