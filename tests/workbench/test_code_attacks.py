"""Attacks on a Python context's protocol channel (issue #13, finding 1), through the real tools
in real sandboxes: the agent's code writes to the fd the kernel reports on. Each test checks
the refusal (the context is killed, the call says why in one line), that the event loop was
never stalled (another sandbox's calls go on), and that nothing else was lost: the sandbox, its
files and its other contexts live, and the audit log has the call."""

from __future__ import annotations

import asyncio
import logging
import statistics
import threading
import time
from typing import Any

import anyio
import pytest
from mcp import Client

from bastion.app import Services
from bastion.workbench.code import MAX_CELL_IMAGE_BYTES, MAX_CONTEXTS, MAX_IMAGES, MAX_SVG_BYTES
from tests.helpers import LoopLag, audit_record, call, create, sh

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]

# The old code stalled the loop 4.6 s per 30 MB line; a loaded 2-core machine stalls ~0.1 s on its own.
MAX_STALL_S = 0.5
MAX_BLOCKED_S = 2.0

# What the agent's code needs to write on the protocol channel of its own kernel.
CHANNEL = "import os, sys\nkernel = sys.modules['__main__']\nfd = kernel._channel['fd']\ncell = kernel._current['id']\n"


async def run(client: Client, sandbox_id: str, code: str, **args: object) -> dict[str, Any]:
    return await call(client, "execute_code", code=code, sandbox_id=sandbox_id, **args)


async def while_busy(client: Client, other: str, attack: Any) -> tuple[Any, list[float], float]:
    """Run `attack()`; meanwhile run_command("true") in sandbox `other`, one call after another.
    Returns the attack's result, the other sandbox's call times and the most CPU the loop's thread spent
    between two ticks: what the attack's handling costs the loop, whatever else the machine does (a full
    run saw a 0.53 s wall stall that a slow disk's audit sync, not the redaction, explains). A stall of
    the loop blocked in a syscall still fails, past `MAX_BLOCKED_S`."""
    outcome: list[Any] = []
    times: list[float] = []

    async def attacker() -> None:
        outcome.append(await attack())

    with LoopLag() as lag:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(attacker)
            while not outcome or not times:
                started = time.monotonic()
                result = await sh(client, other, "true")
                times.append(time.monotonic() - started)
                assert result["ok"], result
    assert lag.worst < MAX_BLOCKED_S, f"the loop was blocked {lag.worst:.2f} s"
    return outcome[0], times, lag.cpu_worst


