"""execute_code through the real MCP client, in real sandboxes: persistent Python contexts,
interrupt and kill on timeout, restart, named contexts, figures as PNG images, bash and
JavaScript contexts beside Python's (test_code_languages.py has theirs), memory limits, and a
kernel that breaks the protocol."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import os
import secrets
import signal
import struct
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
from mcp import Client
from mcp_types import ImageContent

from bastion.app import Services
from bastion.safety.errors import Conflict, Unavailable
from bastion.sandbox.processes import BackgroundProcess
from bastion.workbench.code import GRACE_S
from tests.helpers import DATA_ENV, call, create, processes_with, sh

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]

needs_data_env = pytest.mark.skipif(
    not (DATA_ENV / "pyvenv.cfg").is_file(), reason="the python-data environment is built by `make install`"
)


async def run(client: Client, sandbox_id: str, code: str, **args: object) -> dict[str, Any]:
    return await call(client, "execute_code", code=code, sandbox_id=sandbox_id, **args)


def decode_png(data: bytes) -> tuple[int, int, int]:
    """Decode a PNG fully (chunk CRCs, zlib stream, scanline count); return width, height, bytes per pixel."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, kind
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    assert header is not None
    width, height, depth, color = header[:4]
    channels = {0: 1, 2: 3, 4: 2, 6: 4}[color]
    pixels = zlib.decompress(idat)
    assert len(pixels) == height * (1 + width * channels * depth // 8)
    return width, height, channels


async def test_state_persists_between_calls(client: Client) -> None:
    sandbox = await create(client)
    first = await run(client, sandbox, "import json\nnotes = open('notes.txt', 'w')\nx = 20\nprint('hi')\nx + 1")
    assert first["ok"], first
    assert first["detail"]["value"] == "21"
    assert first["detail"]["stdout"] == "hi\n"
    assert first["detail"]["execution_count"] == 1
    second = await run(client, sandbox, "notes.write(json.dumps({'x': x})); notes.close()\nx * 2")
    assert second["detail"]["value"] == "40"
    assert second["detail"]["execution_count"] == 2
    read = await call(client, "read_file", path="notes.txt", sandbox_id=sandbox)
    assert read["detail"]["content"] == '{"x": 20}'


async def test_a_module_written_in_the_workspace_imports(client: Client) -> None:
    sandbox = await create(client)
    wrote = await run(client, sandbox, "open('helper.py', 'w').write('def twice(x):\\n    return 2 * x\\n')")
    assert wrote["ok"], wrote
    used = await run(client, sandbox, "import helper\nhelper.twice(21)")
    assert used["ok"], used
    assert used["detail"].get("error") is None, used
    assert used["detail"]["value"] == "42"


async def test_an_exception_is_data_with_the_agents_traceback(client: Client) -> None:
    sandbox = await create(client)
    result = await run(client, sandbox, "def f():\n    return 1 / 0\nprint('before')\nf()")
    assert result["ok"]
    assert result["code"] == "OK"
    error = result["detail"]["error"]
    assert error["type"] == "ZeroDivisionError"
    assert 'File "<cell-1>", line 2, in f' in error["traceback"]
    assert "return 1 / 0" in error["traceback"]
    assert "run_cell" not in error["traceback"], "the kernel's own frames are not the agent's business"
    assert result["detail"]["stdout"] == "before\n"
    syntax = await run(client, sandbox, "def (:")
    assert syntax["ok"]
    assert syntax["detail"]["error"]["type"] == "SyntaxError"


async def test_fd_level_output_of_children_is_captured_in_order(client: Client) -> None:
    sandbox = await create(client)
    code = "import os, subprocess, sys\nprint('a')\nsubprocess.run(['echo', 'b'])\nos.write(2, b'c\\n')\nprint('d')"
    result = await run(client, sandbox, code)
    assert result["detail"]["stdout"] == "a\nb\nd\n"
    assert result["detail"]["stderr"] == "c\n"


async def test_timeout_interrupts_and_keeps_the_context(client: Client) -> None:
    sandbox = await create(client)
    await run(client, sandbox, "kept = 'still here'")
    result = await run(client, sandbox, "import time\nprint('started')\ntime.sleep(30)", timeout_s=0.5)
    assert not result["ok"]
    assert result["code"] == "TIMEOUT"
    assert result["detail"]["context_state"] == "alive"
    assert result["detail"]["error"]["type"] == "KeyboardInterrupt"
    assert result["detail"]["stdout"] == "started\n"
    after = await run(client, sandbox, "kept")
    assert after["ok"]
    assert after["detail"]["value"] == "'still here'"


async def test_code_that_ignores_the_interrupt_is_killed_then_restarted(client: Client) -> None:
    sandbox = await create(client)
    await run(client, sandbox, "kept = 1")
    stubborn = "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: pass"
    result = await run(client, sandbox, stubborn, timeout_s=0.3)
    assert result["code"] == "TIMEOUT"
    assert result["detail"]["context_state"] == "dead"
    dead = await run(client, sandbox, "1")
    assert dead["code"] == "CONFLICT"
    assert "restart" in dead["reason"]
    fresh = await run(client, sandbox, "'kept' in globals()", restart=True)
    assert fresh["ok"]
    assert fresh["detail"]["value"] == "False"
    assert fresh["detail"]["execution_count"] == 1


async def test_a_cell_whose_call_is_cancelled_stops_before_the_next_one(client: Client) -> None:
    """Found by attack (twenty-eighth session, a client cut off mid-call): a cancelled `execute_code` (its client
    gone, or `notifications/cancelled`) left the cell running in the kernel, unseen: the context was listed as
    idle, and the next cell waited behind it and was answered TIMEOUT. Invariant: the cancelled cell is
    interrupted (KeyboardInterrupt, as at its time limit), its state is kept, and the next cell runs at once."""
    sandbox = await create(client)
    await run(client, sandbox, "import time\nkept = 1")
    long_cell = "open('started', 'w').close()\ntime.sleep(120)\nkept = 2"
    async with anyio.create_task_group() as calls:
        calls.start_soon(run, client, sandbox, long_cell)
        with anyio.fail_after(30):
            while not (await sh(client, sandbox, "test -e started"))["ok"]:
                await anyio.sleep(0.01)  # polling, not timing
        calls.cancel_scope.cancel()  # the SDK's client tells the server (notifications/cancelled)
    listed = await call(client, "list_code_contexts", sandbox_id=sandbox)
    assert listed["ok"], listed
    after = await run(client, sandbox, "kept", timeout_s=10)
    assert after["ok"], after
    assert after["detail"]["value"] == "1"


async def test_a_cancelled_cell_slow_to_stop_is_seen_to_its_end_not_killed_with_the_next(client: Client) -> None:
    """Found by a full run (twenty-ninth session): anyio cancels a cancelled call again at each of its awaits, so
    the wait for the interrupted cell's end was itself cut; the end came unread, the context was killed at the
    grace period, and the next cell with it ("the context ended while running the code"). Here the cell takes
    a second to stop after its KeyboardInterrupt. Invariant: its end is read, the context lives and keeps what
    the cell did while stopping, and the next cell, sent once the context is idle, runs past the grace period."""
    sandbox = await create(client)
    await run(client, sandbox, "import time\nkept = 1")
    slow_to_stop = (
        "open('started', 'w').close()\n"
        "try:\n    time.sleep(120)\nexcept KeyboardInterrupt:\n    time.sleep(1)\n    kept = 2\n    raise\n"
    )
    async with anyio.create_task_group() as calls:
        calls.start_soon(run, client, sandbox, slow_to_stop)
        with anyio.fail_after(30):
            while not (await sh(client, sandbox, "test -e started"))["ok"]:
                await anyio.sleep(0.01)  # polling, not timing
        calls.cancel_scope.cancel()
    with anyio.fail_after(30):
        while True:
            listed = await call(client, "list_code_contexts", sandbox_id=sandbox)
            assert listed["ok"], listed
            (context,) = listed["detail"]["contexts"]
            assert context["state"] != "dead", context
            if context["state"] == "idle":
                break
            await anyio.sleep(0.05)  # polling, not timing
    # Longer than the grace period: a context killed at its end, as before, is killed under this cell.
    after = await run(client, sandbox, f"time.sleep({GRACE_S})\nkept", timeout_s=GRACE_S + 30)
    assert after["ok"], after
    assert after["detail"]["value"] == "2"


async def running_in_sandbox(client: Client, sandbox_id: str, pids: list[int]) -> list[int]:
    """Which of `pids` (the sandbox's own numbers) are processes running in the sandbox now: not zombies
    waiting for the agent, their parent once orphaned, to reap them."""
    test = "[ -e /proc/$p/status ] && ! grep -q '^State:.Z' /proc/$p/status"
    ran = await sh(client, sandbox_id, f"for p in {' '.join(map(str, pids))}; do {test} && echo $p; done; true")
    assert ran["ok"], ran
    return [int(line) for line in str(ran["detail"]["stdout"]).split()]


async def test_a_kernel_that_exits_leaving_a_child_in_its_own_session_leaves_nothing_running(client: Client) -> None:
    """Attack: the code starts `sleep` in a session of its own and the kernel exits (`os._exit`; an OOM kill of
    the kernel does the same). The context was dead, but its child lived on until the sandbox closed: listed as
    a left process, killed by no restart (a kill of a dead context skipped the sandbox's kill). Invariant: once
    the kernel has exited, what it left is killed, its pid is gone from the sandbox, and a restart gives a fresh
    context; another context, and the child it started likewise, live on untouched. Does not prove anything
    for a process that left the kernel's cgroup (it cannot: the sandbox sees no cgroupfs)."""
    sandbox = await create(client)
    # Unique: other runs of this test (other workers, other checkouts' suites) may be on the host at once.
    marker, other = (f"{whole}.{secrets.randbelow(10**6):06d}" for whole in (4265, 4266))
    spawn = "import os, subprocess\nchild = subprocess.Popen(['sleep', {!r}], start_new_session=True)\n"
    kept = await run(client, sandbox, spawn.format(other) + "child.pid", context="kept")
    assert kept["ok"], kept
    kept_child = int(kept["detail"]["value"])
    # The pid goes to a file: output printed just before os._exit may never leave the kernel.
    exiting = spawn.format(marker) + "open('/tmp/child', 'w').write(str(child.pid))\nos._exit(0)"
    died = await run(client, sandbox, exiting, context="dying")
    assert died["detail"]["context_state"] == "dead", died
    child = int((await sh(client, sandbox, "cat /tmp/child"))["detail"]["stdout"])
    deadline = time.monotonic() + 10
    while await running_in_sandbox(client, sandbox, [child]):
        assert time.monotonic() < deadline, "the dead kernel's child still runs"
        await anyio.sleep(0.05)
    listed = (await call(client, "list_processes", sandbox_id=sandbox))["detail"]["processes"]
    assert [entry for entry in listed if marker in " ".join(map(str, entry["argv"]))] == [], listed
    assert processes_with(marker) == []
    fresh = await run(client, sandbox, "'child' in globals()", context="dying", restart=True)
    assert fresh["detail"]["value"] == "False", fresh
    # The other context and its own child are untouched.
    assert await running_in_sandbox(client, sandbox, [kept_child]) == [kept_child]
    alive = await run(client, sandbox, "child.poll() is None", context="kept")
    assert alive["detail"]["value"] == "True", alive
    assert len(processes_with(other)) == 1
    assert (await call(client, "close_sandbox", sandbox_id=sandbox))["ok"]


async def test_named_contexts_are_separate(client: Client) -> None:
    sandbox = await create(client)
    await run(client, sandbox, "x = 'one'", context="one")
    await run(client, sandbox, "x = 'two'", context="two")
    assert (await run(client, sandbox, "x", context="one"))["detail"]["value"] == "'one'"
    assert (await run(client, sandbox, "x", context="two"))["detail"]["value"] == "'two'"
    listed = await call(client, "list_code_contexts", sandbox_id=sandbox)
    assert sorted(c["context"] for c in listed["detail"]["contexts"]) == ["one", "two"]
    bad = await run(client, sandbox, "1", context="../x")
    assert bad["code"] == "INVALID_REQUEST"


@needs_data_env
async def test_a_matplotlib_figure_comes_back_as_a_png_of_its_size(client: Client) -> None:
    sandbox = await create(client)
    code = (
        "import matplotlib.pyplot as plt\nimport numpy as np\n"
        "fig = plt.figure(figsize=(4, 3), dpi=100)\nplt.plot(np.arange(10) ** 2)\nplt.show()"
    )
    raw = await client.call_tool("execute_code", {"code": code, "sandbox_id": sandbox, "timeout_s": 60})
    payload = raw.structured_content
    assert payload is not None
    assert payload["ok"], payload
    images = [block for block in raw.content if isinstance(block, ImageContent)]
    assert len(images) == 1
    assert images[0].mime_type == "image/png"
    width, height, _ = decode_png(base64.b64decode(images[0].data))
    assert (width, height) == (400, 300)
    assert payload["detail"]["images"][0]["width"] == 400
    again = await client.call_tool("execute_code", {"code": "1", "sandbox_id": sandbox})
    assert not [b for b in again.content if isinstance(b, ImageContent)], "figures are closed once returned"


@needs_data_env
async def test_the_template_packages_are_importable(client: Client) -> None:
    sandbox = await create(client)
    result = await run(client, sandbox, "import pandas as pd\npd.DataFrame({'a': [1, 2, 3]})['a'].sum()", timeout_s=60)
    assert result["ok"], result
    assert result["detail"]["value"] in ("6", "np.int64(6)")
    command = "python -c 'import numpy; print(numpy.__name__)'"
    shell = await call(client, "run_command", command=command, sandbox_id=sandbox)
    assert shell["detail"]["stdout"] == "numpy\n"
    # The template's environment is read-only inside: no one sandbox can change it for the others.
    code = (
        "import numpy, os\ntry:\n    open(os.path.join(os.path.dirname(numpy.__file__), 'x.py'), 'w')\n"
        "except OSError as exc:\n    print(exc.errno == 30 or exc.errno == 13)"
    )
    written = await run(client, sandbox, code)
    assert written["detail"]["stdout"] == "True\n", written
    assert not list(DATA_ENV.glob("lib/python3*/site-packages/numpy/x.py"))


async def test_bash_and_javascript_run_in_their_own_contexts(client: Client) -> None:
    sandbox = await create(client)
    bash = await run(client, sandbox, "x=6; echo $((x * 7)) > out.txt; cat out.txt", language="bash")
    assert bash["ok"]
    assert bash["detail"]["stdout"] == "42\n"
    assert bash["detail"]["exit_status"] == 0
    node = await run(client, sandbox, "console.log(6 * 7)", language="javascript")
    if node["code"] == "NOT_FOUND":
        assert "languages available here: python, bash" in node["reason"]
        pytest.skip("node is not installed on this machine")
    assert node["ok"]
    assert node["detail"]["stdout"] == "42\n"
    python = await run(client, sandbox, "x = 1\nx")  # the same context name, another language: its own context
    assert python["detail"]["value"] == "1"
    failing = await run(client, sandbox, "(exit 3)", language="bash")
    assert failing["ok"]
    assert failing["detail"]["exit_status"] == 3
    assert (await run(client, sandbox, "echo $x", language="bash"))["detail"]["stdout"] == "6\n"


async def test_host_workspaces_run_no_code(client: Client) -> None:
    result = await call(client, "execute_code", code="print(1)", sandbox_id="default")
    assert result["code"] == "FORBIDDEN"


async def test_output_is_redacted_and_capped(client: Client) -> None:
    sandbox = await create(client, limits={"max_output_bytes": 2048})
    secret = "AKIA" + "ABCDEFGHIJKLMNOP"
    result = await run(client, sandbox, f"print({secret[:8]!r} + {secret[8:]!r})\nprint('x' * 10000)\n{secret!r}")
    assert secret not in str(result)
    assert result["code"] == "OUTPUT_TRUNCATED"
    assert result["detail"]["truncated"]
    assert len(result["detail"]["stdout"]) <= 2048


async def test_memory_is_bounded_by_the_sandbox(client: Client) -> None:
    sandbox = await create(client, limits={"memory_bytes": 128 * 1024 * 1024})
    result = await run(client, sandbox, "hog = bytearray(512 * 1024 * 1024)", timeout_s=30)
    assert result["code"] == "RESOURCE_LIMIT", result
    assert result["detail"]["context_state"] == "dead"
    fresh = await run(client, sandbox, "2 + 2", restart=True)
    assert fresh["detail"]["value"] == "4"


async def test_a_kernel_that_breaks_the_protocol_is_ended(client: Client) -> None:
    sandbox = await create(client)
    # The protocol channel is a fd of the kernel's process: the agent's code can write to it.
    code = (
        "import os, time\nfor fd in range(3, 20):\n    try: os.write(fd, b'not json\\n')\n"
        "    except OSError: pass\ntime.sleep(5)"
    )
    result = await run(client, sandbox, code, timeout_s=10)
    assert not result["ok"]
    assert result["detail"]["context_state"] == "dead"
    after = await run(client, sandbox, "1", restart=True)
    assert after["ok"]
    assert after["detail"]["value"] == "1"


async def test_long_running_code_reports_progress_with_its_output(client: Client) -> None:
    sandbox = await create(client)
    messages: list[str] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        messages.append(message or "")

    code = "import time\nfor i in range(3):\n    print('step', i, flush=True)\n    time.sleep(0.8)"
    raw = await client.call_tool("execute_code", {"code": code, "sandbox_id": sandbox}, progress_callback=on_progress)
    assert raw.structured_content is not None
    assert raw.structured_content["ok"]
    assert messages, "no progress was reported"
    assert "step 0" in messages[0]
    assert "step 1" in messages[-1], messages  # the output so far, not the first line again
    # Silent code reports progress too (a client may reset its request timeout on it).
    messages.clear()
    silent = await client.call_tool(
        "execute_code", {"code": "import time\ntime.sleep(2.5)", "sandbox_id": sandbox}, progress_callback=on_progress
    )
    assert silent.structured_content is not None
    assert silent.structured_content["ok"]
    assert messages, "silent code reported no progress"
    assert messages[0] == "running; no output yet"


async def test_a_context_start_cancelled_before_its_kernel_is_ready_leaves_no_kernel(
    services: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: a call cancelled (its client gone) while a new context's kernel was starting left
    the kernel running, owned by nobody (a context is kept only once started): its three pipes and its
    processes stayed until the sandbox closed, uncounted by the contexts' cap, once per cancelled call.
    Invariant: the kernel is killed and its pipes closed."""
    box = await services.sandboxes.create(owner="test")
    sandbox = box.workspace.sandbox
    spawned = asyncio.Event()
    real_spawn = sandbox.spawn

    async def spawn(*args: Any, **kwargs: Any) -> Any:
        process = await real_spawn(*args, **kwargs)
        spawned.set()
        return process

    monkeypatch.setattr(sandbox, "spawn", spawn)
    try:
        starting = asyncio.ensure_future(
            box.code.run("1", language="python", context="cut", restart=False, timeout_s=None, progress=_quiet)
        )
        await asyncio.wait_for(spawned.wait(), 30)
        assert not starting.done()  # its kernel is starting, not ready yet
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting
        assert sandbox._background == {}  # type: ignore[attr-defined]
        again = await box.code.run(
            "1 + 1", language="python", context="cut", restart=False, timeout_s=None, progress=_quiet
        )
        assert again.value == "2"
    finally:
        await services.sandboxes.close(box.id)


async def test_a_cell_cancelled_while_its_code_is_still_being_sent_leaves_the_context_whole(services: Services) -> None:
    """Left alone by the twenty-eighth session, found by reading: a call cancelled while its cell's code was still
    going into the kernel's pipe (code over the pipe's 64 KiB, a kernel slow to read) left half a request line
    there. The next cell's request completed that line, the kernel's reader failed on it and read nothing more:
    the next cell waited out its whole time limit, then the context was killed. Here the kernel is stopped
    (SIGSTOP) so the pipe fills, the call is cancelled mid-send, and the kernel resumed. Invariant: the request
    goes in whole (or the context is ended), and the next cell runs at once in a live context."""
    box = await services.sandboxes.create(owner="test")
    run = functools.partial(box.code.run, language="python", context="cut", restart=False, progress=_quiet)
    try:
        kernel, sending = await stopped_mid_send(box, run)
        try:
            sending.cancel()
        finally:
            os.kill(kernel, signal.SIGCONT)
        with pytest.raises(asyncio.CancelledError):
            await sending
        with anyio.fail_after(GRACE_S + 20):
            after = await run("kept + 1", timeout_s=GRACE_S + 10)
        assert not after.timed_out, after
        assert after.value in ("2", "3"), after  # the cancelled cell was interrupted, or ran to its end
    finally:
        await services.sandboxes.close(box.id)


async def test_a_cell_whose_code_cannot_go_in_whole_ends_its_context_not_the_next_cell(services: Services) -> None:
    """The other half of the test above: the kernel takes no input for the whole grace period, and half a request
    line is in its pipe. Invariant: the context is ended (listed dead, its kernel gone) and says so; a restart
    gives a working context, instead of a next cell sent into a garbled pipe."""
    box = await services.sandboxes.create(owner="test")
    marker = f"held-{secrets.token_hex(8)}"
    run = functools.partial(box.code.run, language="python", context="cut", progress=_quiet, timeout_s=None)
    try:
        await run(f"held = open('/tmp/{marker}', 'w')", restart=False)
        (kernel,) = processes_holding(marker)
        os.kill(kernel, signal.SIGSTOP)
        try:
            with pytest.raises(Unavailable, match="not taking input"):
                await run("#" * (512 * 1024), restart=False)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(kernel, signal.SIGCONT)
        with anyio.fail_after(30):
            while processes_holding(marker):  # killed: gone once the kernel has reaped it
                await asyncio.sleep(0.01)  # polling, not timing
        with pytest.raises(Conflict, match="dead"):
            await run("1", restart=False)
        assert (await run("1 + 1", restart=True)).value == "2"
    finally:
        await services.sandboxes.close(box.id)


@pytest.mark.parametrize("cancelled", [False, True], ids=["call-waits", "call-cancelled"])
async def test_a_pause_mid_send_ends_the_context_though_its_kernel_cannot_be_killed_yet(
    services: Services, cancelled: bool
) -> None:
    """Found by review of the fix above: a sandbox paused (pause_sandbox, or a snapshot's freeze) while a cell's
    code was still going in refused the kill of the cut-short context (`Conflict`), which stayed listed alive and
    idle with half a request in its input; after resume the next cell waited out its whole time limit.
    Invariant: the context is dead from then on, and says so; a restart after resume gives a working one."""
    box = await services.sandboxes.create(owner="test")
    run = functools.partial(box.code.run, language="python", context="cut", progress=_quiet)
    paused = False
    try:
        kernel, sending = await stopped_mid_send(box, functools.partial(run, restart=False))
        try:
            await services.sandboxes.pause(box.id)
            paused = True
        finally:
            os.kill(kernel, signal.SIGCONT)  # still frozen by the pause
        if cancelled:
            sending.cancel()
        with pytest.raises((Unavailable, asyncio.CancelledError)):
            await sending
        (listed,) = box.code.contexts()
        assert listed["state"] == "dead", listed
        await services.sandboxes.resume(box.id)
        paused = False
        with pytest.raises(Conflict, match="dead"):
            await run("1", restart=False, timeout_s=10)
        assert (await run("1 + 1", restart=True, timeout_s=30)).value == "2"
    finally:
        if paused:
            await services.sandboxes.resume(box.id)
        await services.sandboxes.close(box.id)


async def test_a_cell_cancelled_twice_mid_send_is_stopped_before_the_next_cell_runs(services: Services) -> None:
    """Found by review: a second plain asyncio cancel (a timeout's, a shutdown's) cut `execute`'s wait for the
    cancelled cell's stop; the context was let go while the cell was still going in, the next cell was sent
    meanwhile, and the old cell's interrupt waited out the grace period and killed the context under it.
    Invariant: the context stays busy until the cancelled cell has stopped; the next cell runs in it, alive."""
    box = await services.sandboxes.create(owner="test")
    run = functools.partial(box.code.run, language="python", context="cut", restart=False, progress=_quiet)
    try:
        kernel, sending = await stopped_mid_send(box, run)
        try:
            sending.cancel()
            with anyio.fail_after(30):
                while not any("_stop_cancelled" in repr(t.get_coro()) for t in asyncio.all_tasks()):
                    await asyncio.sleep(0)  # until the first cancel has reached the stop
            sending.cancel()
        finally:
            os.kill(kernel, signal.SIGCONT)
        with pytest.raises(asyncio.CancelledError):
            await sending
        with anyio.fail_after(GRACE_S + 30):
            after = await run(f"import time\ntime.sleep({GRACE_S + 1})\nkept + 1", timeout_s=GRACE_S + 20)
        assert after.context_alive, after
        assert not after.timed_out, after
        assert after.value in ("2", "3"), after  # the cancelled cell was interrupted, or ran to its end
    finally:
        await services.sandboxes.close(box.id)


async def stopped_mid_send(box: Any, run: Callable[..., Awaitable[Any]]) -> tuple[int, asyncio.Future[Any]]:
    """Context "cut" started (`kept = 1`), its kernel stopped (SIGSTOP), and a cell of code over the pipe's 64 KiB
    (`kept = 2` at its end) sent as a task: the kernel's pid and the task, once the send waits for room in the
    pipe. The caller sends SIGCONT."""
    marker = f"held-{secrets.token_hex(8)}"
    await run(f"held = open('/tmp/{marker}', 'w')\nkept = 1", timeout_s=None)
    (kernel,) = processes_holding(marker)
    process = box.code._contexts[("python", "cut")]._process
    assert isinstance(process, BackgroundProcess)
    os.kill(kernel, signal.SIGSTOP)
    try:
        sending = asyncio.ensure_future(run("#" * (512 * 1024) + "\nkept = 2", timeout_s=None))
        with anyio.fail_after(30):
            while process._writable is None:  # the pipe is full: the send waits for room
                await asyncio.sleep(0.001)  # polling, not timing
    except BaseException:
        os.kill(kernel, signal.SIGCONT)
        raise
    return kernel, sending


def processes_holding(marker: str) -> list[int]:
    """Host pids with an open file whose path contains `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        if any(marker in link for link in links):
            found.append(int(pid))
    return found


async def _quiet(message: str) -> None:
    """A progress callback that drops the message."""
