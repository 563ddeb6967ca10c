"""Background processes in sandboxes through the real tools: survive calls, stdin, kill, redaction, bounds."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

import anyio
import pytest
from mcp import Client

from bastion.app import Services
from bastion.safety.redact import sanitize_terminal
from bastion.sandbox.processes import OutputLog
from bastion.workbench import background
from bastion.workbench.background import MAX_ARGV_CHARS, MAX_PROCESSES, RING_BYTES
from tests.helpers import Hold, Payload, call, create, processes_with

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]

TICKER = "i=0; while :; do echo tick $i; i=$((i+1)); sleep 0.1; done"


async def start(client: Client, box: str, command: str) -> int:
    started = await call(client, "run_command", command=command, sandbox_id=box, background=True)
    assert started["ok"], started
    detail = started["detail"]
    assert isinstance(detail, dict)
    assert detail["state"] == "running"
    assert detail["argv"] == ["sh", "-c", command]
    pid = detail["pid"]
    assert isinstance(pid, int)
    return pid


async def read(client: Client, box: str, pid: int, since: int | None = None) -> dict[str, object]:
    args: dict[str, object] = {"pid": pid, "sandbox_id": box}
    if since is not None:
        args["since"] = since
    payload = await call(client, "read_process_output", **args)
    assert payload["ok"], payload
    detail = payload["detail"]
    assert isinstance(detail, dict)
    return detail


async def read_until_exit(client: Client, box: str, pid: int, *, limit_s: float = 10) -> tuple[str, dict[str, object]]:
    """All stdout from the start until the process has exited and nothing more is left."""
    text, since = "", 0
    deadline = time.monotonic() + limit_s
    while True:
        detail = await read(client, box, pid, since)
        text += str(detail["stdout"])
        since = int(str(detail["next"]))
        if detail["state"] == "exited" and not detail["more"]:
            return text, detail
        assert time.monotonic() < deadline, detail
        await anyio.sleep(0.05)


async def wait_for(marker: str, *, present: bool, count: int = 1) -> None:
    for _ in range(300):
        if (len(processes_with(marker)) >= count) is present:
            return
        await anyio.sleep(0.01)


async def until_written(client: Client, box: str, count: int, *, limit_s: float = 10) -> None:
    """Poll until the sandbox's one background process has written at least `count` bytes."""
    deadline = time.monotonic() + limit_s
    while True:
        listed = await call(client, "list_processes", sandbox_id=box)
        [entry] = listed["detail"]["processes"]
        if entry["output_bytes"] >= count:
            return
        assert time.monotonic() < deadline, entry
        await anyio.sleep(0.02)


def sleeps_with(marker: str) -> list[int]:
    """Host pids of `sleep` processes whose command line contains `marker`."""
    found = []
    for pid in processes_with(marker):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sleep\0"):
                found.append(pid)
        except OSError:
            continue  # gone since it was listed
    return found


def ticks(text: str) -> list[int]:
    return [int(line.split()[1]) for line in text.splitlines()]


async def test_background_process_survives_between_calls(client: Client) -> None:
    box = await create(client)
    pid = await start(client, box, TICKER)
    assert pid == 1
    await until_written(client, box, len("tick 0\ntick 1\n"))
    # Other commands run meanwhile, in the same sandbox.
    other = await call(client, "run_command", command="echo other", sandbox_id=box)
    assert other["detail"]["stdout"] == "other\n"
    first = await read(client, box, pid)
    assert first["state"] == "running"
    assert first["since"] == 0
    first_ticks = ticks(str(first["stdout"]))
    assert first_ticks[:2] == [0, 1]
    await until_written(client, box, int(str(first["next"])) + 1)  # echo writes a tick line at once
    second = await read(client, box, pid, since=int(str(first["next"])))
    second_ticks = ticks(str(second["stdout"]))
    assert second_ticks, second
    assert second_ticks[0] == first_ticks[-1] + 1  # continues exactly where the first read stopped
    again = await read(client, box, pid)  # without since: from the start again
    assert ticks(str(again["stdout"]))[: len(first_ticks + second_ticks)] == first_ticks + second_ticks
    listed = await call(client, "list_processes", sandbox_id=box)
    [entry] = listed["detail"]["processes"]
    assert entry["pid"] == pid
    assert entry["state"] == "running"
    assert entry["exit_status"] is None
    assert entry["output_bytes"] > 0
    assert entry["age_s"] >= 0.1 * (second_ticks[-1] - 1)  # the ticker sleeps 0.1 s between ticks
    killed = await call(client, "kill_process", pid=pid, sandbox_id=box)
    assert killed["ok"], killed
    assert killed["detail"]["state"] == "exited"
    assert killed["detail"]["exit_status"] == 128 + 9