def run_queue_wait_s() -> float:
    """How long the calling thread has waited for a CPU while runnable (0 without schedstat): the machine's
    other work (here the flooding kernels' own), which a share of the loop's time leaves out."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as stat:
            return int(stat.read().split()[1]) / 1e9
    except OSError:
        return 0.0


def assert_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    assert all(record.exc_info is None for record in caplog.records), caplog.text
    assert "Traceback" not in caplog.text


async def assert_sandbox_lives(client: Client, sandbox_id: str) -> None:
    """The sandbox, its files and its other context outlive the context that broke the protocol."""
    assert (await sh(client, sandbox_id, "cat notes.txt"))["detail"]["stdout"] == "kept\n"
    other = await run(client, sandbox_id, "x", context="other")
    assert other["ok"], other
    assert other["detail"]["value"] == "41"
    fresh = await run(client, sandbox_id, "1 + 1", restart=True)
    assert fresh["ok"], fresh
    assert fresh["detail"]["value"] == "2"


async def prepared(client: Client) -> tuple[str, str]:
    """Sandbox A (a file, a second context with state) and sandbox B."""
    a, b = await create(client), await create(client)
    await sh(client, a, "echo kept > notes.txt")
    assert (await run(client, a, "x = 41", context="other"))["ok"]
    return a, b


async def test_protocol_flood_of_30mb_lines_ends_the_context_without_stalling_the_loop(
    client: Client, services: Services, caplog: pytest.LogCaptureFixture
) -> None:
    """Invariant: five 30 MB lines on the protocol fd (which took 22 s and stalled other
    sandboxes 4.6 s each, parsed, cleaned and redacted whole on the event loop) end the context
    at the first 4 KiB of header, with one line; the loop never stalls. Does not prove a bound
    on the kernel's own CPU use (its sandbox's cgroup bounds that)."""
    caplog.set_level(logging.WARNING)
    a, b = await prepared(client)
    flood = CHANNEL + (
        'line = b\'{"event":"stream","id":\' + str(cell).encode() + b\',"name":"stdout","text":"\'\n'
        "for _ in range(5):\n    os.write(fd, line + b'x' * (30 << 20) + b'\"}\\n')\n"
    )
    started = time.monotonic()
    result, times, stall = await while_busy(client, b, lambda: run(client, a, flood, timeout_s=60))
    assert time.monotonic() - started < 15
    assert result["code"] == "OPERATION_FAILED", result
    assert result["reason"] == (
        "the context broke the protocol (a message header is longer than 4096 bytes) and was killed: "
        "run again with restart=true"
    )
    assert result["detail"]["context_state"] == "dead"
    assert stall < MAX_STALL_S, stall
    assert max(times) < 1.0, times
    record = audit_record(services.config.audit_path, result["audit_id"])
    assert record["tool"] == "execute_code"
    assert record["code"] == "OPERATION_FAILED"
    assert "broke the protocol" in str(record["reason"])
    await assert_sandbox_lives(client, a)
    assert_no_traceback(caplog)


async def test_protocol_flood_of_valid_messages_is_counted_not_cleaned(client: Client, services: Services) -> None:
    """Invariant: 200 MB of well-formed output messages past the output cap cost the loop a count
    per read, never a decode, clean or redact: the call ends promptly, truncated to the cap, and
    the context lives. Does not prove what the client sees of bytes past the cap (nothing)."""
    a, b = await prepared(client)
    flood = CHANNEL + (
        'header = b\'{"event":"stream","id":\' + str(cell).encode() + b\',"name":"stdout","bytes":1048576}\\n\'\n'
        "for _ in range(200):\n    os.write(fd, header + b'AKIA' * 262144)\n"
    )
    result, times, stall = await while_busy(client, b, lambda: run(client, a, flood, timeout_s=60))
    assert result["code"] == "OUTPUT_TRUNCATED", result
    assert result["detail"]["context_state"] == "alive"
    assert 0 < len(result["detail"]["stdout"]) <= services.config.sandboxes.limits.max_output_bytes
    assert stall < MAX_STALL_S, stall
    assert max(times) < 1.0, times
    printed = "import sys\nfor _ in range(200):\n    sys.stdout.write('z' * (1 << 20))\n"
    result, times, stall = await while_busy(client, b, lambda: run(client, a, printed, timeout_s=60))
    assert result["code"] == "OUTPUT_TRUNCATED", result
    assert stall < MAX_STALL_S, stall
    await assert_sandbox_lives(client, a)


@pytest.mark.parametrize("depth", [3000, 200_000])
async def test_protocol_deep_nesting_recursion_ends_the_context_with_one_line(
    client: Client, services: Services, caplog: pytest.LogCaptureFixture, depth: int
) -> None:
    """Invariant: a line of nested '[' (which raised RecursionError out of the parser, a traceback
    on the server's stderr) ends the context with one line: within the 4 KiB header cap it is
    invalid JSON, past it an oversize header. No traceback anywhere."""
    caplog.set_level(logging.WARNING)
    a, b = await prepared(client)
    result, _times, stall = await while_busy(
        client,
        b,
        lambda: run(client, a, CHANNEL + f"os.write(fd, b'[' * {depth} + b'\\n')\nimport time\ntime.sleep(5)"),
    )
    expected = "is not valid JSON" if depth < 4096 else "is longer than 4096 bytes"
    assert result["code"] == "OPERATION_FAILED", result
    assert expected in result["reason"], result
    assert "\n" not in result["reason"]
    assert result["detail"]["context_state"] == "dead"
    assert stall < MAX_STALL_S, stall
    assert audit_record(services.config.audit_path, result["audit_id"])["code"] == "OPERATION_FAILED"
    await assert_sandbox_lives(client, a)
    assert_no_traceback(caplog)


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ('b\'{"event":"stream","id":%d,"name":"stdout","bytes":2097152}\'', "payload is not 0 to 1048576 bytes"),
        ('b\'{"event":"image","id":%d,"bytes":99999999}\'', "payload is not 0 to 4194304 bytes"),
        ('b\'{"event":"done","id":%d,"bytes":5}\'', "a done message with a payload"),
        ('b\'{"event":"stream","id":%d,"name":"stdout","text":"\' + b\'x\' * 5000 + b\'"}\'', "longer than 4096"),
        ('b\'{"event":"shell","id":%d}\'', "unknown event 'shell'"),
        ("b'[%d]'", "not a JSON object"),
    ],
)
async def test_oversize_protocol_line_ends_context_with_the_reason(
    client: Client, services: Services, caplog: pytest.LogCaptureFixture, header: str, expected: str
) -> None:
    """Invariant: a header over 4 KiB, a payload over its kind's cap, or a header the kernel never
    sends ends the context (only it) at once, with one line that says which; the flood behind it
    is never buffered."""
    caplog.set_level(logging.WARNING)
    a, _b = await prepared(client)
    code = CHANNEL + f"os.write(fd, (({header}) % cell) + b'\\n' + b'y' * (8 << 20))\nimport time\ntime.sleep(5)"
    result = await run(client, a, code, timeout_s=30)
    assert result["code"] == "OPERATION_FAILED", result
    assert expected in result["reason"], result
    assert result["detail"]["context_state"] == "dead"
    assert audit_record(services.config.audit_path, result["audit_id"])["tool"] == "execute_code"
    await assert_sandbox_lives(client, a)
    assert_no_traceback(caplog)


TINY_FLOODS = {
    # One byte of output per message, no whitespace: the stream redactor holds the token and
    # rescanned its 16 Ki characters at each message (3.8 s stalls, another call took 10 s).
    "stream_1_byte": b'{"event":"stream","id":%d,"name":"stdout","bytes":1}\nx',
    # Bare headers: 64 KiB of them was one 15 ms callback; another sandbox's calls ran 30-50x slower.
    "ready": b'{"event":"ready"}\n',
    "value_0_bytes": b'{"event":"value","id":%d,"bytes":0}\n',
}


async def quiet_times(client: Client, sandbox_id: str, calls: int = 30) -> list[float]:
    times = []
    for _ in range(calls):
        started = time.monotonic()
        assert (await sh(client, sandbox_id, "true"))["ok"]
        times.append(time.monotonic() - started)
    return times


@pytest.mark.parametrize("flood", sorted(TINY_FLOODS))
async def test_protocol_flood_of_tiny_messages_keeps_other_sandboxes_quick(
    client: Client, services: Services, flood: str
) -> None:
    """Invariant: three seconds of well-formed tiny messages (a header with a 0 or 1 byte payload,
    ~2,000-3,600 per read) never hold the event loop, and another sandbox's run_command stays
    within a few times its quiet figure. Headers are handled MAX_HEADERS_PER_TURN per turn with
    a pause between, and stream bytes are cleaned in 64 KiB batches. Does not prove a bound on
    the server's CPU while the flood lasts (a share of one core)."""
    a, b = await prepared(client)
    quiet = statistics.median(await quiet_times(client, b))
    code = CHANNEL + (
        f"import time\nh = {TINY_FLOODS[flood]!r}\nh = h % cell if b'%d' in h else h\nchunk = h * 2000\n"
        "end = time.monotonic() + 3\nwhile time.monotonic() < end:\n    os.write(fd, chunk)\n"
    )
    result, times, stall = await while_busy(client, b, lambda: run(client, a, code, timeout_s=60))
    assert result["code"] in ("OK", "OUTPUT_TRUNCATED"), result
    assert result["detail"]["context_state"] == "alive"
    assert set(result["detail"]["stdout"]) <= {"x"}
    assert stall < MAX_STALL_S, stall
    assert statistics.median(times) < 3 * quiet + 0.02, (statistics.median(times), quiet)
    await assert_sandbox_lives(client, a)


async def test_protocol_floods_of_tiny_messages_from_many_contexts_share_one_pacing(
    client: Client, services: Services
) -> None:
    """Attack (found by review): every context a sandbox may have (eight) writes `{"event":"ready"}` x 2000 in
    a loop on its protocol fd. Headers were paced per context (64, then 1 ms), so together they kept the loop
    busy: another sandbox's run_command went from 2.4 ms to 89 ms (median). Invariant: the message handling
    of all contexts shares one pacing of the loop (`pacing.Pacer`), so eight floods cost what one did: the
    other sandbox's calls stay within a few times their quiet figure (the kernels' own CPU use alone doubles
    it on two cores), the loop's thread is never held, and the sandbox, its files and every context live.
    Does not prove a bound on the kernels' own CPU time (their sandbox's cgroup bounds that)."""
    a, b = await create(client), await create(client)
    await sh(client, a, "echo kept > notes.txt")
    names = [f"f{i}" for i in range(MAX_CONTEXTS)]
    for name in names:
        assert (await run(client, a, f"x = {len(name)}", context=name))["ok"]
    quiet = statistics.median(await quiet_times(client, b))
    code = CHANNEL + (
        'import time\nchunk = b\'{"event":"ready"}\\n\' * 2000\n'
        "end = time.monotonic() + 3\nwhile time.monotonic() < end:\n    os.write(fd, chunk)\n"
    )

    async def floods() -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(run(client, a, code, context=name, timeout_s=60) for name in names)))

    cpu_before, wall_before, waited_before = time.thread_time(), time.perf_counter(), run_queue_wait_s()
    results, times, stall = await while_busy(client, b, floods)
    cpu = time.thread_time() - cpu_before
    runnable = time.perf_counter() - wall_before - (run_queue_wait_s() - waited_before)
    for result in results:
        assert result["code"] == "OK", result
        assert result["detail"]["context_state"] == "alive"
    assert stall < MAX_STALL_S, stall
    # The mean, not the median: paced per context, the calls were fast and slow in turn (median 13-30 ms,
    # mean 45-60 ms, against ~8 ms now). The loop's thread, the other sandbox's calls and the test included,
    # was on the CPU 97% of the time it could run; ~62% now.
    assert statistics.fmean(times) < 3 * quiet + 0.02, (statistics.fmean(times), quiet)
    assert cpu / runnable < 0.8, f"the loop's thread was busy {cpu:.1f} s of {runnable:.1f} s it could run"
    assert (await sh(client, a, "cat notes.txt"))["detail"]["stdout"] == "kept\n"
    for name in names:
        assert (await run(client, a, "x * 21", context=name))["detail"]["value"] == "42"


