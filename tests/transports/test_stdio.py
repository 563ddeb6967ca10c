"""bastion's stdio transport (`bastion.transports.stdio`), driven raw: JSON-RPC lines over real pipes.

The SDK's client over stdio is exercised in tests/e2e/test_stdio.py; these tests cover what
a well-behaved client never does (garbage, huge or oversized lines) and the wire's plumbing
(fd 0 and 1 diverted while serving, replies flushed whole at exit, files instead of pipes).
"""

from __future__ import annotations

import io
import json
import os
import pty
import select
import signal
import socket
import subprocess
import sys
import time
import tty
from contextlib import suppress
from pathlib import Path
from typing import IO, Any

import pytest

from bastion.safety.paths import MAX_READ_BYTES
from tests.helpers import BASTION, INITIALIZE_REQUEST, mounts_under

INITIALIZED = {"jsonrpc": "2.0", "method": "notifications/initialized"}
# The server with a 64 KiB line limit instead of 64 MiB, so the test need not send 64 MiB.
SMALL_LIMIT = (
    "import sys, bastion.transports.stdio as stdio; stdio.MAX_LINE_BYTES = 65536; "
    "from bastion.cli import main; sys.exit(main())"
)


def line(message: dict[str, Any]) -> bytes:
    return json.dumps(message).encode() + b"\n"


def call(request_id: int, tool: str, **arguments: object) -> bytes:
    params = {"name": tool, "arguments": arguments}
    return line({"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": params})


class Raw:
    """`bastion serve --stdio` in a subprocess, spoken to line by line."""

    def __init__(
        self, config: Path, *, command: tuple[str, ...] = (str(BASTION),), stdin: Any = None, stdout: Any = None
    ) -> None:
        argv = [*command, "serve", "--config", str(config), "--stdio"]
        self.process = subprocess.Popen(
            argv, stdin=stdin or subprocess.PIPE, stdout=stdout or subprocess.PIPE, stderr=subprocess.PIPE
        )
        assert self.process.stderr is not None
        self.stdout: IO[bytes] = self.process.stdout or io.BytesIO()  # stdout given: nothing to read here
        self.stderr: IO[bytes] = self.process.stderr
        self.stdin: IO[bytes] | None = self.process.stdin

    def send(self, data: bytes) -> None:
        assert self.stdin is not None
        self.stdin.write(data)
        self.stdin.flush()

    def answer(self) -> dict[str, Any]:
        raw = self.stdout.readline()
        assert raw, "the server closed stdout"
        message: dict[str, Any] = json.loads(raw)
        return message

    def initialize(self) -> None:
        self.send(line(INITIALIZE_REQUEST) + line(INITIALIZED))
        assert self.answer()["id"] == 1

    def finish(self) -> tuple[int, list[dict[str, Any]], str]:
        """Close stdin (the end of the session); the remaining replies, the exit status, stderr."""
        if self.stdin is not None and not self.stdin.closed:
            with suppress(BrokenPipeError):
                self.stdin.close()
        replies = [json.loads(raw) for raw in self.stdout.read().splitlines()]
        err = self.stderr.read().decode()
        self.stdout.close()
        self.stderr.close()
        return self.process.wait(timeout=30), replies, err