async def test_stdin_round_trip_and_eof(client: Client) -> None:
    box = await create(client)
    pid = await start(client, box, "cat")
    sent = await call(client, "send_process_input", pid=pid, data="hello\n", sandbox_id=box)
    assert sent["ok"], sent
    assert sent["detail"]["bytes_written"] == 6
    for _ in range(100):
        detail = await read(client, box, pid)
        if detail["stdout"]:
            break
        await anyio.sleep(0.02)
    assert detail["stdout"] == "hello\n"
    assert detail["state"] == "running"
    closed = await call(client, "send_process_input", pid=pid, data="bye\n", eof=True, sandbox_id=box)
    assert closed["ok"], closed
    assert closed["detail"]["eof"] is True
    text, last = await read_until_exit(client, box, pid)
    assert text == "hello\nbye\n"
    assert last["exit_status"] == 0
    late = await call(client, "send_process_input", pid=pid, data="more\n", sandbox_id=box)
    assert late["code"] == "CONFLICT"
    listed = await call(client, "list_processes", sandbox_id=box)
    [entry] = listed["detail"]["processes"]
    assert (entry["state"], entry["exit_status"], entry["stdin_open"]) == ("exited", 0, False)


async def test_foreground_commands_still_read_dev_null(client: Client) -> None:
    box = await create(client)
    out = await call(client, "run_command", command="cat; readlink /proc/self/fd/0", sandbox_id=box)
    assert out["detail"]["stdout"] == "/dev/null\n"


async def test_kill_leaves_no_survivors(client: Client) -> None:
    """Invariant: kill_process ends everything the process started, however it detached."""
    box = await create(client)
    marker = "4251.25"
    pid = await start(client, box, f"setsid sleep {marker} & (sleep {marker} &); sleep {marker}")
    # sh -c and its three sleeps; until they have all exec'd, forks of sh carry its command line too.
    for _ in range(500):
        if len(sleeps_with(marker)) == 3 and len(processes_with(marker)) == 4:
            break
        await anyio.sleep(0.01)
    assert len(sleeps_with(marker)) == 3
    assert len(processes_with(marker)) == 4
    killed = await call(client, "kill_process", pid=pid, sandbox_id=box)
    assert killed["ok"], killed
    assert killed["detail"]["killed"] is True
    await wait_for(marker, present=False)
    assert processes_with(marker) == []
    again = await call(client, "kill_process", pid=pid, sandbox_id=box)
    assert again["ok"]
    assert again["detail"]["killed"] is False
    _, last = await read_until_exit(client, box, pid)
    assert last["exit_status"] == 137


async def test_secret_split_across_writes_and_reads_is_redacted(client: Client) -> None:
    box = await create(client)
    pid = await start(client, box, "printf 'key=AKIAIOSF'; read go; printf 'ODNN7EXAMPLE done\\n'; echo end")
    await until_written(client, box, len("key=AKIAIOSF"))
    early = await read(client, box, pid)
    assert early["state"] == "running"
    assert "AKIA" not in str(early["stdout"])  # held back: it could be the start of a secret
    assert (await call(client, "send_process_input", pid=pid, data="\n", sandbox_id=box))["ok"]
    text, last = await read_until_exit(client, box, pid)
    assert last["exit_status"] == 0
    assert "AKIA" not in text
    assert "ODNN7EXAMPLE" not in text
    assert "[REDACTED:" in text
    assert text.endswith(" done\nend\n")


async def test_escapes_are_neutralised_even_when_split(client: Client) -> None:
    box = await create(client)
    pid = await start(client, box, r"printf 'red:\033['; read go; printf '31mRED\033[0m\r\nok\n'")
    await until_written(client, box, len("red:\033["))
    await read(client, box, pid)
    assert (await call(client, "send_process_input", pid=pid, data="\n", sandbox_id=box))["ok"]
    text, _ = await read_until_exit(client, box, pid)
    assert text == "red:RED\nok\n"


async def test_endless_output_is_bounded_and_the_server_stays_responsive(client: Client, services: Services) -> None:
    box = await create(client)
    pid = await start(client, box, "yes")
    await until_written(client, box, RING_BYTES + 1)  # more than the host keeps: some is dropped
    started = time.monotonic()
    ping = await call(client, "run_command", command="echo pong", sandbox_id=box)
    assert ping["detail"]["stdout"] == "pong\n"
    assert time.monotonic() - started < 2
    cap = services.sandboxes.get(box).workspace.config.max_output_bytes
    detail = await read(client, box, pid)
    assert 0 < len(str(detail["stdout"])) <= cap
    assert set(str(detail["stdout"])) <= {"y", "\n"}
    assert detail["more"] is True
    assert int(str(detail["dropped_bytes"])) > 0
    listed = await call(client, "list_processes", sandbox_id=box)
    [entry] = listed["detail"]["processes"]
    assert entry["output_bytes"] > RING_BYTES
    assert 0 < entry["unread_bytes"] <= RING_BYTES  # what the host holds for it: at most the ring
    following = await read(client, box, pid, since=int(str(detail["next"])))
    assert following["since"] == detail["next"]
    killed = await call(client, "kill_process", pid=pid, sandbox_id=box)
    assert killed["ok"]