async def test_protocol_output_in_one_byte_messages_is_whole_and_redacted(client: Client) -> None:
    """Invariant: output sent one byte per message (as the kernel sends a slow print loop's) comes
    back whole and in order, and a secret split across messages is redacted as in one piece:
    batching before cleaning loses nothing and joins nothing it should not."""
    a, _b = await prepared(client)
    code = CHANNEL + (
        "text = ''.join(f'{i}:' for i in range(8000)) + ' key AKIA' + 'ABCDEFGHIJKLMNOP' + ' end'\n"
        "for byte in text.encode():\n"
        '    os.write(fd, b\'{"event":"stream","id":%d,"name":"stdout","bytes":1}\\n\' % cell + bytes([byte]))\n'
    )
    result = await run(client, a, code, timeout_s=60)
    assert result["ok"], result
    expected = "".join(f"{i}:" for i in range(8000)) + " key [REDACTED:aws_access_key_id] end"
    assert result["detail"]["stdout"] == expected
    assert "ABCDEFGHIJKLMNOP" not in str(result)


async def test_svg_images_of_secret_shaped_text_are_redacted_off_the_loop_and_capped(client: Client) -> None:
    """Attack: the code sends 8 SVG images of 4 MiB of `token: a` lines on its own protocol channel. Each was
    redacted on the event loop in one step: 18 s in which every client and sandbox waited. An SVG over
    `MAX_SVG_BYTES` is now dropped (`truncated`); those under it are redacted in a worker thread, and returned
    within `MAX_CELL_IMAGE_BYTES` once redacted (a marker is longer than the `a` it replaces)."""
    a, b = await prepared(client)
    fill = "token: a\n"
    code = CHANNEL + (
        f"body = ('<svg>' + {fill!r} * ({MAX_SVG_BYTES} // {len(fill)})).encode()[:{MAX_SVG_BYTES}]\n"
        f"for size in [{MAX_SVG_BYTES + 1}] + [len(body)] * {MAX_IMAGES - 1}:\n"
        "    kernel.emit({'event': 'image', 'id': cell, 'mime': 'image/svg+xml', 'width': 1, 'height': 1},"
        " (body + b' ' * size)[:size])\n"
    )
    result, _, stall = await while_busy(client, b, lambda: run(client, a, code, timeout_s=60))
    assert result["ok"], result
    assert stall < MAX_STALL_S, f"the loop stalled {stall:.2f} s"
    images = result["detail"]["images"]
    assert 0 < len(images) < MAX_IMAGES - 1  # the one over the SVG cap dropped, then what did not fit
    assert sum(image["bytes"] for image in images) <= MAX_CELL_IMAGE_BYTES
    assert all(image["bytes"] > MAX_SVG_BYTES for image in images)  # redacted: every token a marker
    assert result["detail"]["truncated"] is True
    dropped = MAX_IMAGES - len(images)
    assert result["detail"]["images_note"].startswith(f"{dropped} image(s) dropped: a cell returns at most"), result
    await assert_sandbox_lives(client, a)


