"""Terminals through the real tools and real bubblewrap sandboxes: a pseudo-terminal inside the
sandbox, its screen rendered by pyte, caps, closes, and what a hostile program or caller tries."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import logging
import os
import random
import resource
import threading
import time
import unicodedata
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import anyio
import pyte
import pytest
from mcp import Client

from bastion.app import Services, build_server, build_services
from bastion.config import Config, TerminalsConfig
from bastion.safety.redact import sanitize_terminal
from bastion.workbench import screen
from bastion.workbench import terminals as terminals_module
from bastion.workbench.pacing import OUTPUT, Pacer
from bastion.workbench.screen import FEED_SLICE_BYTES, MAX_CELL_CHARS, Scrollback, Terminal
from bastion.workbench.terminals import KEYS, MAX_SEND_BYTES, MAX_WAITING_READS, Terminals
from bastion.workbench.workers import INLINE_CLEAN_CHARS
from tests.helpers import Hold, LoopLag, Payload, audit_record, call, create, processes_with, sh

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]


async def open_term(client: Client, box: str | None, command: str | None = None, **args: object) -> str:
    if command is not None:
        args["command"] = command
    opened = await call(client, "open_terminal", sandbox_id=box, **args)
    assert opened["ok"], opened
    assert opened["detail"]["state"] == "running"
    terminal_id = opened["detail"]["terminal_id"]
    assert isinstance(terminal_id, str)
    return terminal_id


async def send(client: Client, terminal: str, text: str = "", *keys: str) -> Payload:
    sent = await call(client, "terminal_send", terminal_id=terminal, text=text, keys=list(keys))
    assert sent["ok"], sent
    return sent


FG_PRINTED = r"\$ fg\s*\n\s*sh -c 'echo ar"
"""What bash prints for `fg` once its readline has given the terminal back its cooked modes."""


async def until(client: Client, terminal: str, pattern: str, timeout_s: float = 15) -> dict[str, object]:
    """terminal_read waiting for `pattern`; fails with the screen if it never matches."""
    read = await call(client, "terminal_read", terminal_id=terminal, wait_for=pattern, timeout_s=timeout_s)
    assert read["ok"], read
    detail = read["detail"]
    assert detail["matched"], f"{pattern!r} never matched:\n{detail['screen']}\n--\n{detail['scrolled_off']}"
    return dict(detail)


async def line(client: Client, terminal: str, command: str, marker: str) -> dict[str, object]:
    """Type a command line and wait for a line of its output that is exactly `marker`."""
    await send(client, terminal, command, "Enter")
    return await until(client, terminal, f"(?m)^{marker}$")


async def gone(marker: str) -> bool:
    """Whether no host process has `marker` in its command line (polled while they die)."""
    for _ in range(500):
        if not processes_with(marker):
            return True
        await anyio.sleep(0.01)
    return False


async def started(marker: str, count: int) -> list[int]:
    """The host pids with `marker`, polled until there are exactly `count`: a job the shell forked with
    `&` runs the shell's code until it execs, so its command line names the program only some time after
    the prompt is back; and setsid(1) or nohup(1) name it in their own command line until they exec (a
    group leader's setsid forks first: for a moment both match)."""
    for _ in range(500):
        found = processes_with(marker)
        if len(found) == count:
            return found
        await anyio.sleep(0.01)
    return processes_with(marker)


async def test_python_repl_keeps_state_across_sends(client: Client) -> None:
    box = await create(client)
    term = await open_term(client, box, "python3")
    await until(client, term, "(?m)^>>>$")
    await send(client, term, "x = 6 * 7", "Enter")
    await until(client, term, "(?m)^>>>$")
    await line(client, term, "print(x + 1)", "43")


async def test_ctrl_c_interrupts_a_busy_loop_and_the_repl_lives_on(client: Client) -> None:
    box = await create(client)
    term = await open_term(client, box, "python3")
    await until(client, term, "(?m)^>>>$")
    # One line, and Ctrl-C only once the loop runs: typed ahead across a `...` prompt, the second Enter
    # can sit in readline's own buffer while Python waits on the terminal (seen once in 40 runs).
    await send(client, term, 'exec(\'print("spin" + "ning")\\nwhile True: pass\')', "Enter")
    await until(client, term, "(?m)^spinning$")
    await send(client, term, "", "Ctrl-C")
    await until(client, term, "KeyboardInterrupt")
    await line(client, term, "print('alive', 40 + 2)", "alive 42")


async def test_less_renders_its_screen(client: Client) -> None:
    box = await create(client)
    lines = "\n".join(f"line {n:03d}" for n in range(1, 101))
    assert (await call(client, "write_file", sandbox_id=box, path="nums.txt", content=lines))["ok"]
    term = await open_term(client, box, "less nums.txt", rows=24, cols=80)
    shown = await until(client, term, "(?m)^line 023$")
    screen = str(shown["screen"]).splitlines()
    assert len(str(shown["screen"]).split("\n")) == 24
    assert screen[0] == "line 001"
    assert "line 024" not in str(shown["screen"])  # the last row is less's prompt
    await send(client, term, "", "PageDown")
    paged = await until(client, term, "(?m)^line 046$")
    assert "line 001" not in str(paged["screen"])
    await send(client, term, "q")
    closed = await call(client, "terminal_read", terminal_id=term, wait_for="never-shown", timeout_s=10)
    assert closed["detail"]["output_open"] is False  # less quit: the terminal's output ended


@pytest.mark.skipif(not Path("/usr/bin/vim").exists(), reason="vim is not installed")
async def test_vim_edits_a_file_through_the_terminal(client: Client) -> None:
    box = await create(client)
    term = await open_term(client, box, "vim -u NONE -N notes.txt", rows=20, cols=60)
    await until(client, term, r'"notes.txt" \[New\]')
    await send(client, term, "ihello from vim", "Escape")
    shown = await until(client, term, "(?m)^hello from vim$")
    assert str(shown["screen"]).split("\n")[1] == "~"  # vim's empty-line marker, rendered
    await send(client, term, ":wq", "Enter")
    await call(client, "terminal_read", terminal_id=term, wait_for="never-shown", timeout_s=10)
    written = await call(client, "read_file", sandbox_id=box, path="notes.txt")
    assert written["detail"]["content"] == "hello from vim\n"


async def test_read_s_password_is_not_echoed(client: Client) -> None:
    box = await create(client)
    term = await open_term(client, box)
    await send(client, term, 'read -s -p "Password: " pw; echo; echo "got ${#pw} chars"', "Enter")
    await until(client, term, "(?m)^Password:$")
    await send(client, term, "hunter2-typed", "Enter")
    shown = await until(client, term, "(?m)^got 13 chars$")
    assert "hunter2" not in str(shown["screen"]) + str(shown["scrolled_off"])


async def test_resize_is_seen_by_stty_size(client: Client) -> None:
    box = await create(client)
    term = await open_term(client, box, rows=24, cols=80)
    await line(client, term, "stty size", "24 80")
    resized = await call(client, "terminal_resize", terminal_id=term, rows=30, cols=100)
    assert resized["ok"], resized
    shown = await line(client, term, "stty size", "30 100")
    assert len(str(shown["screen"]).split("\n")) == 30
    assert (shown["rows"], shown["cols"]) == (30, 100)


async def test_tty_is_a_pts_and_job_control_works(client: Client) -> None:
    """Invariant: the program has a controlling terminal of its own session (tty names it, Ctrl-Z
    stops the foreground job, `jobs` lists it stopped, `fg` brings it back and Ctrl-C ends it)."""
    box = await create(client)
    term = await open_term(client, box)
    await line(client, term, "tty", "/dev/pts/[0-9]+")
    # A signal key only once the job holds the terminal (it says so): typed while bash still
    # reads its line, the tty would flush the typeahead and signal bash instead.
    await send(client, term, 'sh -c \'echo ar""med; read x; echo g""ot; exec sleep 100\'', "Enter")
    await until(client, term, "(?m)^armed$")
    await send(client, term, "", "Ctrl-Z")
    await until(client, term, r"Stopped\s+sh -c")
    await send(client, term, "jobs", "Enter")
    await until(client, term, r"(?m)^\[1\]\+\s+Stopped\s+sh -c 'echo")
    # The job's `read` takes "go" only once `fg` gave it the terminal back: typed before bash printed
    # the job it continues, "go" would meet readline's raw mode (no CR to NL) and never end a line.
    await send(client, term, "fg", "Enter")
    await until(client, term, FG_PRINTED)
    await send(client, term, "go", "Enter")
    await until(client, term, "(?m)^got$")
    await send(client, term, "", "Ctrl-C")
    await line(client, term, "echo status=$?", "status=130")


async def test_flood_is_paced_bounded_and_the_loop_stays_responsive(client: Client) -> None:
    """Invariant: `yes` on a terminal neither stalls the event loop nor grows the host's memory:
    reading is paced (the program waits on its full terminal), what scrolled off is capped, and
    Ctrl-C still reaches it. Does not prove a cap on the kernel's own terminal buffer."""
    box = await create(client)
    term = await open_term(client, box)
    with LoopLag() as lag:
        reads = await _flood_then_interrupt(client, term, 20)
    assert any(read["detail"]["paced"] for read in reads)
    assert all(len(read["detail"]["scrolled_off"]) <= 256 * 1024 for read in reads)
    assert lag.cpu_worst < 0.2, f"the event loop was held {lag.cpu_worst:.3f} s"


async def _flood_then_interrupt(client: Client, term: str, reads: int) -> list[Payload]:
    """Run `yes` on the terminal, read it `reads` times, then Ctrl-C it and check the shell answers."""
    await send(client, term, "yes flood-line-xyz", "Enter")
    await until(client, term, "(?m)^flood-line-xyz$")
    done = [await call(client, "terminal_read", terminal_id=term, timeout_s=1) for _ in range(reads)]
    await send(client, term, "", "Ctrl-C")
    await line(client, term, "echo done-$((40 + 2))", "done-42")
    return done


FLOODED_LINES = 30
NUMBERED_FLOOD = (
    "import sys\n"
    "print('ready', flush=True)\n"
    "sys.stdin.readline()\n"
    f"for n in range({FLOODED_LINES}):\n"
    "    sys.stdout.write(f'\\x1b[4h{n:08d} ' + 'x' * 240 + '\\n')\n"
    "print('flood-' + sys.argv[1] + '-done', flush=True)\n"
    "sys.stdin.readline()\n"
)


async def test_many_terminals_flooded_at_once_share_one_quarter_of_the_loop(client: Client) -> None:
    """Attack: flood every terminal of several sandboxes at once. Each terminal's reading was paced to a
    quarter of the loop alone, so 4 flooded terminals took 89% of it and 16 all of it (a tool call waited
    0.2 s). Invariant: the rendering of all of them together stays within the one quarter (the loop's
    thread is on the CPU under 45% of the time it could run, test and client included: 22% here, 80% when
    each was paced alone), and each terminal still shows all its output, up to its last line. Does not
    bound the programs' own CPU time, nor how long one terminal waits for the others' turns."""
    boxes = [await create(client) for _ in range(2)]
    terms: list[str] = []
    for n in range(8):
        box = boxes[n % len(boxes)]
        assert (await call(client, "write_file", sandbox_id=box, path="flood.py", content=NUMBERED_FLOOD))["ok"]
        terms.append(await open_term(client, box, f"python3 flood.py {n}", rows=100, cols=250))
    for term in terms:
        await until(client, term, "(?m)^ready$")
    shown: list[dict[str, object]] = []
    with LoopLag() as lag:
        cpu_before, wall_before, waited_before = time.thread_time(), time.perf_counter(), _run_queue_wait_s()
        for term in terms:
            await send(client, term, "", "Enter")
        for n, term in enumerate(terms):
            shown.append(await until(client, term, f"(?m)^flood-{n}-done$", timeout_s=60))
        cpu = time.thread_time() - cpu_before - lag.gc_cpu
        wall = time.perf_counter() - wall_before
        runnable = wall - (_run_queue_wait_s() - waited_before)
    assert cpu / runnable < 0.45, f"the loop's thread was busy {cpu:.1f} s of {runnable:.1f} s it could run"
    assert lag.cpu_worst < 0.2, f"the event loop was held {lag.cpu_worst:.3f} s"
    for n, (term, read) in enumerate(zip(terms, shown, strict=True)):
        rows = f"{read['scrolled_off']}\n{read['screen']}".split("\n")
        numbers = [row[:8] for row in rows if row.endswith("x" * 240)]
        assert numbers == [f"{line:08d}" for line in range(FLOODED_LINES)], numbers
        assert rows.index(f"flood-{n}-done") > rows.index(f"{FLOODED_LINES - 1:08d} " + "x" * 240)
        assert (await call(client, "close_terminal", terminal_id=term))["ok"]


def _run_queue_wait_s() -> float:
    """How long the calling thread has waited for a CPU while runnable (0 without schedstat): the machine's
    other work, which a share of the loop's time leaves out."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as stat:
            return int(stat.read().split()[1]) / 1e9
    except OSError:
        return 0.0


async def test_a_read_rendered_over_many_steps_is_read_on(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read whose rendering takes longer than a step may (STEP_BUDGET_S) is rendered over several steps,
    paced between them. Here each step renders one slice (a budget of 0), so every read ends with a cheap
    step that is not paced: reading must resume after it as after a pause. Invariant: a `seq` flood is read
    on (line 300 shows), Ctrl-C reaches the program and the shell answers. A small screen: every slice is a
    change the waiting read renders (on a 100x250 one, that took past its 15 s on a loaded machine)."""
    monkeypatch.setattr(screen, "STEP_BUDGET_S", 0.0)
    box = await create(client)
    term = await open_term(client, box, rows=24, cols=80)
    await send(client, term, "seq -f '%070.0f' 100000000", "Enter")
    for n in (100, 200, 300):
        await until(client, term, f"(?m)^0+{n}$")
    await send(client, term, "", "Ctrl-C")
    await line(client, term, "echo done-$((40 + 2))", "done-42")


FD_SETSIZE = 1024


@contextlib.contextmanager
def _fds_past_fd_setsize() -> Iterator[None]:
    """Hold every fd number up to past FD_SETSIZE, so the next fd this process opens is above it (as on a
    server with many sandboxes and connections); the soft limit raised for it, and both put back."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = FD_SETSIZE + 256
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"the hard limit on open files is {hard}: fds past {FD_SETSIZE} cannot be had")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, needed), hard))
    held: list[int] = []
    try:
        while not held or held[-1] <= FD_SETSIZE + 8:
            held.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_a_flood_on_a_terminal_whose_fd_is_past_fd_setsize_is_paced_and_read(client: Client) -> None:
    """Attack: a busy server's fds pass 1024. Pacing a flooded terminal looked at its master fd with
    select(), which refuses fds past FD_SETSIZE ("filedescriptor out of range"): the read was never
    resumed and the terminal froze. With every fd below 1030 held, `yes` is paced, Ctrl-C reaches it and
    the shell answers."""
    box = await create(client)
    with _fds_past_fd_setsize():
        term = await open_term(client, box)
        reads = await _flood_then_interrupt(client, term, 10)
    assert any(read["detail"]["paced"] for read in reads)


async def test_random_bytes_never_reach_the_client_raw(client: Client) -> None:
    box = await create(client)
    term = await open_term(client, box)
    with LoopLag() as lag:
        # Seeded, so that a run cannot draw a byte sequence that leaves the marker unreadable (SO with
        # a line-drawing G1 set, say); the full reset (RIS) after it puts the screen back in order.
        noise = "import random, sys; r = random.Random(15); sys.stdout.buffer.write(r.randbytes(300_000))"
        await send(client, term, f"python3 -c '{noise}'; printf '\\033c'; echo end-$((1 + 1))", "Enter")
        shown = await until(client, term, "(?m)^end-2$", timeout_s=60)
    assert "\x1b" not in str(shown["screen"]) + str(shown["scrolled_off"])
    assert lag.cpu_worst < 0.2, f"the event loop was held {lag.cpu_worst:.3f} s"


async def test_close_terminal_leaves_no_survivors(client: Client) -> None:
    box = await create(client)
    term = await open_term(client, box)
    await send(client, term, "sleep 91001 & setsid sleep 91002 & nohup sleep 91003 >/dev/null 2>&1 &", "Enter")
    await line(client, term, "echo started-$((1 + 2))", "started-3")
    assert len(await started("sleep\x009100", 3)) == 3
    closed = await call(client, "close_terminal", terminal_id=term)
    assert closed["ok"], closed
    assert closed["detail"]["killed"] is True
    assert processes_with("sleep\x009100") == []  # close waits until the terminal's group is empty
    again = await call(client, "terminal_read", terminal_id=term)
    assert again["code"] == "NOT_FOUND"


async def test_close_terminal_after_its_shell_exited_ends_what_the_shell_left(client: Client) -> None:
    """Found by attack (on background processes, the same kill): a shell that exited leaving a child
    (`sleep &; exit`) had close_terminal kill nothing and say `killed: false`, the child running on until
    the sandbox closed. The close ends what the terminal's program left, and says so."""
    box = await create(client)
    term = await open_term(client, box)
    await send(client, term, "setsid sleep 91011 </dev/null >/dev/null 2>&1 &", "Enter")
    assert len(await started("sleep\x0091011", 1)) == 1
    await send(client, term, "exit", "Enter")
    with anyio.fail_after(10):
        while (await call(client, "terminal_read", terminal_id=term))["detail"]["state"] != "exited":
            await anyio.sleep(0.05)
    closed = await call(client, "close_terminal", terminal_id=term)
    assert closed["ok"], closed
    assert closed["detail"]["killed"] is True
    assert processes_with("sleep\x0091011") == []  # the close waits until the terminal's group is empty


async def test_close_sandbox_ends_its_terminals(client: Client) -> None:
    box = await create(client)
    term = await open_term(client, box)
    await send(client, term, "sleep 92001 &", "Enter")
    await line(client, term, "echo up-$((2 + 2))", "up-4")
    assert await started("sleep\x0092001", 1)
    assert (await call(client, "close_sandbox", sandbox_id=box))["ok"]
    assert await gone("sleep\x0092001")
    assert (await call(client, "terminal_read", terminal_id=term))["code"] == "NOT_FOUND"


HOSTILE = (
    "import os, select, sys, tty\n"
    "tty.setraw(0)\n"
    # a title, an OSC 52 clipboard write, device status / attribute queries, private CSIs pyte's methods
    # do not take, a colour, the alternate screen
    "os.write(1, b'\\x1b]0;EVIL-TITLE\\x07\\x1b]52;c;Q0xJUEJPQVJE\\x07\\x1b[6n\\x1b[c\\x1b[>c\\x1b[5n'"
    " b'\\x1b[>4;2m\\x1b[?5A\\x1b[>1;99999999999999999999P'"
    " b'\\x1b[?1049h\\x1b[31mRED\\x1b[0m\\r\\n')\n"
    "ready, _, _ = select.select([0], [], [], 1.0)\n"
    "got = os.read(0, 100) if ready else b''\n"
    "os.write(1, b'replies=%d\\r\\n' % len(got))\n"
)


async def test_escape_sequences_are_rendered_and_queries_get_no_reply(client: Client) -> None:
    """Invariant: escapes a program prints are interpreted, never passed on (no ESC, no title, no
    clipboard text reaches the client), and the emulator writes nothing back to the program."""
    box = await create(client)
    assert (await call(client, "write_file", sandbox_id=box, path="hostile.py", content=HOSTILE))["ok"]
    term = await open_term(client, box, "python3 hostile.py")
    shown = await until(client, term, "(?m)^replies=0$")
    text = str(shown["screen"]) + str(shown["scrolled_off"])
    assert "RED" in text
    for leaked in ("\x1b", "EVIL-TITLE", "Q0xJUEJPQVJE", "\x07"):
        assert leaked not in text


ENDLESS_TITLE = "import os\nos.write(1, b'\\x1b]0;' + b'A' * 300_000 + b'\\r\\nafter-title\\r\\n')\nos.read(0, 1)\n"


async def test_an_escape_sequence_that_never_ends_is_cut(client: Client) -> None:
    """Attack: a title (OSC) that never ends, which pyte would accumulate without bound, swallowing
    all later output. Invariant: past MAX_SEQUENCE_BYTES the sequence is dropped and output shows again."""
    box = await create(client)
    assert (await call(client, "write_file", sandbox_id=box, path="title.py", content=ENDLESS_TITLE))["ok"]
    term = await open_term(client, box, "python3 title.py")
    with LoopLag() as lag:
        await until(client, term, "(?m)^after-title$", timeout_s=60)
    assert lag.cpu_worst < 0.2, f"the event loop was held {lag.cpu_worst:.3f} s"


async def test_program_that_closes_its_terminal_and_runs_on_is_killed_by_close(client: Client) -> None:
    box = await create(client)
    term = await open_term(client, box, "exec sleep 93001 </dev/null >/dev/null 2>&1")
    read = await call(client, "terminal_read", terminal_id=term, wait_for="never-shown", timeout_s=10)
    assert read["detail"]["output_open"] is False
    assert read["detail"]["state"] == "running"
    assert await started("sleep\x0093001", 1)  # the shell closes the output before it execs
    refused = await call(client, "terminal_send", terminal_id=term, text="x")
    assert refused["code"] == "CONFLICT"
    assert (await call(client, "close_terminal", terminal_id=term))["ok"]
    assert processes_with("sleep\x0093001") == []


async def test_unknown_key_names_are_refused_with_the_known_ones(client: Client) -> None:
    box = await create(client)
    term = await open_term(client, box)
    refused = await call(client, "terminal_send", terminal_id=term, text="echo x", keys=["Enter", "Hyper-Q"])
    assert refused["code"] == "INVALID_REQUEST"
    assert "'Hyper-Q'" in refused["reason"]
    assert all(key in refused["reason"] for key in KEYS)


async def test_huge_text_and_bad_sizes_are_refused(client: Client) -> None:
    box = await create(client)
    term = await open_term(client, box)
    huge = await call(client, "terminal_send", terminal_id=term, text="x" * (MAX_SEND_BYTES + 1))
    assert huge["code"] == "RESOURCE_LIMIT"
    for rows, cols in ((1, 80), (24, 5000)):
        bad = await call(client, "terminal_resize", terminal_id=term, rows=rows, cols=cols)
        assert bad["code"] == "INVALID_REQUEST", bad
    bad_regex = await call(client, "terminal_read", terminal_id=term, wait_for="(")
    assert bad_regex["code"] == "INVALID_REQUEST"
    # Exponential for a backtracking engine on a long run of "a" that fails at its end; linear for RE2.
    await send(client, term, "echo " + "a" * 60 + "!", "Enter")
    await until(client, term, "(?m)^a{60}!$")
    started = time.monotonic()
    slow = await call(client, "terminal_read", terminal_id=term, wait_for="(a+)+b", timeout_s=0)
    assert slow["detail"]["matched"] is False
    assert time.monotonic() - started < 2


async def test_open_terminals_per_sandbox_are_capped(client: Client) -> None:
    box = await create(client)
    terms = [await open_term(client, box, "cat") for _ in range(4)]
    refused = await call(client, "open_terminal", sandbox_id=box, command="cat")
    assert refused["code"] == "RESOURCE_LIMIT"
    assert (await call(client, "close_terminal", terminal_id=terms[0]))["ok"]
    await open_term(client, box, "cat")


async def test_host_workspace_opens_only_what_its_policy_allows(client: Client) -> None:
    refused = await call(client, "open_terminal", command="bash")
    assert refused["code"] == "FORBIDDEN"
    term = await open_term(client, None, "cat")
    await send(client, term, "echoed-by-cat", "Enter")
    shown = await until(client, term, "(?m)^echoed-by-cat\necho(ed-by-cat)$")
    assert shown["argv"] == ["cat"]
    assert (await call(client, "close_terminal", terminal_id=term))["ok"]


async def test_host_terminal_git_starts_no_editor_or_pager_whose_shell_escape_runs(
    client: Client, workspace: Path
) -> None:
    """Invariant: in a host workspace, an allowed git on a terminal gets an editor that refuses and a pager
    that only prints, so the attacker's vim `:!` and less `!` reach no shell (sh is denied by the policy).
    Sends the attacker's keys whatever is on the screen, then checks that they ran nothing and that the
    commit was not made. Does not cover programs an administrator names in the workspace's env."""
    gitconfig = "[user]\n\tname = Agent\n\temail = agent@example.com\n"
    assert (await call(client, "write_file", path=".gitconfig", content=gitconfig))["ok"]
    assert (await call(client, "run_command", command="git init -q"))["ok"]
    for n in range(3):  # more than a 5-row screen: less would not quit at once (git runs it with LESS=FRX)
        made = await call(client, "run_command", command=f"git commit --allow-empty -q -m commit-{n}")
        assert made["detail"]["exit_status"] == 0, made
    # Fixed, git may have ended before open_terminal answers (state "exited"): the terminal stays readable.
    terms = []
    for command in ("git commit --allow-empty -q", "git log"):
        opened = await call(client, "open_terminal", sandbox_id=None, command=command, rows=5, cols=80)
        assert opened["ok"], opened
        terms.append(opened["detail"]["terminal_id"])
    editor, pager = terms
    for term, shown, escape in (
        (editor, "Please supply the message", ":!touch /workspace/EDITOR_SHELL_RAN"),
        (pager, "commit-0", "!touch /workspace/PAGER_SHELL_RAN"),
    ):
        ended = await call(client, "terminal_read", terminal_id=term, wait_for="never-shown", timeout_s=10)
        sent = await call(client, "terminal_send", terminal_id=term, text=escape, keys=["Enter"])
        if sent["ok"]:  # an editor or pager still holds the terminal: let the escape run before looking
            await call(client, "terminal_read", terminal_id=term, wait_for="Press ENTER|done", timeout_s=10)
        assert sent["code"] == "CONFLICT", ended["detail"]["screen"]
        assert ended["detail"]["output_open"] is False
        assert shown in ended["detail"]["scrolled_off"] + ended["detail"]["screen"]
        assert (await call(client, "close_terminal", terminal_id=term))["ok"]
    assert not (workspace / "EDITOR_SHELL_RAN").exists()
    assert not (workspace / "PAGER_SHELL_RAN").exists()
    log = await call(client, "run_command", command="git log --oneline")
    assert len(log["detail"]["stdout"].splitlines()) == 3


async def test_sent_text_is_audited_redacted(client: Client, services: Services) -> None:
    box = await create(client)
    term = await open_term(client, box, "cat")
    secret = "AKIAIOSFODNN7EXAMPLE"
    sent = await send(client, term, f"key={secret}", "Enter")
    record = audit_record(services.config.audit_path, sent["audit_id"])
    assert record["workspace"] == box
    assert secret not in str(record)
    assert record["args"] == {"terminal_id": term, "text": "key=[REDACTED:aws_access_key_id]", "keys": ["Enter"]}
    shown = await call(client, "terminal_read", terminal_id=term, wait_for="(?m)^key=.REDACTED.*$", timeout_s=10)
    assert shown["detail"]["matched"]
    assert secret not in str(shown["detail"]["screen"])
    # wait_for sees the redacted screen: a pattern cannot probe the secret behind it.
    probe = await call(client, "terminal_read", terminal_id=term, wait_for="AKIAIOSF", timeout_s=0)
    assert probe["detail"]["matched"] is False


@contextlib.asynccontextmanager
async def idle_closing(demo_config: Config) -> AsyncIterator[Client]:
    """A server whose terminals close after half a second unused."""
    idle = TerminalsConfig(idle_close_s=0.5)
    config = demo_config.model_copy(update={"sandboxes": demo_config.sandboxes.model_copy(update={"terminals": idle})})
    services = build_services(config)
    try:
        async with Client(build_server(services, caller="test")) as client:
            yield client
    finally:
        services.close()


async def forgotten(client: Client, terminal: str) -> bool:
    """Whether the terminal is closed and forgotten, polled while its close finishes (call this only once
    the close has begun: each read counts as a use, which holds an idle close off)."""
    for _ in range(500):
        if (await call(client, "terminal_read", terminal_id=terminal))["code"] == "NOT_FOUND":
            return True
        await anyio.sleep(0.01)
    return False


async def test_idle_terminal_is_closed_and_its_programs_killed(demo_config: Config) -> None:
    async with idle_closing(demo_config) as client:
        box = await create(client)
        term = await open_term(client, box)
        await send(client, term, "sleep 94001 &", "Enter")
        await line(client, term, "echo bg-$((3 + 3))", "bg-6")
        assert await started("sleep\x0094001", 1)  # the job has exec'd (the prompt can come back first)
        assert await gone("sleep\x0094001")  # nobody used it for idle_close_s
        assert await forgotten(client, term), "the idle terminal was killed but not closed"


async def test_a_read_waiting_longer_than_the_idle_close_keeps_its_terminal(demo_config: Config) -> None:
    """A terminal_read that waits (wait_for, 2 s) is a use for as long as it waits: the idle close
    (0.5 s) does not kill the program under it."""
    async with idle_closing(demo_config) as client:
        box = await create(client)
        term = await open_term(client, box, "sleep 94003")
        read = await call(client, "terminal_read", terminal_id=term, wait_for="never-shown", timeout_s=2)
        assert read["ok"], read
        assert read["detail"]["matched"] is False
        assert read["detail"]["state"] == "running"
        assert read["detail"]["output_open"] is True
        assert len(await started("sleep\x0094003", 1)) == 1


async def test_idle_terminal_of_a_paused_sandbox_is_closed_once_resumed(
    demo_config: Config, caplog: pytest.LogCaptureFixture
) -> None:
    """Attack: let a terminal go idle while its sandbox is paused. The close could not kill a frozen
    program: it logged a traceback and the terminal stayed open for good. Invariant: it is kept while
    paused, closed once resumed and idle again, and nothing is logged as an error."""
    async with idle_closing(demo_config) as client:
        caplog.set_level("INFO", logger="bastion")  # after build_server, which sets the configured level
        box = await create(client)
        term = await open_term(client, box, "sleep 94004")
        assert len(await started("sleep\x0094004", 1)) == 1
        assert (await call(client, "pause_sandbox", sandbox_id=box))["ok"]
        for _ in range(500):
            if any("idle while the sandbox is paused" in r.getMessage() for r in caplog.records):
                break
            await anyio.sleep(0.01)
        else:
            raise AssertionError("the idle check never looked at the paused sandbox's terminal")
        assert len(processes_with("sleep\x0094004")) == 1
        assert (await call(client, "resume_sandbox", sandbox_id=box))["ok"]
        assert await gone("sleep\x0094004")
        assert await forgotten(client, term)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_scrollback_keeps_the_newest_lines_within_its_cap() -> None:
    scrollback = Scrollback(cap=100)
    for n in range(1000):
        scrollback.add(f"line {n}")
    assert scrollback.chars <= 100
    lines, dropped = scrollback.take()
    assert lines[-1] == "line 999"
    assert dropped == 1000 - len(lines)
    assert scrollback.take() == ([], 0)


COMBINING_FLOOD = (
    "import os\nos.write(1, b'a' + '\\u0301'.encode() * 100_000 + b'\\r\\nafter-marks\\r\\n')\nos.read(0, 1)\n"
)


async def test_combining_marks_piled_on_one_character_do_not_stall_the_server(client: Client) -> None:
    """Attack: 100,000 combining accents after one letter. pyte appends each to the cell's text and
    NFC-normalizes the whole of it again: quadratic, seconds per 4 KiB read on the event loop (the
    whole server frozen). Invariant: a cell keeps at most MAX_CELL_CHARS characters; output goes on."""
    box = await create(client)
    assert (await call(client, "write_file", sandbox_id=box, path="marks.py", content=COMBINING_FLOOD))["ok"]
    term = await open_term(client, box, "python3 marks.py")
    with LoopLag() as lag:
        shown = await until(client, term, "(?m)^after-marks$", timeout_s=60)
    first_line = str(shown["screen"]).split("\n")[0]
    assert 0 < len(first_line) <= MAX_CELL_CHARS, ascii(first_line)
    assert lag.cpu_worst < 0.2, f"the event loop was held {lag.cpu_worst:.3f} s"


def test_combining_marks_that_normalization_expands_stay_within_the_cell_cap() -> None:
    """Attack: U+0344, the one combining mark NFC makes longer (U+0308 U+0301), piled on a letter at the
    start of a row and on one in the last column (where pyte wraps before it combines). The cap counted
    the marks drawn, not the cell pyte made of them: "a" + 5,000 of U+0344 left a cell of 63 characters.
    Invariant: no cell holds more than MAX_CELL_CHARS characters; the letters and the text after stay."""
    terminal_screen = screen.TerminalScreen(10, 3, Scrollback(cap=1000))
    terminal_screen.draw("a" + "\u0344" * 5000 + "b" * 9 + "\u0344" * 5000 + "after")
    cells = [cell.data for line in terminal_screen.buffer.values() for cell in line.values()]
    assert max(map(len, cells)) == MAX_CELL_CHARS
    letters = [unicodedata.normalize("NFD", row).encode("ascii", "ignore").decode() for row in terminal_screen.display]
    assert [row.rstrip() for row in letters] == ["a" + "b" * 9, "after", ""]


BAD_ERASES = (
    "import os\n"
    "for _ in range(2000):\n"
    "    os.write(1, b'before\\x1b[9Jmiddle\\x1b[5Kafter-erase\\r\\n')\n"
    "os.write(1, b'all-erases-done\\r\\n')\n"
    "os.read(0, 1)\n"
)


async def test_erase_sequences_pyte_crashes_on_lose_no_output_and_do_not_flood_the_log(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """Attack: `CSI 9 J` / `CSI 5 K` (no such erase) in a loop. pyte raised on each, the rest of the 4 KiB
    read was dropped and a traceback logged per read: output hidden and the server's log flooded.
    Invariant: an unknown erase is ignored, like xterm does; text around it shows; nothing is logged."""
    box = await create(client)
    assert (await call(client, "write_file", sandbox_id=box, path="erase.py", content=BAD_ERASES))["ok"]
    with caplog.at_level("WARNING", logger="bastion"):
        term = await open_term(client, box, "python3 erase.py")
        shown = await until(client, term, "(?m)^all-erases-done$", timeout_s=60)
    assert "beforemiddleafter-erase" in str(shown["screen"])
    assert [r for r in caplog.records if "emulator" in r.getMessage()] == []


async def test_closing_the_sandbox_ends_a_terminal_read_that_waits(client: Client) -> None:
    """Attack: close_sandbox while a terminal_read waits (wait_for that never matches, 30 s).
    Invariant: the read returns at once with a typed answer (no hang until its timeout, no traceback)."""
    box = await create(client)
    term = await open_term(client, box, "cat")
    answers: list[Payload] = []

    async def read() -> None:
        answers.append(await call(client, "terminal_read", terminal_id=term, wait_for="never-shown", timeout_s=30))

    started = time.monotonic()
    async with anyio.create_task_group() as group:
        group.start_soon(read)
        await anyio.sleep(0.2)  # let the read start waiting (a head start, not a correctness wait)
        assert (await call(client, "close_sandbox", sandbox_id=box))["ok"]
    assert time.monotonic() - started < 10
    [answer] = answers
    assert answer["ok"] or answer["code"] == "NOT_FOUND", answer
    if answer["ok"]:
        assert answer["detail"]["matched"] is False


async def test_terminals_opened_and_closed_in_a_burst_leak_no_fd_task_or_process(
    client: Client, services: Services
) -> None:
    """Attack: 40 terminals opened and closed as fast as the tools allow. Invariant: the server's fds
    and asyncio tasks come back to where they were, and no program of theirs is left running."""
    box = await create(client)
    await call(client, "close_terminal", terminal_id=await open_term(client, box, "cat"))  # warm up
    # The warm pool refills after create_sandbox: its new sandbox's socket and pipe are not the terminals'.
    for _ in range(3000):
        if services.sandboxes.pool_size >= services.config.sandboxes.warm_pool:
            break
        await anyio.sleep(0.01)
    fds, tasks = fd_targets(), len(asyncio.all_tasks())
    for _ in range(40):
        term = await open_term(client, box, "sleep 93001")
        assert (await call(client, "close_terminal", terminal_id=term))["ok"]
    assert processes_with("sleep\x0093001") == []
    assert await extra_fds(fds) == {}
    assert len(asyncio.all_tasks()) <= tasks


def fd_targets() -> dict[str, str]:
    """This process's open fds and what each names."""
    targets = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own fd, closed by now
            targets[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return targets


async def extra_fds(before: dict[str, str]) -> dict[str, str]:
    """The fds open now that were not `before`, polled until there are none (bounded): a worker thread of
    an earlier test's sandbox close may hold a cgroup file open for a moment, and that is not a leak."""
    for _ in range(300):
        extra = {fd: target for fd, target in fd_targets().items() if before.get(fd) != target}
        if not extra:
            break
        await anyio.sleep(0.01)
    return extra


class TerminalSteps:
    """What the event loop does for terminals' output while watched: the CPU time of each step (a read
    of a master, or a paced resumption of one) and the bytes pyte was handed per call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.step_cpu_s: list[float] = []
        self.fed: list[int] = []
        for name in ("_on_readable", "_read_again"):
            monkeypatch.setattr(Terminal, name, self._timed(getattr(Terminal, name)))
        feed = pyte.ByteStream.feed

        def counted(stream: pyte.ByteStream, data: bytes) -> None:
            self.fed.append(len(data))
            feed(stream, data)

        monkeypatch.setattr(pyte.ByteStream, "feed", counted)

    def _timed(self, step: Callable[[Terminal], None]) -> Callable[[Terminal], None]:
        def timed(terminal: Terminal) -> None:
            started = time.thread_time()
            try:
                step(terminal)
            finally:
                self.step_cpu_s.append(time.thread_time() - started)

        return timed


SCREEN_WIDE = {
    "decaln": b"\x1b#8",
    "erase-in-colour": b"\x1b[41m\x1b[2J",
    "reverse-video-toggles": b"\x1b[?5h\x1b[?5l",
    "132-column-toggles": b"\x1b[?3h\x1b[?3l",
    "reset-then-align": b"\x1bc\x1b#8",
}


@pytest.mark.parametrize("sequence", SCREEN_WIDE.values(), ids=SCREEN_WIDE.keys())
async def test_screen_wide_sequence_flood_does_not_freeze_the_server(
    client: Client, monkeypatch: pytest.MonkeyPatch, sequence: bytes
) -> None:
    """Attack: 4 KiB of a sequence that costs pyte every cell of a 100x250 screen (DECALN, `ESC # 8`,
    27 ms each): one read of it held the event loop, and the whole server, for 27 s. Invariant: pyte
    is handed at most FEED_SLICE_BYTES at a time, each step of the loop for a terminal's output takes
    at most 0.1 s of CPU (a few ms here), and the screen shows what comes after. Does not prove a bound
    on steps of other work."""
    steps = TerminalSteps(monkeypatch)
    flood = b"\x1b#8" + (sequence * (4096 // len(sequence) + 1))[:4096] + b"\x1b[m\x1b[H\x1b[2Jafter-flood\r\n"
    script = f"import os\nos.write(1, {flood!r})\nos.read(0, 1)\n"
    box = await create(client)
    assert (await call(client, "write_file", sandbox_id=box, path="flood.py", content=script))["ok"]
    term = await open_term(client, box, "python3 flood.py", rows=100, cols=250)
    shown = await until(client, term, "(?m)^after-flood$", timeout_s=60)
    assert str(shown["screen"]).split("\n")[1:] == [""] * 99
    assert max(steps.fed) <= FEED_SLICE_BYTES
    assert max(steps.step_cpu_s) < 0.1, f"a step of the terminal's output took {max(steps.step_cpu_s):.3f} s of CPU"


WAITED_FLOOD = (
    "import sys\n"
    "print('ready', flush=True)\n"
    "sys.stdin.readline()\n"
    "for n in range(1500):\n"
    "    print(f'{n:08d} ' + 'w' * 230)\n"
)


class Waits:
    """How many terminal_read calls wait on their terminal's next change now (are in `Terminal.changed`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 0
        changed = Terminal.changed

        async def counted(terminal: Terminal, timeout_s: float) -> bool:
            self.now += 1
            try:
                return await changed(terminal, timeout_s)
            finally:
                self.now -= 1

        monkeypatch.setattr(Terminal, "changed", counted)

    async def reach(self, count: int) -> None:
        """Poll (bounded) until `count` reads wait."""
        for _ in range(1000):
            if self.now >= count:
                return
            await anyio.sleep(0.01)
        raise AssertionError(f"{count} reads were never all waiting ({self.now} were)")


async def test_many_waiting_reads_render_each_change_of_a_flooded_screen_once(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack: terminal_read(wait_for) calls waiting together on a 100x250 terminal flooded with long
    lines. Each change woke every waiter and each rendered, sanitized and redacted the screen and 200
    scrolled lines again: 10 waiters cost the server 13 s of CPU in 15 s, unpaced. Invariant: what
    wait_for looks at is cleaned once per change, whatever the number of waiters (a text cleaned twice
    is a repeat: at their end, each read's answer may repeat its screen, its scrolled lines and, once
    another read took those, what it waited on). Does not measure CPU time."""
    cleaned: collections.Counter[str] = collections.Counter()
    clean = Terminals._clean

    def counted(terminals: Terminals, text: str) -> str:
        cleaned[text] += 1
        return clean(terminals, text)

    monkeypatch.setattr(Terminals, "_clean", counted)
    waits = Waits(monkeypatch)
    box = await create(client)
    assert (await call(client, "write_file", sandbox_id=box, path="flood.py", content=WAITED_FLOOD))["ok"]
    term = await open_term(client, box, "python3 flood.py", rows=100, cols=250)
    await until(client, term, "(?m)^ready$")
    answers: list[Payload] = []

    async def wait() -> None:
        answers.append(await call(client, "terminal_read", terminal_id=term, wait_for="never-shown", timeout_s=60))

    async with anyio.create_task_group() as group:
        for _ in range(MAX_WAITING_READS):
            group.start_soon(wait)
        await waits.reach(MAX_WAITING_READS)
        cleaned.clear()
        await send(client, term, "", "Enter")  # the flood starts; its end (the program exits) ends the waits
    assert [(a["ok"], a["detail"]["matched"], a["detail"]["output_open"]) for a in answers] == [
        (True, False, False)
    ] * MAX_WAITING_READS
    repeats = sum(cleaned.values()) - len(cleaned)
    assert len(cleaned) >= 20, "the waiters saw too few changes to tell"
    assert repeats <= 3 * MAX_WAITING_READS, f"{repeats} texts cleaned again, over {len(cleaned)} changes"


async def test_waiting_reads_past_the_cap_are_refused(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attack: more terminal_read(wait_for) calls on one terminal than MAX_WAITING_READS, each looking at
    every change of its screen. Invariant: one more is refused with RESOURCE_LIMIT, saying why; a read
    that does not wait is served; the waiting ones end with their terminal."""
    waits = Waits(monkeypatch)
    box = await create(client)
    term = await open_term(client, box, "cat")
    answers: list[Payload] = []

    async def wait() -> None:
        answers.append(await call(client, "terminal_read", terminal_id=term, wait_for="never-shown", timeout_s=60))

    async with anyio.create_task_group() as group:
        for _ in range(MAX_WAITING_READS):
            group.start_soon(wait)
        await waits.reach(MAX_WAITING_READS)
        refused = await call(client, "terminal_read", terminal_id=term, wait_for="never-shown", timeout_s=0)
        assert refused["code"] == "RESOURCE_LIMIT", refused
        assert f"{MAX_WAITING_READS} terminal_read calls already wait" in refused["reason"]
        assert (await call(client, "terminal_read", terminal_id=term))["ok"]
        assert (await call(client, "close_terminal", terminal_id=term))["ok"]
    assert len(answers) == MAX_WAITING_READS
    assert all(a["ok"] or a["code"] == "NOT_FOUND" for a in answers), answers


async def test_one_terminals_charged_debt_does_not_hold_back_the_others(client: Client, services: Services) -> None:
    """Attack (test_pacer20.py, a review of the shared pacer): an agent resizes its terminal for 20 s while
    reads wait on it; each resize re-matches the waiting reads, charged to that terminal (10 s of the loop).
    Its next byte of output booked all of it in the one timeline all terminals share: every terminal of
    every sandbox then waited 11 s to read. Invariant: one step books at most `MAX_SHARED_SLOT_S` there; what
    a terminal owes past it delays that terminal alone. Another sandbox's terminal still echoes at once."""
    first, second = await create(client), await create(client)
    debtor = await open_term(client, first, "cat")
    other = await open_term(client, second, "cat")
    terminal = services.registry.find_terminal(debtor).workspace.terminals._get(debtor)
    loop = asyncio.get_running_loop()
    pacer = Pacer.of(loop, OUTPUT)
    terminal.charge(10.0)  # what 20 s of resizes under waiting reads ran up
    await send(client, debtor, "owed", "Enter")
    await until(client, debtor, "(?m)^owed$")  # rendered: pacing delays its next read, not this one
    assert pacer.free_at - loop.time() < 4 * screen.MAX_SHARED_SLOT_S + 0.5, pacer.free_at - loop.time()
    await send(client, other, "prompt", "Enter")
    await until(client, other, "(?m)^prompt$", timeout_s=5)
    for term in (debtor, other):
        assert (await call(client, "close_terminal", terminal_id=term))["ok"]


async def test_concurrent_opens_on_a_sleeping_sandbox_stop_at_max_open(client: Client, services: Services) -> None:
    """Attack (the background table's race, found by attack, looked for here by review): put a sandbox to sleep,
    then open many terminals at once. Each checked `max_open` before awaiting its pty (the sandbox wakes
    first) and was counted after it. Now an open holds its slot while it waits: `max_open` open, the rest are
    refused as one more sequential open is, and closing them leaves nothing running."""
    box = await create(client)
    assert (await call(client, "run_command", command="true", sandbox_id=box))["ok"]
    assert services.sandboxes.sleep_idle(0) >= 1
    cap = services.config.sandboxes.terminals.max_open
    results: list[Payload] = []

    async def open_one() -> None:
        results.append(await call(client, "open_terminal", sandbox_id=box, command="sleep 4255.5"))

    async with anyio.create_task_group() as group:
        for _ in range(4 * cap):
            group.start_soon(open_one)
    opened = [r["detail"]["terminal_id"] for r in results if r["ok"]]
    sequential = await call(client, "open_terminal", sandbox_id=box, command="sleep 4255.5")
    assert sequential["code"] == "RESOURCE_LIMIT", sequential
    assert {(r["code"], r["reason"]) for r in results if not r["ok"]} == {(sequential["code"], sequential["reason"])}
    assert len(opened) == cap
    for terminal in opened:
        assert (await call(client, "close_terminal", terminal_id=terminal))["ok"]
    assert (await call(client, "close_sandbox", sandbox_id=box))["ok"]
    deadline = time.monotonic() + 30
    while processes_with("sleep\0004255.5"):
        assert time.monotonic() < deadline
        await anyio.sleep(0.02)


async def test_a_long_scrollback_is_cleaned_off_the_event_loop(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by attack: terminal_read cleaned and redacted what scrolled off on the event loop: 256 KiB of `key=`
    lines (the default scrollback; it goes to 16 MiB) took 100 ms of every agent's calls. Here the cleaning of the
    long scrollback is held in its worker until the test releases it. Invariant: another call is answered
    meanwhile, and the read then returns every line that scrolled off."""
    box = await create(client)
    terminal = await open_term(client, box)
    hold = Hold()
    real = sanitize_terminal

    def held(text: str) -> str:
        if len(text) > INLINE_CLEAN_CHARS:
            hold.wait()
        return real(text)

    monkeypatch.setattr(terminals_module, "sanitize_terminal", held)
    await send(client, terminal, "seq 1 3000; echo DONE", "Enter")
    read = await hold.call(client, "terminal_read", terminal_id=terminal, wait_for="(?m)^DONE$", timeout_s=30)
    detail = read["detail"]
    assert detail["matched"], detail
    assert "\n1\n2\n3\n" in f"\n{detail['scrolled_off']}"
    assert detail["scrolled_off_dropped_lines"] == 0


async def test_a_closed_sandboxs_flooded_terminals_are_not_kept_alive_by_the_pacer(
    client: Client, services: Services
) -> None:
    """Attack (found by review, 2026-12-07): the shared pacer kept each reader it had booked (a terminal, with its
    screen and scrollback) until some later step anywhere on the server: 16 closed terminals' screens, 55 MiB,
    held on a quiet server. Invariant: once its sandbox is closed, nothing holds a terminal that flooded."""
    box = await create(client)
    opened = await open_term(client, box, "yes")
    await until(client, opened, "(?m)^y$")
    terminal = services.registry.find_terminal(opened).workspace.terminals._get(opened)
    gone = weakref.ref(terminal)
    del terminal
    assert (await call(client, "close_sandbox", sandbox_id=box))["ok"]
    gc.collect()
    assert gone() is None, [type(ref).__name__ for ref in gc.get_referrers(gone())]


HEAVY_PATTERN = "|".join(f"(?:a[ab]{{{i}}}c)" for i in range(1, 60))
"""875 characters whose automaton does not fit RE2's DFA cache: its slower matcher, 0.5 s or more on 75 KB."""
PRINTS_AB_FOREVER = (
    "import random, sys, time\n"
    "while True:\n"
    "    sys.stdout.write(''.join(random.choice('ab') for _ in range(249)) + '\\n'); sys.stdout.flush()\n"
    "    time.sleep(0.002)\n"
)


def test_a_wait_for_pattern_too_big_for_the_dfa_writes_nothing_to_the_servers_stderr(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Left alone by the twenty-sixth session, then fixed: RE2 wrote "DFA out of memory: pattern length 875, ..."
    to the server's stderr for each match of a pattern its DFA cache could not hold, so one agent's waits wrote a
    line to the server's log at every change of its terminal's screen. Invariant: the match still runs, silently."""
    matcher = terminals_module.wait_pattern(HEAVY_PATTERN)
    rng = random.Random(0)
    text = "\n".join("".join(rng.choice("ab") for _ in range(249)) for _ in range(300))
    assert not matcher.found_in(text)
    assert matcher.found_in(text + "\naabc")
    assert "DFA out of memory" not in capfd.readouterr().err


async def test_wait_for_patterns_slow_to_match_do_not_stall_the_loop(client: Client) -> None:
    """Attack (found by review, 2026-12-07): a terminal prints lines of random a and b; four terminal_read calls
    wait on it with a pattern RE2 can only run on its slower matcher (0.5 to 1.8 s a match on the 75 KB a wait
    looks at). Each change re-matched on the loop: stalls of 2.4 to 4.9 s, another sandbox's command up to 9.7 s,
    the loop's thread 0.78 to 0.92 busy. Invariant: a match of that much text runs in a worker thread, charged to
    the terminal's pacing: the loop never stalls, and another sandbox's commands go on."""
    box, other = await create(client), await create(client)
    await sh(client, box, f"cat > ab.py <<'PYEOF'\n{PRINTS_AB_FOREVER}PYEOF")
    terminal = await open_term(client, box, "python3 ab.py", rows=100, cols=250)
    await until(client, terminal, "(?m)^[ab]{249}$")
    times: list[float] = []

    async def waiter() -> None:
        result = await call(client, "terminal_read", terminal_id=terminal, wait_for=HEAVY_PATTERN, timeout_s=6)
        assert result["ok"], result
        assert result["detail"]["matched"] is False

    async def other_calls(done: anyio.Event) -> None:
        while not done.is_set():
            started = time.monotonic()
            assert (await sh(client, other, "true"))["ok"]
            times.append(time.monotonic() - started)

    done = anyio.Event()
    with LoopLag() as lag:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(other_calls, done)
            async with anyio.create_task_group() as waiters:
                for _ in range(MAX_WAITING_READS):
                    waiters.start_soon(waiter)
            done.set()
    assert (await call(client, "close_terminal", terminal_id=terminal))["ok"]
    assert lag.cpu_worst < 0.1, f"the loop was held {lag.cpu_worst:.2f} s"  # 0.14 to 0.42 s matched on the loop
    assert max(times) < 2.0, max(times)


async def test_slow_waits_on_a_host_workspaces_terminals_leave_its_threads_to_other_tools(client: Client) -> None:
    """Attack (found by review, 2026-12-07): terminals of a host workspace fed lines of a and b, four reads waiting
    on each with a pattern RE2 runs on its slower matcher. Each match (0.5 s or more) held one of the workspace's
    4 threads, and read_file there waited 5.5 to 8.9 s; a read with timeout_s 8 returned after up to 18.8 s.
    Invariant: a caller's waits take one thread at a time, before the workspace's share: read_file stays quick,
    and a wait gives up at its timeout (one match late at most)."""
    assert (await call(client, "write_file", path="small.txt", content="hello\n" * 2000))["ok"]
    terminals = [await open_term(client, None, "cat", rows=100, cols=250) for _ in range(2)]
    feeding = anyio.Event()

    async def feed(terminal: str) -> None:
        rng = random.Random(terminal)
        while not feeding.is_set():
            text = "\n".join("".join(rng.choice("ab") for _ in range(249)) for _ in range(8))
            sent = await call(client, "terminal_send", terminal_id=terminal, text=text, keys=["Enter"])
            # Only the screen's churn matters here: when the loaded machine reads the screens slower than this
            # types, cat stops reading and a send is cut (TIMEOUT) after 5 s; the next one goes on.
            assert sent["ok"] or sent["code"] == "TIMEOUT", sent
            await anyio.sleep(0.05)

    waited: list[float] = []

    async def wait(terminal: str) -> None:
        began = time.monotonic()
        result = await call(client, "terminal_read", terminal_id=terminal, wait_for=HEAVY_PATTERN, timeout_s=4)
        assert result["ok"], result
        waited.append(time.monotonic() - began)

    reads: list[float] = []
    async with anyio.create_task_group() as feeders:
        for terminal in terminals:
            feeders.start_soon(feed, terminal)
        await until(client, terminals[0], "(?m)^[ab]{249}$")
        async with anyio.create_task_group() as waiters:
            for terminal in terminals:
                for _ in range(MAX_WAITING_READS):
                    waiters.start_soon(wait, terminal)
            await anyio.sleep(1)  # the waits under way: what read_file meets
            for _ in range(10):
                started = time.monotonic()
                assert (await call(client, "read_file", path="small.txt"))["ok"]
                reads.append(time.monotonic() - started)
        feeding.set()
    for terminal in terminals:
        assert (await call(client, "close_terminal", terminal_id=terminal))["ok"]
    assert max(reads) < 1.0, f"read_file on the workspace waited {max(reads):.1f} s behind the waits"
    assert max(waited) < 4 + 2.5, f"a read with timeout_s 4 returned after {max(waited):.1f} s"


async def test_closing_a_terminal_reads_wait_on_leaves_nothing_of_it_cached(
    client: Client, services: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack (found by review, 2026-12-07): close a full 100x250 terminal while four reads wait on it, again and
    again. Each waiter woken by the close put the closed terminal's text back in its sandbox's cache (22 KB a
    close, kept for the sandbox's life). Invariant: a closed terminal leaves nothing cached."""
    waits = Waits(monkeypatch)
    box = await create(client)
    terminals = services.registry.resolve(box).workspace.terminals
    for _ in range(5):
        terminal = await open_term(client, box, "seq 1 400 && sleep 600", rows=100, cols=250)
        await until(client, terminal, "(?m)^400$")

        async def wait(terminal: str = terminal) -> None:
            result = await call(client, "terminal_read", terminal_id=terminal, wait_for="never-printed", timeout_s=20)
            assert result["ok"] or result["code"] == "NOT_FOUND", result

        async with anyio.create_task_group() as waiters:
            for _ in range(MAX_WAITING_READS):
                waiters.start_soon(wait)
            await waits.reach(MAX_WAITING_READS)
            assert (await call(client, "close_terminal", terminal_id=terminal))["ok"]
    assert terminals._seen == {}