async def test_host_workspace_refuses_background_and_unknown_pids(client: Client) -> None:
    refused = await call(client, "run_command", command="sleep 1", background=True)
    assert refused["code"] == "FORBIDDEN"
    assert "sandboxes" in str(refused["reason"])
    listed = await call(client, "list_processes")
    assert listed["ok"]
    assert listed["detail"]["processes"] == []
    box = await create(client)
    for tool, args in (
        ("read_process_output", {}),
        ("send_process_input", {"data": "x"}),
        ("kill_process", {}),
    ):
        missing = await call(client, tool, pid=7, sandbox_id=box, **args)
        assert missing["code"] == "NOT_FOUND", tool
    no_box = await call(client, "list_processes", sandbox_id="sb-000000000000")
    assert no_box["code"] == "SANDBOX_NOT_FOUND"
    with_timeout = await call(client, "run_command", command="true", background=True, timeout_s=1, sandbox_id=box)
    assert with_timeout["code"] == "INVALID_REQUEST"


async def test_list_shows_states_and_exit_statuses(client: Client) -> None:
    box = await create(client)
    ok = await start(client, box, "exit 0")
    failed = await start(client, box, "echo oops >&2; exit 3")
    running = await start(client, box, "sleep 30")
    assert (ok, failed, running) == (1, 2, 3)
    _, last = await read_until_exit(client, box, failed)
    assert last["exit_status"] == 3
    assert (await read(client, box, failed))["stderr"] == "oops\n"
    await read_until_exit(client, box, ok)
    listed = await call(client, "list_processes", sandbox_id=box)
    states = {p["pid"]: (p["state"], p["exit_status"]) for p in listed["detail"]["processes"]}
    assert states == {1: ("exited", 0), 2: ("exited", 3), 3: ("running", None)}
    past = await call(client, "read_process_output", pid=failed, since=10**6, sandbox_id=box)
    assert past["code"] == "INVALID_REQUEST"


async def test_close_sandbox_ends_background_processes(client: Client, services: Services) -> None:
    """Invariant: closing a sandbox leaves no background process and no host fd behind."""
    box = await create(client)
    marker = "4252.5"
    fds_before = len(os.listdir("/proc/self/fd"))
    await start(client, box, f"setsid sleep {marker} & sleep {marker}")
    await start(client, box, "cat")
    await wait_for(marker, present=True)
    assert processes_with(marker)
    closed = await call(client, "close_sandbox", sandbox_id=box)
    assert closed["ok"]
    await wait_for(marker, present=False)
    assert processes_with(marker) == []
    assert len(os.listdir("/proc/self/fd")) <= fds_before
    gone = await call(client, "list_processes", sandbox_id=box)
    assert gone["code"] == "SANDBOX_NOT_FOUND"


async def test_processes_dropped_from_a_full_table_let_go_of_their_output(client: Client) -> None:
    """Attack: start background commands that exit at once but leave a child holding their output
    (`sleep &`), well past the table's size. The oldest exited one was dropped from the table with its
    pipes still open and read by the host (2 fds and up to 2 MiB of rings each) until the sandbox closed:
    enough of them ran the server out of file descriptors. Invariant: the host's fds stay bounded as the
    table turns over, and closing the sandbox ends the children."""
    box = await create(client)
    marker = "4253.5"

    async def start_one_that_exits() -> None:
        started = await call(
            client, "run_command", command=f"sleep {marker} & echo started", sandbox_id=box, background=True
        )
        assert started["ok"], started
        pid = started["detail"]["pid"]
        for _ in range(500):
            listed = await call(client, "list_processes", sandbox_id=box)
            if any(p.get("pid") == pid and p["state"] == "exited" for p in listed["detail"]["processes"]):
                return
            await anyio.sleep(0.01)
        raise AssertionError(f"background process {pid} did not exit")

    for _ in range(MAX_PROCESSES):
        await start_one_that_exits()
    fds_full = len(os.listdir("/proc/self/fd"))
    for _ in range(MAX_PROCESSES + 8):
        await start_one_that_exits()
    assert len(os.listdir("/proc/self/fd")) <= fds_full + 2
    closed = await call(client, "close_sandbox", sandbox_id=box)
    assert closed["ok"], closed
    await wait_for(marker, present=False)
    assert processes_with(marker) == []


async def test_server_shutdown_with_a_running_background_process(demo_config_path: Path) -> None:
    from bastion.app import build_server, build_services
    from bastion.config import load_config

    services = build_services(load_config(demo_config_path))
    marker = "4253.75"
    try:
        async with Client(build_server(services, caller="test")) as client:
            box = await create(client)
            await start(client, box, f"sleep {marker}")
            await wait_for(marker, present=True)
    finally:
        services.close()
    await wait_for(marker, present=False)
    assert processes_with(marker) == []


def test_output_log_keeps_the_newest_characters() -> None:
    log = OutputLog(10)
    log.append(0, "abcdef")
    log.append(1, "ghij")
    log.append(0, "klm")
    assert (log.start, log.end) == (3, 13)
    assert log.read(0, 100) == (3, ("defklm", "ghij"), 13)
    assert log.read(8, 3) == (8, ("k", "ij"), 11)
    assert log.read(13, 5) == (13, ("", ""), 13)


# -- processes a command left running --------------------------------------------------------------