ONE_SHARE = 0.35
"""A quarter of the loop's time (`pacing.PACE_FACTOR`) and the loop's own turns around it."""
PRINTS_FOREVER = "import sys\nwhile True:\n    sys.stdout.write('y' * 4000 + '\\n')\n"


async def test_one_sandbox_flooding_a_terminal_and_a_code_cell_at_once_takes_one_share_of_the_loop(
    client: Client,
) -> None:
    """Attack (found by attack, 2026-12-07): one sandbox runs `yes` in a 100x250 terminal nobody reads and a code
    cell that prints without end. Terminals and code contexts each had a quarter of the loop, on timelines of
    their own: one sandbox using both had the server spend 0.42 to 0.69 cores (0.32 for the cell alone, its
    reads booked after the read). Invariant: both share one timeline, the reads included: the loop's thread is
    busy at most about a quarter of the time it could run, and both floods are still read (the terminal shows
    `y`, the cell's output is kept)."""
    box = await create(client)
    terminal = (await call(client, "open_terminal", sandbox_id=box, command="yes", rows=100, cols=250))["detail"]
    read = await call(client, "terminal_read", terminal_id=terminal["terminal_id"], wait_for="(?m)^y$", timeout_s=15)
    assert read["detail"]["matched"], read
    cpu_before, wall_before, waited_before = time.thread_time(), time.perf_counter(), run_queue_wait_s()
    cell = await run(client, box, PRINTS_FOREVER, timeout_s=6)
    cpu = time.thread_time() - cpu_before
    runnable = time.perf_counter() - wall_before - (run_queue_wait_s() - waited_before)
    assert cell["code"] == "TIMEOUT", cell
    assert cell["detail"]["stdout"].startswith("y" * 4000), cell["detail"]["stdout"][:100]
    assert cpu / runnable < ONE_SHARE, f"the loop's thread was busy {cpu:.2f} s of {runnable:.2f} s it could run"
    assert (await call(client, "close_terminal", terminal_id=terminal["terminal_id"]))["ok"]


