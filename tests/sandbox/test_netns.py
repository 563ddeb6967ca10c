"""The host's sockets in a sandbox's network namespace (`netns.py`): none is ever dropped unclosed."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import warnings

import pytest

from bastion.sandbox import netns
from bastion.sandbox.netns import NetworkNamespace

pytestmark = [pytest.mark.root]


def test_spares_made_after_the_loop_closed_are_closed_not_dropped() -> None:
    """Attack (or a server's end): the namespace is closed and its event loop ends while the thread is
    still making its spare sockets. The refill's end ran as a loop callback, which a closed loop never
    runs: the two sockets were dropped unclosed (ResourceWarning at a later garbage collection, seen
    once in a full test run). They are closed where they are made now."""
    gate = threading.Event()

    async def connect_then_close() -> None:
        namespace = NetworkNamespace(os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC))
        attempt = asyncio.ensure_future(namespace.connect(1, timeout_s=5))
        await asyncio.sleep(0)  # its own socket is being made on the thread: the refill queues behind the gate
        netns._executor().submit(gate.wait)  # the one thread, held so the refill ends late
        with pytest.raises(ConnectionRefusedError):
            await attempt  # nothing listens on port 1
        namespace.close()

    asyncio.run(connect_then_close())
    gate.set()
    netns._executor().submit(lambda: None).result(timeout=10)  # the refill has ended
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