async def left_running(client: Client, box: str) -> list[Payload]:
    listed = await call(client, "list_processes", sandbox_id=box)
    assert listed["ok"], listed
    return [entry for entry in listed["detail"]["processes"] if entry["started_by"] == "command"]


async def test_a_server_started_with_ampersand_is_listed_reachable_and_killable(client: Client) -> None:
    """The issue's first trip: `server &` in one command, reached from the next, seen and ended by the tools."""
    box = await create(client)
    started = await call(
        client, "run_command", command="python3 -m http.server 8001 --bind 127.0.0.1 &", sandbox_id=box
    )
    assert started["ok"], started
    assert started["detail"]["exit_status"] == 0, started
    fetch = (
        "python3 -c 'import urllib.request, time\n"
        "for _ in range(200):\n"
        "    try:\n"
        '        print(urllib.request.urlopen("http://127.0.0.1:8001/").status); break\n'
        "    except OSError: time.sleep(0.05)'"
    )
    assert (await call(client, "run_command", command=fetch, sandbox_id=box))["detail"]["stdout"] == "200\n"
    [server] = await left_running(client, box)
    assert server["argv"] == ["python3", "-m", "http.server", "8001", "--bind", "127.0.0.1"]
    assert server["state"] == "running"
    killed = await call(client, "kill_process", os_pid=server["os_pid"], sandbox_id=box)
    assert killed["ok"], killed
    assert killed["detail"]["killed"] is True
    assert await left_running(client, box) == []
    after = await call(client, "run_command", command=fetch.replace("range(200)", "range(1)"), sandbox_id=box)
    assert after["detail"]["stdout"] == ""


async def test_background_and_left_running_processes_are_told_apart(client: Client) -> None:
    box = await create(client)
    await start(client, box, "sleep 4321.5")
    # The command ends once the left process has exec'd sleep. Until then its argv is the shell's (which holds
    # this text), then nohup's, then none within each execve: its name is sleep's from the exec's start, and
    # its command line is there once the exec has set it up.
    left = (
        "nohup sleep 4321.75 >/dev/null 2>&1 & "
        'until [ "$(cat /proc/$!/comm)" = sleep ] && grep -q . /proc/$!/cmdline; do :; done'
    )
    ran = await call(client, "run_command", command=left, sandbox_id=box)
    assert ran["ok"], ran  # it ended once the left process's argv was sleep's
    listed = (await call(client, "list_processes", sandbox_id=box))["detail"]["processes"]
    assert [(entry["started_by"], entry["argv"]) for entry in listed] == [
        ("background", ["sh", "-c", "sleep 4321.5"]),
        ("command", ["sleep", "4321.75"]),
    ]


async def test_a_left_process_whose_main_thread_ended_is_listed_by_its_name(client: Client) -> None:
    """A command leaves a process whose main thread has ended (exit(2) of that thread) while another sleeps on: it
    runs, and the kernel gives no command line for it (/proc/PID/cmdline is empty, as within an execve or an
    exit). Invariant: list_processes shows it by its name in brackets, as ps does, never with an empty argv;
    kill_process ends it. Before, it was listed with argv [] (and so, under load, was a process caught
    within its exec)."""
    box = await create(client)
    script = (
        "python3 -c 'import ctypes, os, threading, time\n"
        "threading.Thread(target=time.sleep, args=(4324.5,)).start()\n"
        # SYS_exit ends the calling thread only; pthread_exit's unwinding through Python frames could hang.
        'ctypes.CDLL(None).syscall({"x86_64": 60, "aarch64": 93}[os.uname().machine], 0)\' >/dev/null 2>&1 & '
        "p=$!; until grep -q '^State:.Z' /proc/$p/status; do :; done"  # its main thread has ended
    )
    ran = await call(client, "run_command", command=script, sandbox_id=box)
    assert ran["ok"], ran
    [entry] = await left_running(client, box)
    assert entry["argv"] == ["[python3]"], entry
    killed = await call(client, "kill_process", os_pid=entry["os_pid"], sandbox_id=box)
    assert killed["ok"], killed
    assert await left_running(client, box) == []


async def test_kill_process_refuses_a_pid_of_the_host_or_of_another_sandbox(client: Client) -> None:
    mine, other = await create(client), await create(client)
    for _ in range(3):
        await call(client, "run_command", command="/bin/true", sandbox_id=mine)
    await call(client, "run_command", command="sleep 4322.5 >/dev/null 2>&1 &", sandbox_id=mine)
    await call(client, "run_command", command="sleep 4322.75 >/dev/null 2>&1 &", sandbox_id=other)
    [theirs] = await left_running(client, other)
    [own] = await left_running(client, mine)
    assert theirs["os_pid"] != own["os_pid"]
    for pid in (theirs["os_pid"], os.getpid(), 1):
        refused = await call(client, "kill_process", os_pid=pid, sandbox_id=mine)
        assert refused["code"] == "NOT_FOUND", refused
        assert "no process" in str(refused["reason"])
    assert len(await left_running(client, other)) == 1
    for args in ({}, {"pid": 1, "os_pid": own["os_pid"]}):
        both = await call(client, "kill_process", sandbox_id=mine, **args)
        assert both["code"] == "INVALID_REQUEST", both