PRINTS_1MB = "import sys\nfor _ in range(1000):\n    sys.stdout.write('z' * 1023 + '\\n')\n"


async def _one_mb_cell_s(client: Client, box: str) -> float:
    """The median time of three cells printing 1 MB, each whole."""
    times = []
    for _ in range(3):
        started = time.perf_counter()
        result = await run(client, box, PRINTS_1MB, timeout_s=120)
        times.append(time.perf_counter() - started)
        assert result["ok"], result
        assert result["detail"]["stdout"].startswith("z" * 1023 + "\n"), result["detail"]["stdout"][:80]
    return statistics.median(times)


async def test_flooded_terminals_in_one_sandbox_do_not_queue_another_sandboxs_code_cells(client: Client) -> None:
    """Attack (found by review of the shared timeline, 2026-12-07): sandbox A runs `yes` in four 100x250 terminals
    nobody reads; sandbox B prints 1 MB from a cell. With every step queued after the others' in one timeline,
    each of B's cheap reads waited a round of A's 20 ms terminal steps: 1.45 to 1.6 s against 0.03 s quiet.
    Invariant: a reader waits for its own cost times the readers waiting, so B's cell is at most a few times
    slower under A's flood, and A's terminals are still read."""
    a, b = await create(client), await create(client)
    assert (await run(client, b, "1"))["ok"]
    quiet = await _one_mb_cell_s(client, b)
    terminals = []
    for _ in range(4):
        opened = await call(client, "open_terminal", sandbox_id=a, command="yes", rows=100, cols=250)
        assert opened["ok"], opened
        terminals.append(opened["detail"]["terminal_id"])
    read = await call(client, "terminal_read", terminal_id=terminals[0], wait_for="(?m)^y$", timeout_s=15)
    assert read["detail"]["matched"], read
    flooded = await _one_mb_cell_s(client, b)
    assert flooded < 10 * quiet + 0.2, f"B's 1 MB cell took {flooded:.3f} s under A's flood, {quiet:.3f} s without"
    read = await call(client, "terminal_read", terminal_id=terminals[-1], wait_for="(?m)^y$", timeout_s=15)
    assert read["detail"]["matched"], read  # the flood is still read, only paced
    for terminal in terminals:
        assert (await call(client, "close_terminal", terminal_id=terminal))["ok"]