def _cancelled_then_closed(raw: Raw, call_id: int | str, cancel_id: int | str) -> list[dict[str, Any]]:
    """Start a 30 s command as `call_id`, cancel `cancel_id`, close stdin: the server must end at once (not
    after the hour it waits for calls still unanswered). Its remaining replies."""
    raw.initialize()
    request = {"name": "run_command", "arguments": {"command": "sleep 30"}}
    raw.send(line({"jsonrpc": "2.0", "id": call_id, "method": "tools/call", "params": request}))
    raw.send(line({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": cancel_id}}))
    raw.send(call(8, "explain_command", command="true"))  # answered: the cancel was read before stdin ends
    assert raw.answer()["id"] == 8
    assert raw.stdin is not None
    raw.stdin.close()
    try:
        raw.process.wait(timeout=30)  # not the hour
    except subprocess.TimeoutExpired:
        raw.process.terminate()
        raise
    status, replies, err = raw.finish()
    assert status == 0, err
    return replies


@pytest.mark.bwrap
def test_wire_fds_are_diverted_while_serving(demo_config_path: Path) -> None:
    """Children of the server cannot read the client's requests or write into the replies."""
    server = Raw(demo_config_path)
    server.initialize()
    fd = Path(f"/proc/{server.process.pid}/fd")
    assert os.readlink(fd / "0") == os.devnull
    assert os.readlink(fd / "1") == os.readlink(fd / "2")
    server.send(call(2, "run_command", command="echo hello"))
    reply = server.answer()
    assert reply["id"] == 2
    assert reply["result"]["structuredContent"]["detail"]["stdout"] == "hello\n"
    code, _, err = server.finish()
    assert code == 0, err


def test_garbage_line_gets_no_reply_and_the_session_goes_on(demo_config_path: Path) -> None:
    server = Raw(demo_config_path)
    server.initialize()
    server.send(b"this is not json\n\n" + call(2, "list_directory", path="."))
    code, replies, err = server.finish()
    # As with the SDK's own transport, a line that is not JSON-RPC has no id to answer.
    assert [r["id"] for r in replies] == [2]
    assert replies[0]["result"]["structuredContent"]["ok"] is True
    assert code == 0, err
    assert "Traceback" not in err


def test_large_messages_cross_whole_even_at_exit(demo_config_path: Path, workspace: Path) -> None:
    """An 8 MiB request, and a 1 MiB reply still being written when stdin closes, arrive whole. The read is
    sent once the write has answered: calls are served concurrently (write_file runs off the event loop),
    so a client that needs one call's effect in the next waits for its answer, as MCP clients do."""
    content = "0123456789abcdef" * (512 * 1024)
    server = Raw(demo_config_path)
    server.initialize()
    server.send(call(2, "write_file", path="big.txt", content=content))
    written = server.answer()
    assert written["id"] == 2
    assert written["result"]["structuredContent"]["detail"]["bytes_written"] == len(content)
    server.send(call(3, "read_file", path="big.txt", length=MAX_READ_BYTES))
    code, replies, err = server.finish()
    assert [r["id"] for r in replies] == [3]
    assert replies[0]["result"]["structuredContent"]["detail"]["content"] == content[:MAX_READ_BYTES]
    assert (workspace / "big.txt").read_text() == content
    assert code == 0, err


def test_oversized_line_ends_the_session_with_one_line(demo_config_path: Path) -> None:
    server = Raw(demo_config_path, command=(sys.executable, "-c", SMALL_LIMIT))
    server.initialize()
    # The server may stop reading before the whole line is in.
    with suppress(BrokenPipeError):
        server.send(call(2, "write_file", path="huge.txt", content="x" * 200_000))
    code, replies, err = server.finish()
    assert replies == []
    assert code == 0, err
    assert "longer than 65536 bytes" in err
    assert "Traceback" not in err


def test_files_as_stdin_and_stdout_get_every_reply(demo_config_path: Path, tmp_path: Path) -> None:
    """A file as stdin (read in a thread) with a pipe, then a file, as stdout: the last reply is
    written before exit every time. The SDK's threaded transport lost it in 2 runs of 30."""
    requests = tmp_path / "requests.jsonl"
    requests.write_bytes(line(INITIALIZE_REQUEST) + line(INITIALIZED) + call(2, "list_directory", path="."))
    argv = [str(BASTION), "serve", "--config", str(demo_config_path), "--stdio"]
    for run in range(6):
        replies_file = tmp_path / f"replies-{run}.jsonl"
        with requests.open("rb") as stdin, replies_file.open("wb") as stdout:
            to_file = run % 2 == 1
            done = subprocess.run(
                argv, stdin=stdin, stdout=stdout if to_file else subprocess.PIPE, stderr=subprocess.PIPE, timeout=60
            )
        raw = replies_file.read_bytes() if to_file else done.stdout
        replies = [json.loads(reply) for reply in raw.splitlines()]
        assert [r["id"] for r in replies] == [1, 2], (run, replies)
        assert replies[1]["result"]["structuredContent"]["ok"] is True
        assert done.returncode == 0, done.stderr


def test_sigterm_closes_the_services_and_leaves_no_mount(demo_config_path: Path) -> None:
    """Invariant: `systemctl stop` (SIGTERM) and a closed terminal (SIGHUP) end a stdio server
    through its cleanup: with a client still connected, it exits 0 and leaves no mount (sandbox disk,
    idmapped workspace, socket tmpfs) and no sandbox folder. Before, the signal's default action
    ended the process on the spot."""
    state = demo_config_path.parent / "state"
    for signum in (signal.SIGTERM, signal.SIGHUP):
        proc = subprocess.Popen(
            [str(BASTION), "serve", "--config", str(demo_config_path), "--stdio"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            assert proc.stdin is not None
            assert proc.stdout is not None
            proc.stdin.write(line(INITIALIZE_REQUEST))
            proc.stdin.flush()
            assert b'"result"' in proc.stdout.readline()  # serving, with its sandboxes and mounts up
            proc.send_signal(signum)
            assert proc.wait(30) == 0, proc.stderr.read() if proc.stderr else b""
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    with suppress(OSError):
                        stream.close()
        assert mounts_under(demo_config_path.parent) == []
        assert not list((state / "sandboxes").glob("sb-*"))


def test_a_cancelled_call_does_not_keep_the_server_after_stdin_closes(demo_config_path: Path) -> None:
    """Attack (found by review): a call cancelled with notifications/cancelled gets no answer (the protocol
    sends none), and the end of stdin waited for its answer for an hour, the state folder locked: the client's
    next server refused to start. The server now ends with stdin; the call's audit record says it was cut."""
    replies = _cancelled_then_closed(Raw(demo_config_path), 7, 7)
    assert all(reply.get("id") != 7 for reply in replies)
    audit = (demo_config_path.parent / "state" / "audit.jsonl").read_text()
    ends = [json.loads(entry) for entry in audit.splitlines() if '"run_command"' in entry and '"end"' in entry]
    assert [entry["code"] for entry in ends] == ["UNAVAILABLE"]


@pytest.mark.bwrap
@pytest.mark.parametrize(("call_id", "cancel_id"), [(5, "5"), ("5", 5), (5, "05")], ids=["int-str", "str-int", "zero"])
def test_a_call_cancelled_by_its_id_spelled_otherwise_does_not_keep_the_server(
    demo_config_path: Path, call_id: int | str, cancel_id: int | str
) -> None:
    """Attack (s1.py): a call with id 5 cancelled as "5" (or the reverse, or "05"). The SDK correlates ids as
    one ("5" is 5) and cancelled the call, which then gets no answer; the end of stdin waited for it by its
    exact id, for an hour, holding the state folder: the client's next server refused to start. The server
    now ends with stdin, and a second server on the same config starts."""
    replies = _cancelled_then_closed(Raw(demo_config_path), call_id, cancel_id)
    assert all(reply.get("id") not in (5, "5") for reply in replies)
    second = Raw(demo_config_path)
    second.initialize()
    assert second.finish()[0] == 0


def _run_records(config: Path, command: str) -> list[dict[str, Any]]:
    """The audit records of `run_command(command)`."""
    audit = config.parent / "state" / "audit.jsonl"
    whole = audit.read_text().split("\n")[:-1] if audit.exists() else []  # a line being written is left out
    entries: list[dict[str, Any]] = [json.loads(entry) for entry in whole]
    return [e for e in entries if e.get("tool") == "run_command" and (e.get("args") or {}).get("command") == command]


def _until_recorded(raw: Raw, config: Path, command: str, records: int = 1) -> list[dict[str, Any]]:
    """Until `run_command(command)` has `records` audit records (1: it started); they, then."""
    while len(found := _run_records(config, command)) < records:
        assert raw.process.poll() is None, "the server ended before the call was recorded"
        time.sleep(0.005)  # polling the log, not timing
    return found


def _exit_of(raw: Raw, within_s: float = 60) -> tuple[int, str]:
    """The server's exit status and stderr; it is killed if it has not ended within `within_s` (the test fails)."""
    try:
        status = raw.process.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        raw.process.terminate()
        raw.process.wait(timeout=60)
        raw.stderr.close()
        raise
    err = raw.stderr.read().decode()
    raw.stderr.close()
    return status, err


def test_a_client_that_quits_with_a_call_in_flight_ends_the_server_cleanly(demo_config_path: Path) -> None:
    """Found by attack (twenty-seventh session): the MCP host app quits (or is killed) while a call runs, both
    pipes closing. Writing the call's answer raised ConnectionResetError, which the SDK (dropping only anyio's
    broken and closed stream errors) raised again writing the error answer: the server died with status 1 and
    about 8 KB of tracebacks, 5 runs of 5. Turned into anyio's error alone, the end of input would have waited
    up to an hour for answers that can go nowhere, holding the state folder. Invariant: the server ends as at
    any end of input, status 0, no traceback, the call recorded once (start and end)."""
    command = "sleep 1.5"
    raw = Raw(demo_config_path)
    raw.initialize()
    raw.send(call(2, "run_command", command=command))
    _until_recorded(raw, demo_config_path, command)
    assert raw.stdin is not None
    raw.stdin.close()
    raw.stdout.close()  # the client is gone: nobody reads the answers any more
    status, err = _exit_of(raw)
    assert "Traceback" not in err, err[-3000:]
    assert status == 0, err[-3000:]
    assert [entry["event"] for entry in _run_records(demo_config_path, command)] == ["start", "end"]


def test_a_client_that_quits_with_a_long_call_in_flight_frees_the_state_folder_at_once(demo_config_path: Path) -> None:
    """Found by review of the fix above: the end of input still waited for the call's answer, up to the call's
    own end (30.08 s for `sleep 30`, up to an hour), holding the state folder: the restarted client's server was
    refused. asyncio sees the pipe's reading end close; that now tells the end of input to wait for nothing.
    Invariant: the server ends long before the call would, the call recorded cut, and a new server starts."""
    command = "sleep 30"
    raw = Raw(demo_config_path)
    raw.initialize()
    raw.send(call(2, "run_command", command=command, timeout_s=60))
    _until_recorded(raw, demo_config_path, command)
    assert raw.stdin is not None
    raw.stdin.close()
    raw.stdout.close()
    status, err = _exit_of(raw, within_s=20)  # the call would run 30 s
    assert status == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    records = _run_records(demo_config_path, command)
    assert [(entry["event"], entry.get("code")) for entry in records] == [("start", None), ("end", "UNAVAILABLE")]
    second = Raw(demo_config_path)
    second.initialize()
    assert second.finish()[0] == 0


def test_a_call_read_after_stdout_broke_does_not_hold_the_end_of_input(demo_config_path: Path) -> None:
    """Found by review: stdout on a full device (/dev/full; a file on a full filesystem alike). The first answer's
    write failed and the end of input was told to wait for nothing; a call read after that was counted again, and
    its answer's send (refused at once) never uncounted it: the end of input waited an hour, the state folder
    held. Invariant: the server ends at the end of its input, the later call cut and recorded once."""
    with open("/dev/full", "wb") as full:
        raw = Raw(demo_config_path, stdout=full)
    raw.send(line(INITIALIZE_REQUEST) + line(INITIALIZED) + call(2, "run_command", command="true"))
    _until_recorded(raw, demo_config_path, "true", records=2)  # run, its answer's write failed or about to
    command = "sleep 30"
    raw.send(call(3, "run_command", command=command, timeout_s=60))
    _until_recorded(raw, demo_config_path, command)
    assert raw.stdin is not None
    raw.stdin.close()
    status, err = _exit_of(raw, within_s=20)
    assert status == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert [entry["event"] for entry in _run_records(demo_config_path, command)] == ["start", "end"]


def test_a_client_on_one_socket_for_stdin_and_stdout_gets_every_answer_whole(
    demo_config_path: Path, workspace: Path
) -> None:
    """Found by review: stdin and stdout one socket (inetd, socat's EXEC, systemd's Accept=yes). asyncio's
    pipe transport watches a socket for reading and closed itself at the client's next request: every answer
    after the first was dropped (before today's fix, a crash). Invariant: every answer arrives, a 1 MiB one
    whole (the socket takes it in pieces), and the server ends with the client's half-close, status 0."""
    (workspace / "big.txt").write_text("0123456789abcdef" * (64 * 1024))
    mine, theirs = socket.socketpair()
    raw = Raw(demo_config_path, stdin=theirs, stdout=theirs)
    theirs.close()
    mine.settimeout(30)
    wire = mine.makefile("rwb")
    try:
        wire.write(line(INITIALIZE_REQUEST))
        wire.flush()
        assert json.loads(wire.readline())["id"] == 1
        wire.write(line(INITIALIZED) + line({"jsonrpc": "2.0", "id": 2, "method": "ping"}))
        wire.write(call(3, "read_file", path="big.txt"))
        wire.flush()
        answers = {answer["id"]: answer for answer in (json.loads(wire.readline()) for _ in range(2))}
        mine.shutdown(socket.SHUT_WR)
        assert answers[2]["result"] == {}
        content = answers[3]["result"]["structuredContent"]["detail"]["content"]
        assert content == "0123456789abcdef" * (64 * 1024)
        assert wire.read() == b""
    finally:
        wire.close()
        mine.close()
    status, err = _exit_of(raw)
    assert status == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def _over_a_socket(config: Path) -> tuple[Raw, socket.socket]:
    """A server whose stdin and stdout are one socket (inetd, socat, systemd's Accept=yes), initialized."""
    mine, theirs = socket.socketpair()
    raw = Raw(config, stdin=theirs, stdout=theirs)
    theirs.close()
    mine.settimeout(30)
    mine.sendall(line(INITIALIZE_REQUEST) + line(INITIALIZED))
    answer = b""
    while not answer.endswith(b"\n"):
        answer += mine.recv(1)
    assert json.loads(answer)["id"] == 1
    return raw, mine


def test_a_socket_client_gone_with_an_answer_unread_ends_the_server_cleanly(demo_config_path: Path) -> None:
    """Found by review (twenty-seventh session): a client on a socket closes it with an answer unread in its
    queue (any abrupt quit): the kernel resets the connection, and the server's next read raised
    ConnectionResetError: status 1 and 6 KB of tracebacks (5 runs of 5; TCP alike). Invariant: status 0, no
    traceback, the call in flight recorded start and end."""
    raw, mine = _over_a_socket(demo_config_path)
    mine.sendall(call(2, "explain_command", command="true") + call(3, "run_command", command="sleep 5"))
    _until_recorded(raw, demo_config_path, "sleep 5")
    assert mine.recv(1, socket.MSG_PEEK)  # explain_command's answer is in the client's queue, unread
    mine.close()
    status, err = _exit_of(raw, within_s=30)
    assert "Traceback" not in err, err[-3000:]
    assert "Fatal read error" not in err, err[-3000:]
    assert status == 0, err[-3000:]
    assert [entry["event"] for entry in _run_records(demo_config_path, "sleep 5")] == ["start", "end"]


def test_a_socket_client_gone_with_a_long_call_in_flight_frees_the_state_folder_at_once(
    demo_config_path: Path,
) -> None:
    """Found by review: the FIFO variant above ends at once, but on a socket nothing watched the client go, and
    the end of input waited for the call's own end (30.1 s for `sleep 30`, 2 of 2), the state folder held.
    Invariant: the server ends long before the call would (a unix socket's close is seen: POLLHUP)."""
    raw, mine = _over_a_socket(demo_config_path)
    mine.sendall(call(2, "run_command", command="sleep 30", timeout_s=60))
    _until_recorded(raw, demo_config_path, "sleep 30")
    mine.close()
    status, err = _exit_of(raw, within_s=20)  # the call would run 30 s
    assert status == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    second = Raw(demo_config_path)
    second.initialize()
    assert second.finish()[0] == 0


def test_a_terminal_that_hangs_up_mid_answer_ends_the_server_cleanly(demo_config_path: Path, workspace: Path) -> None:
    """Found by review (older than the session's fixes): stdin and stdout a terminal whose other side closes (its
    window closed) while a 1 MiB answer fills it: the read in its worker thread raised EIO and the server died,
    status 1, with a traceback (2 of 2). Invariant: status 0, no traceback."""
    master, slave = pty.openpty()
    tty.setraw(slave)
    raw = Raw(demo_config_path, stdin=slave, stdout=slave)
    os.close(slave)
    try:
        os.write(master, line(INITIALIZE_REQUEST) + line(INITIALIZED))
        answer = b""
        while b"\n" not in answer:
            assert select.select([master], [], [], 30)[0], "no answer to initialize"
            answer += os.read(master, 65536)
        assert json.loads(answer.splitlines()[0])["id"] == 1
        (workspace / "big.txt").write_text("z" * (1 << 20))
        os.write(master, call(2, "read_file", path="big.txt"))
        assert select.select([master], [], [], 30)[0], "the answer never started"  # it fills the terminal, unread
    finally:
        os.close(master)
    status, err = _exit_of(raw, within_s=30)
    assert "Traceback" not in err, err[-3000:]
    assert status == 0, err[-3000:]


@pytest.mark.parametrize("kind", ["SOCK_SEQPACKET", "SOCK_DGRAM", "listening"])
def test_a_socket_the_stdio_transport_cannot_use_is_refused_at_start_in_one_line(
    demo_config_path: Path, tmp_path: Path, kind: str
) -> None:
    """Found by review (twenty-seventh session): stdio on a SOCK_SEQPACKET socket (systemd's
    ListenSequentialPacket= with Accept=yes) lost every answer past the send buffer's size (EMSGSIZE), silently;
    on a datagram socket a client that quit was never seen, and the state folder stayed held; on a listening
    socket (Accept=no) the server ended, status 0 and no word, at the first connection. Invariant: the server
    refuses to start, exit 78, one line naming the socket and what to use."""
    if kind == "listening":
        theirs = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        theirs.bind(str(tmp_path / "listening.sock"))
        theirs.listen()
        mine = None
    else:
        mine, theirs = socket.socketpair(socket.AF_UNIX, getattr(socket, kind))
    with theirs:
        done = subprocess.run(
            [str(BASTION), "serve", "--config", str(demo_config_path), "--stdio"],
            stdin=theirs.fileno(),
            stdout=theirs.fileno(),
            stderr=subprocess.PIPE,
            timeout=60,
        )
    if mine is not None:
        mine.close()
    lines = done.stderr.decode().strip().splitlines()
    assert done.returncode == 78, lines
    assert len(lines) == 1, lines
    assert ("listening socket" if kind == "listening" else f"{kind} socket") in lines[0], lines


def test_a_client_that_stops_reading_but_still_writes_is_served_and_the_server_ends_with_its_input(
    demo_config_path: Path, workspace: Path
) -> None:
    """The same attack with stdin left open: the client closes its reading end, then pings and calls. The
    answers have nowhere to go and are dropped; the calls run and are recorded, and the end of input ends the
    server at once, status 0, no traceback."""
    raw = Raw(demo_config_path)
    raw.initialize()
    raw.stdout.close()
    raw.send(line({"jsonrpc": "2.0", "id": 2, "method": "ping"}))
    command = "touch after.txt"
    raw.send(call(3, "run_command", command=command))
    records = _until_recorded(raw, demo_config_path, command, records=2)  # run, its answer dropped
    assert records[1]["code"] == "OK", records[1]
    assert raw.stdin is not None
    raw.stdin.close()
    status, err = _exit_of(raw)
    assert "Traceback" not in err, err[-3000:]
    assert status == 0, err[-3000:]
    assert (workspace / "after.txt").is_file()


@pytest.mark.bwrap
def test_nan_and_infinite_numbers_are_refused_and_time_limits_still_hold(demo_config_path: Path) -> None:
    """Attack (repro_nan.py, s2.py): `timeout_s` NaN passed every `<=` check (NaN compares false) and became
    an event-loop timer, which NaN left out of order: other calls' time limits fired seconds late, a 35 s
    sleep ran past the 30 s limit, and the HTTP server no longer heard SIGINT. JSON parsers take `NaN`,
    `Infinity` and `1e400`. Invariant: each is INVALID_REQUEST naming the argument, before anything runs,
    and a call's time limit still ends its command."""
    raw = Raw(demo_config_path)
    raw.initialize()
    for request_id, number in enumerate(("NaN", "Infinity", "-Infinity", "1e400"), start=10):
        text = (
            f'{{"jsonrpc":"2.0","id":{request_id},"method":"tools/call","params":{{"name":"run_command",'
            f'"arguments":{{"command":"sleep 30","timeout_s":{number}}}}}}}\n'
        )
        raw.send(text.encode())
        answer = raw.answer()
        assert answer["id"] == request_id
        result = answer["result"]["structuredContent"]
        assert result["code"] == "INVALID_REQUEST", (number, result)
        assert "timeout_s must be a finite number" in result["reason"]
    raw.send(call(20, "run_command", command="sleep 30", timeout_s=0.5))
    timed_out = raw.answer()["result"]["structuredContent"]
    assert timed_out["code"] == "TIMEOUT", timed_out
    status, _, err = raw.finish()
    assert status == 0, err
    audit = (demo_config_path.parent / "state" / "audit.jsonl").read_text()
    for entry in audit.splitlines():  # the refused arguments are recorded as text strict JSON can carry
        json.loads(entry, parse_constant=_not_json)


def _not_json(constant: str) -> None:
    raise AssertionError(f"{constant} is not JSON")