async def test_a_hostile_command_line_is_listed_cleaned_and_bounded(client: Client) -> None:
    """A process writes its own /proc/PID/cmdline: terminal escapes, a secret-looking value and a
    huge argument come back sanitized, redacted and cut."""
    box = await create(client)
    secret = "ghp_" + "A" * 36
    script = (
        "python3 -c 'import os, sys, time\n"
        "if os.fork() == 0:\n"
        '    os.execvp("python3", ["python3", "-c", "import time; time.sleep(4323.5)", "\\x1b[31mred\\x1b[0m", "'
        + secret
        + '", "x" * 100000])\n'
        "' >/dev/null 2>&1"
    )
    await call(client, "run_command", command=script, sandbox_id=box)
    for _ in range(500):  # the child forked before the command ended: listed once it has exec'd
        [entry] = await left_running(client, box)
        argv = [str(arg) for arg in entry["argv"]]
        if "import time; time.sleep(4323.5)" in argv:
            break
        await anyio.sleep(0.01)
    assert argv[:5] == ["python3", "-c", "import time; time.sleep(4323.5)", "red", "[REDACTED:github_token]"]
    assert set(argv[5]) == {"x"}  # the huge argument, cut
    assert sum(len(arg) for arg in argv) <= MAX_ARGV_CHARS


def _held(services: Services, box: str) -> list[tuple[int, int, int]]:
    """(stdout ring bytes, stderr ring bytes, log characters) the server holds for each of a sandbox's processes."""
    records = services.sandboxes.get(box).workspace.processes._records.values()
    return [(r.process.stdout.total - r.process.stdout.start, r.process.stderr.total - r.process.stderr.start,
             r.log.end - r.log.start) for r in records]  # fmt: skip


async def test_many_sandboxes_of_chatty_background_processes_cannot_hold_the_servers_memory(
    client: Client, services: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack (found by attack): 16 background processes writing without end in each of 16 sandboxes; each kept
    1 MiB of raw output a stream and 1M characters of cleaned log (4 MB of emoji), ~85 MiB a sandbox and ~1.3
    GiB in all, past the ~300 MiB the systemd unit leaves the server. Every process's share is now an equal
    part of the server's room (here shrunk to 1 MiB of rings and 256 Ki characters of logs): the oldest output
    goes first, reads say what was dropped, and a process ending gives its share back."""
    monkeypatch.setattr(background, "SERVER_RING_BYTES", 1 << 20)
    monkeypatch.setattr(background, "SERVER_LOG_CHARS", 256 << 10)
    first = await create(client)
    pids = [await start(client, first, "yes '\U0001f98a chatty'") for _ in range(4)]
    deadline = time.monotonic() + 30
    while True:
        listed = (await call(client, "list_processes", sandbox_id=first))["detail"]["processes"]
        if all(int(p["output_bytes"]) > 2 << 20 for p in listed):
            break
        assert time.monotonic() < deadline, listed
        await anyio.sleep(0.05)
    for pid in pids:
        for _ in range(4):  # each read cleans at most max_output_bytes into the log
            await read(client, first, pid)
    for out, err, log in _held(services, first):
        assert out <= 128 << 10, out  # 1 MiB over 4 processes' 2 streams
        assert err == 0
        assert log <= 64 << 10, log
    second = await create(client)
    for _ in range(4):
        await start(client, second, "sleep 600")
    for out, _, log in _held(services, first):  # 8 processes now: the first four's shares halved at once
        assert out <= 64 << 10, out
        assert log <= 32 << 10, log
    assert (await call(client, "close_sandbox", sandbox_id=second))["ok"]
    assert background.SHARES.shares() == (128 << 10, 64 << 10), "the closed sandbox's processes gave theirs back"
    detail = await read(client, first, pids[0])
    assert int(str(detail["dropped_bytes"])) > 0
    assert "\U0001f98a chatty\n" in str(detail["stdout"])
    assert (await call(client, "close_sandbox", sandbox_id=first))["ok"]


# -- attacks on the table's size and the server's CPU --------------------------------------------------


async def test_concurrent_background_starts_on_a_sleeping_sandbox_stop_at_the_table_size(
    client: Client, services: Services
) -> None:
    """Attack (found by attack): put a sandbox to sleep, then start many background commands at once. Each
    checked the table before awaiting the sandbox's start and was added after it, so all of them got in
    (300 of 300: 254 sleeps ran, 300 shares of the server's output budget sized for 16 a sandbox). Now a
    start holds its slot while it waits: 16 run, the rest are refused as a 17th sequential start is."""
    box = await create(client)
    assert (await call(client, "run_command", command="true", sandbox_id=box))["ok"]
    assert services.sandboxes.sleep_idle(0) >= 1
    shares_before = len(background.SHARES._records)
    marker = "4254.5"
    results: list[Payload] = []

    async def start_one() -> None:
        results.append(await call(client, "run_command", command=f"sleep {marker}", sandbox_id=box, background=True))

    async with anyio.create_task_group() as group:
        for _ in range(3 * MAX_PROCESSES):
            group.start_soon(start_one)
    started = [r for r in results if r["ok"]]
    refused = {(r["code"], r["reason"]) for r in results if not r["ok"]}
    sequential = await call(client, "run_command", command=f"sleep {marker}", sandbox_id=box, background=True)
    assert sequential["code"] == "RESOURCE_LIMIT", sequential
    assert refused == {(sequential["code"], sequential["reason"])}
    assert len(started) == MAX_PROCESSES
    listed = (await call(client, "list_processes", sandbox_id=box))["detail"]["processes"]
    assert sorted(p["pid"] for p in listed if p["started_by"] == "background") == list(range(1, MAX_PROCESSES + 1))
    assert len(background.SHARES._records) == shares_before + MAX_PROCESSES
    deadline = time.monotonic() + 30
    while len(sleeps_with(marker)) < MAX_PROCESSES:
        assert time.monotonic() < deadline, sleeps_with(marker)
        await anyio.sleep(0.02)
    assert len(sleeps_with(marker)) == MAX_PROCESSES
    assert (await call(client, "kill_process", pid=1, sandbox_id=box))["ok"]
    again = await call(client, "run_command", command=f"sleep {marker}", sandbox_id=box, background=True)
    assert again["ok"], again  # the table's slots all came back: one freed, one taken
    assert (await call(client, "close_sandbox", sandbox_id=box))["ok"]
    await wait_for(marker, present=False)
    assert processes_with(marker) == []
    assert len(background.SHARES._records) == shares_before


async def test_starts_refused_by_a_paused_sandbox_give_their_slots_back(client: Client) -> None:
    """A start that fails in the sandbox releases the slot it held: the table is whole again after."""
    box = await create(client)
    assert (await call(client, "pause_sandbox", sandbox_id=box))["ok"]
    for _ in range(MAX_PROCESSES + 4):
        refused = await call(client, "run_command", command="sleep 4254.75", sandbox_id=box, background=True)
        assert refused["code"] == "CONFLICT", refused
    assert (await call(client, "resume_sandbox", sandbox_id=box))["ok"]
    for _ in range(MAX_PROCESSES):
        await start(client, box, "sleep 4254.75")
    full = await call(client, "run_command", command="sleep 4254.75", sandbox_id=box, background=True)
    assert full["code"] == "RESOURCE_LIMIT", full
    assert (await call(client, "close_sandbox", sandbox_id=box))["ok"]
    await wait_for("4254.75", present=False)
    assert processes_with("4254.75") == []


def _cpu_s() -> float:
    """This process's CPU time (all its threads): the in-process server's."""
    times = os.times()
    return times.user + times.system


async def test_a_background_process_writing_without_end_cannot_take_a_core_of_the_server(client: Client) -> None:
    """Attack (found by attack): a background `yes` nobody reads. Its ring was filled at full speed, ~1.2 GB
    read in 1.5 s only to be dropped: 63 % of the server's core for one writer, 98 % for 16. Once the ring has
    dropped bytes nobody read, it is read one chunk per DRAIN_PAUSE_S: the writer waits on its full pipe, the
    server stays idle, and the newest output is still there to read."""
    box = await create(client)
    pid = await start(client, box, "yes")
    await until_written(client, box, RING_BYTES + 1)  # the ring has wrapped over unread output
    cpu_before, wall_before = _cpu_s(), time.monotonic()
    written_before = 0
    while True:  # ~2 s more of `yes`, checked every 0.1 s
        [entry] = (await call(client, "list_processes", sandbox_id=box))["detail"]["processes"]
        written_before = written_before or int(entry["output_bytes"])
        if time.monotonic() - wall_before >= 2:
            break
        await anyio.sleep(0.1)
    share = (_cpu_s() - cpu_before) / (time.monotonic() - wall_before)
    assert share < 0.25, f"the server spent {share:.0%} of a core reading a writer nobody reads"
    assert int(entry["output_bytes"]) - written_before < 20 << 20  # ~1.3 MB/s got through, not ~1 GB/s
    detail = await read(client, box, pid)
    assert set(str(detail["stdout"])) == {"y", "\n"}
    assert int(str(detail["dropped_bytes"])) > 0
    assert detail["more"] is True
    killed = await call(client, "kill_process", pid=pid, sandbox_id=box)
    assert killed["ok"], killed
    _, last = await read_until_exit(client, box, pid, limit_s=30)
    assert last["exit_status"] == 128 + 9


async def test_a_paced_writer_still_reaches_its_last_line(client: Client) -> None:
    """Pacing slows a flooding writer but never stalls it: what it writes after the flood is read, in order."""
    box = await create(client)
    pid = await start(client, box, f"yes | head -c {3 * RING_BYTES}; echo; echo flood over; exec sleep 4255.5")
    deadline = time.monotonic() + 60
    text, since = "", 0
    while "flood over\n" not in text:
        assert time.monotonic() < deadline, text[-200:]
        detail = await read(client, box, pid, since)
        text = (text if detail["since"] == since else "") + str(detail["stdout"])  # restart past a drop
        since = int(str(detail["next"]))
        if not detail["stdout"]:
            await anyio.sleep(0.05)
    assert text.endswith("y\n\nflood over\n")
    assert detail["state"] == "running"
    assert (await call(client, "close_sandbox", sandbox_id=box))["ok"]
    await wait_for("4255.5", present=False)
    assert processes_with("4255.5") == []


async def test_a_process_that_exited_while_its_child_still_writes_says_more_is_coming(client: Client) -> None:
    """Found by attack: a background process that exited while a child it left running kept writing to its
    pipes answered `state: exited, more: false`, which clients (and this file's `read_until_exit`) take for
    the end of its output, missing what the child wrote after. `more` stays true while a pipe is held."""
    box = await create(client)
    started = await call(
        client,
        "run_command",
        command="(while :; do echo child; sleep 0.1; done) & echo parent-done",
        sandbox_id=box,
        background=True,
    )
    assert started["ok"], started
    pid = started["detail"]["pid"]
    deadline = time.monotonic() + 30
    while True:
        read = (await call(client, "read_process_output", pid=pid, sandbox_id=box))["detail"]
        if read["state"] == "exited" and "child" in read["stdout"]:
            break
        assert time.monotonic() < deadline, read
        await anyio.sleep(0.05)
    assert "parent-done" in read["stdout"]
    assert read["more"] is True, read  # the child still holds the pipe
    assert (await call(client, "close_sandbox", sandbox_id=box))["ok"]


async def _in_sandbox(client: Client, box: str, os_pids: list[int], *, zombies: bool) -> list[int]:
    """Which of `os_pids` are processes in the sandbox now (its own /proc); `zombies`: counting those that
    have exited and wait for the agent, their parent now, to reap them."""
    running = "" if zombies else " && ! grep -q '^State:.Z' /proc/$p/status"
    script = f"for p in {' '.join(map(str, os_pids))}; do [ -e /proc/$p/status ]{running} && echo $p; done; true"
    ran = await call(client, "run_command", command=script, sandbox_id=box)
    assert ran["ok"], ran
    return [int(line) for line in str(ran["detail"]["stdout"]).split()]


async def test_kill_process_after_its_first_process_exited_kills_what_it_left_running(client: Client) -> None:
    """Found by attack: a background `sh -c` that exited leaving a child that writes to its pipes, then
    kill_process(pid): nothing was killed (its first process had exited), the child wrote on, `more`
    stayed true and its output share stayed held, until the sandbox closed. Now the kill ends everything the
    process started: the child's pids are gone from the sandbox, the output ends (`more` false), and `killed`
    says something was running. Another background process and another command's leftover live on. Does not
    prove anything for a child that left the command's cgroup (it cannot: the sandbox sees no cgroupfs)."""
    box = await create(client)
    # Unique: other runs of this test (other workers, other checkouts' suites) may be on the host at once.
    marker, other = (f"{whole}.{secrets.randbelow(10**6):06d}" for whole in (4261, 4262))
    witness = await start(client, box, f"exec sleep {other}")
    kept = await call(client, "run_command", command=f"sleep {other}1 >/dev/null 2>&1 &", sandbox_id=box)
    assert kept["ok"], kept
    pid = await start(client, box, f"sleep {marker} & (while :; do echo x; sleep 0.1; done) & echo parent-done")
    deadline = time.monotonic() + 30
    while True:
        detail = await read(client, box, pid)
        if detail["state"] == "exited" and "x" in str(detail["stdout"]).split():
            break
        assert time.monotonic() < deadline, detail
        await anyio.sleep(0.05)
    assert detail["more"] is True, detail  # the child still holds the pipe
    # The sleep and the loop's subshell: both carry the marker (the subshell has sh's command line).
    left = [entry for entry in await left_running(client, box) if marker in " ".join(map(str, entry["argv"]))]
    assert len(left) >= 2, left
    os_pids = [int(entry["os_pid"]) for entry in left]
    killed = await call(client, "kill_process", pid=pid, sandbox_id=box)
    assert killed["ok"], killed
    assert killed["detail"]["killed"] is True, killed
    assert await _in_sandbox(client, box, os_pids, zombies=False) == []
    deadline = time.monotonic() + 10
    while await _in_sandbox(client, box, os_pids, zombies=True):
        assert time.monotonic() < deadline, "the agent did not reap the killed processes"
        await anyio.sleep(0.02)
    assert processes_with(marker) == []
    text, last = await read_until_exit(client, box, pid)
    assert last["more"] is False, last
    assert "parent-done" in text.split()
    final = await read(client, box, pid, since=int(str(last["next"])))
    assert (final["stdout"], final["more"]) == ("", False), final
    again = await call(client, "kill_process", pid=pid, sandbox_id=box)
    assert again["ok"], again
    assert again["detail"]["killed"] is False, again
    # The sandbox's other processes are untouched.
    listed = (await call(client, "list_processes", sandbox_id=box))["detail"]["processes"]
    running = [(entry["started_by"], entry["argv"]) for entry in listed if entry["state"] == "running"]
    assert running == [("background", ["sh", "-c", f"exec sleep {other}"]), ("command", ["sleep", f"{other}1"])]
    assert (await read(client, box, witness))["state"] == "running"
    assert len(sleeps_with(other)) == 2
    assert (await call(client, "close_sandbox", sandbox_id=box))["ok"]


async def test_listing_processes_with_long_command_lines_holds_no_other_call(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by attack: list_processes cleaned and redacted the command lines of what commands left running on the
    event loop, each whole before its cut to `MAX_ARGV_CHARS`: 100 of 4 KiB of `key=` lines (the pids limit's
    worth) took 100 ms of every agent's calls, per call. Here the cleaning of long command lines is held in its
    worker until the test releases it. Invariant: another call is answered meanwhile, and the listing then
    shows every process left running, each command line cut."""
    box = await create(client)
    long_arg = "key=" * 1000
    # Each shell stays (it waits for its sleep), its command line holding `long_arg`: 4 shells and 4 sleeps left.
    command = f"for i in 1 2 3 4; do setsid sh -c 'sleep 600; true' left {long_arg} & done"
    started = await call(client, "run_command", sandbox_id=box, command=command)
    assert started["ok"], started
    hold = Hold()
    real = sanitize_terminal

    def held(text: str) -> str:
        if len(text) > 1000:
            hold.wait()
        return real(text)

    monkeypatch.setattr(background, "sanitize_terminal", held)
    listed = await hold.call(client, "list_processes", sandbox_id=box)
    assert listed["ok"], listed
    commands = [p for p in listed["detail"]["processes"] if p["started_by"] == "command"]
    assert len(commands) == 8
    assert all(sum(len(arg) for arg in p["argv"]) <= MAX_ARGV_CHARS + 3 for p in commands)


async def test_reading_much_background_output_holds_no_other_call(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by attack (twenty-eighth session): read_process_output cleaned new output on the event loop, up to
    max_output_bytes a stream: 64 KiB of control characters (each shown as an escape) took 115 ms a read, and
    another sandbox's `run_command` p99 went from 8 to 730 ms while an agent read in a loop. Here the cleaning
    of a long read is held in its worker until the test releases it. Invariant: another call is answered
    meanwhile, and the read then returns the output, cleaned."""
    box = await create(client)
    flood = (
        "python3 -c 'import os, time; c = bytes(range(1, 32)) * 1024; os.write(1, c); os.write(2, c); time.sleep(600)'"
    )
    started = await call(client, "run_command", sandbox_id=box, command=flood, background=True)
    assert started["ok"], started
    pid = started["detail"]["pid"]
    with anyio.fail_after(30):
        while (await call(client, "list_processes", sandbox_id=box))["detail"]["processes"][0][
            "output_bytes"
        ] < 2 * 31 * 1024:
            await anyio.sleep(0.01)  # polling, not timing
    hold = Hold()
    real = background._clean

    def held(record: background.Background, pieces: list[tuple[bytes, bool]]) -> None:
        hold.wait()
        real(record, pieces)

    monkeypatch.setattr(background, "_clean", held)
    read = await hold.call(client, "read_process_output", sandbox_id=box, pid=pid)
    assert read["ok"], read
    text = str(read["detail"]["stdout"]) + str(read["detail"]["stderr"])
    assert "\x01" not in text, text[:40]  # shown as text, never raw
    assert text.startswith("\\x01\\x02"), text[:80]
    assert read["detail"]["more"], read["detail"]  # past one read's cap: the rest comes with detail.next
    assert (await call(client, "kill_process", sandbox_id=box, pid=pid))["ok"]


async def test_a_start_that_forgets_an_exited_process_says_which_and_what_was_unread(client: Client) -> None:
    """Found by attack (twenty-eighth session): the table keeps 16 processes, and a 17th start forgot the oldest
    exited one, and the output nobody had read of it, without a word; a read of it then said only NOT_FOUND.
    Invariant: the start's answer names the process it forgot, its exit status and how many bytes were unread."""
    box = await create(client)
    pids = []
    for n in range(MAX_PROCESSES):
        started = await call(client, "run_command", sandbox_id=box, command=f"echo line {n}", background=True)
        assert started["ok"], started
        assert "forgotten" not in started["detail"]
        pids.append(started["detail"]["pid"])
    with anyio.fail_after(30):
        while any(
            p["state"] != "exited"
            for p in (await call(client, "list_processes", sandbox_id=box))["detail"]["processes"]
        ):
            await anyio.sleep(0.01)  # polling, not timing
    assert (await call(client, "read_process_output", sandbox_id=box, pid=pids[1]))["ok"]  # read: nothing unread
    one_more = await call(client, "run_command", sandbox_id=box, command="true", background=True)
    assert one_more["ok"], one_more
    assert one_more["detail"]["forgotten"] == {"pid": pids[0], "exit_status": 0, "unread_bytes": len("line 0\n")}
    again = await call(client, "run_command", sandbox_id=box, command="true", background=True)
    assert again["detail"]["forgotten"] == {"pid": pids[1], "exit_status": 0, "unread_bytes": 0}
    gone = await call(client, "read_process_output", sandbox_id=box, pid=pids[0])
    assert gone["code"] == "NOT_FOUND", gone
