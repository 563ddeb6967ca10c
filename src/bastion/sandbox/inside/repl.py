"""A persistent bash or JavaScript context: runs INSIDE a sandbox, as kernel.py does for Python.

Started by `bastion.workbench.code` as a background process of the sandbox
(``python3 -I -c <this source> bash|javascript <runtime>``). Standard library only. It speaks
kernel.py's protocol to the host (the same headers and payloads; "done" also carries bash's
"exit_status") and drives one resident runtime, whose state (variables, functions, cwd) lives
between cells:

  bash: ``bash --noprofile --norc --noediting -i +m``, fed per cell one line that sources the
        cell's file with stdin from /dev/null, then an epilogue line. Interactive, so that SIGINT
        abandons the cell's line as at a terminal and the shell goes on to the epilogue ($? = 130).
  javascript: node running RUNNER_JS: each cell is a `vm.Script` run in node's own context with
        breakOnSigint (the context persists; `require` resolves from the working folder).

The end of a cell: the runtime writes "\\0<token>\\0" to its stdout and stderr (what came before it
in each pipe is forwarded, a pipe keeps order), then a status line "<token> {json}" to a FIFO it
opens by path (a cell that closed its fds 1 and 2 cannot stop the status). The token is random per
cell and never in the cell's reach before it ends, so a cell cannot end itself early by printing a
marker. The runtime's exit ends the context: what it wrote is forwarded, then this process exits.
Nothing here is trusted by the host: it reads every message as it reads the Python kernel's.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import sys
import tempfile
import threading
from typing import Any

READ_CHUNK = 65536
MAX_STATUS_BYTES = 1 << 20  # a status line holds a value and an error, each capped by the runtime
MAX_TEXT_CHARS = 65536  # of an error field; the host cuts and redacts again
DRAIN_WAIT_S = 1.0  # for the end marker of an open stream (a background job may hold its pipe)

RUNNER_JS = r"""'use strict';
const fs = require('fs'), vm = require('vm'), util = require('util'), readline = require('readline');
const fifo = process.argv[2], self = process.argv[1];
globalThis.require = require('module').createRequire(process.cwd() + '/');
const cut = (text, limit) => (text.length > limit ? text.slice(0, limit) + '...' : text);
const shown = (value) => {
  try { return cut(util.inspect(value, { depth: 4, maxArrayLength: 100, maxStringLength: 8192 }), 8192); }
  catch (err) { return '<a value that cannot be shown>'; }
};
const describe = (error) => {
  try {
    if (error instanceof Error || (error && typeof error.stack === 'string')) {
      const frames = String(error.stack).split('\n').filter((l) => !l.includes(self) && !l.includes('(node:'));
      return { type: cut(String(error.name), 200), message: cut(String(error.message), 65536),
               traceback: cut(frames.join('\n'), 65536) };
    }
  } catch (err) { /* a hostile error object: described by its inspection below */ }
  return { type: 'Uncaught', message: shown(error), traceback: '' };
};
let pending = null;
process.on('SIGINT', () => { if (pending) pending({ type: 'Interrupted', message: 'interrupted', traceback: '' }); });
const warn = (what, err) => { try { console.error(what, err); } catch (e) { /* stderr is gone */ } };
process.on('uncaughtException', (err) => warn('Uncaught', err));  // a late error does not end the context
process.on('unhandledRejection', (err) => warn('Unhandled rejection', err));
const compile = (code, id) => {
  const filename = `<cell-${id}>`;
  try { return new vm.Script(code, { filename }); }
  catch (err) {
    if (!(err instanceof SyntaxError) || !String(err.message).includes('await')) throw err;
    return new vm.Script(`(async () => {\n${code}\n})()`, { filename });  // top-level await
  }
};
const report = (token, value, error) => {
  const mark = (fd) => { try { fs.writeSync(fd, '\0' + token + '\0'); return 1; } catch (e) { return 0; } };
  const flags = [mark(1), mark(2)];
  const status = { o: flags[0], e: flags[1] };
  if (error !== undefined) status.error = error;
  else if (value !== undefined) status.value = shown(value);
  fs.writeFileSync(fifo, token + ' ' + JSON.stringify(status) + '\n');
};
const cells = [];
let busy = false;
const next = () => {
  if (busy || !cells.length) return;
  busy = true;
  const cell = cells.shift();
  let done = false;
  const finish = (value, error) => {
    if (done) return;
    done = true; pending = null;
    report(cell.token, value, error === undefined ? undefined : describe(error));
    busy = false; setImmediate(next);
  };
  pending = (error) => finish(undefined, error);
  let result;
  try { result = compile(cell.code, cell.id).runInThisContext({ breakOnSigint: true, displayErrors: false }); }
  catch (err) { finish(undefined, err); return; }
  let then = null;
  try { then = result !== null && typeof result === 'object' && typeof result.then === 'function' ? result : null; }
  catch (err) { then = null; }
  if (then) Promise.resolve(then).then((v) => finish(v), (e) => finish(undefined, e === undefined ? null : e));
  else finish(result);
};
readline.createInterface({ input: fs.createReadStream(null, { fd: 3 }) }).on('line', (line) => {
  cells.push(JSON.parse(line));
  next();
});
"""

_proto_lock = threading.Lock()
_channel = {"fd": -1}
_cell: dict[str, Any] = {"id": None, "marker": b"", "pgid": 0}
_drained = {"stdout": threading.Event(), "stderr": threading.Event()}
_closed = {"stdout": threading.Event(), "stderr": threading.Event()}  # the pump read EOF
_statuses: queue.Queue[bytes] = queue.Queue()


def emit(message: dict[str, Any], payload: bytes | None = None) -> None:
    if payload is not None:
        message = {**message, "bytes": len(payload)}
    data = (json.dumps(message, separators=(",", ":")) + "\n").encode("ascii") + (payload or b"")
    with _proto_lock:
        write_all(_channel["fd"], data)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def held_tail(data: bytes, marker: bytes) -> int:
    """Length of the longest end of `data` that could be the start of `marker`."""
    for size in range(min(len(data), len(marker) - 1), 0, -1):
        if marker.startswith(data[-size:]):
            return size
    return 0


def forward(name: str, data: bytes) -> None:
    if not data:
        return
    if _cell["id"] is not None:
        emit({"event": "stream", "id": _cell["id"], "name": name}, data)
    elif name == "stderr":
        os.write(2, data[:4096])  # between cells (a start that failed): to this process's stderr, for the host's log


def pump(fd: int, name: str) -> None:
    """Forward what the runtime writes to `fd`; the running cell's marker, when it comes out, says all
    that came before it has been forwarded."""
    carry = b""
    while True:
        chunk = os.read(fd, READ_CHUNK)
        if not chunk:
            forward(name, carry)
            _closed[name].set()
            return
        data, carry = carry + chunk, b""
        marker = _cell["marker"]
        found = data.find(marker) if marker else -1
        while found >= 0:
            forward(name, data[:found])
            data = data[found + len(marker) :]
            _drained[name].set()
            found = data.find(marker)
        keep = held_tail(data, marker) if marker else 0
        forward(name, data[: len(data) - keep])
        carry = data[len(data) - keep :]


def read_statuses(path: str) -> None:
    """Lines from the FIFO, opened read-write so that it never reads EOF between writers."""
    fd = os.open(path, os.O_RDWR)
    buffer = b""
    while True:
        buffer += os.read(fd, READ_CHUNK)
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            _statuses.put(line)
        if len(buffer) > MAX_STATUS_BYTES:
            buffer = b""  # nobody's status: the rest of that line fails the token check


def reap(runtime: int, language: str, pumps: list[threading.Thread]) -> None:
    """Reap children (this may be PID 1); when the runtime exits, forward its last output and end."""
    while True:
        try:
            child, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return
        if child == runtime:
            break
    for thread in pumps:
        thread.join(DRAIN_WAIT_S)  # a background job may still hold a pipe
    code = os.waitstatus_to_exitcode(status)
    if _cell["id"] is not None:
        note = f"\n[the {language} runtime exited (status {code}): this context has ended]\n"
        emit({"event": "stream", "id": _cell["id"], "name": "stderr"}, note.encode())
    with _proto_lock:  # held to the end: no message is cut in half by the exit
        os._exit(0)


def start(argv: list[str], fds: dict[int, int]) -> int:
    """Spawn the runtime in a process group of its own (SIGINT goes to it and its foreground children)."""
    actions = [(os.POSIX_SPAWN_DUP2, source, target) for target, source in fds.items()]
    return os.posix_spawn(argv[0], argv, os.environ, file_actions=actions, setpgroup=0)


class Bash:
    def __init__(self, runtime: str, folder: str, fifo: str) -> None:
        self.folder, self.fifo = folder, fifo
        self.argv = [runtime, "--noprofile", "--norc", "--noediting", "-i", "+m"]
        os.environ.update({"PS1": "", "PS2": "", "PS0": "", "PROMPT_COMMAND": "", "HISTFILE": ""})
        self.setup = "set +o history"  # interactive bash would keep every line it read
        self.cell_file = os.path.join(folder, "cell.sh")
        self.input = -1

    def send(self, code: str, token: str) -> None:
        cell = self.cell_file
        with open(cell, "w", encoding="utf-8", errors="replace") as file:
            file.write(code)
        # The epilogue's own line: SIGINT abandons the cell's line, not this one. Its variables are
        # unset again; printf is bash's own, and the status goes to the FIFO by path.
        epilogue = (
            "__bastion_rc=$? __bastion_o=0 __bastion_e=0; "
            f"{{ builtin printf '\\0%s\\0' {token}; }} 2>/dev/null && __bastion_o=1; "
            f"{{ builtin printf '\\0%s\\0' {token} >&2; }} 2>/dev/null && __bastion_e=1; "
            f'builtin printf \'%s {{"exit_status":%d,"o":%d,"e":%d}}\\n\' {token} '
            f'"$__bastion_rc" "$__bastion_o" "$__bastion_e" > {self.fifo}; '
            "builtin unset __bastion_rc __bastion_o __bastion_e\n"
        )
        write_all(self.input, f". {cell} </dev/null\n{epilogue}".encode())


class Node:
    def __init__(self, runtime: str, folder: str, fifo: str) -> None:
        script = os.path.join(folder, "runner.js")
        with open(script, "w", encoding="utf-8") as file:
            file.write(RUNNER_JS)
        self.argv = [runtime, script, fifo]
        self.setup = ""
        self.cell_file = ""
        self.input = -1

    def send(self, code: str, token: str) -> None:
        cell = {"id": _cell["id"] or 0, "token": token, "code": code}
        write_all(self.input, (json.dumps(cell) + "\n").encode())


def run_cell(runtime: Bash | Node, cell_id: int | None, code: str) -> dict[str, Any]:
    """Send one cell; return its status once it and its output are through."""
    token = os.urandom(16).hex()
    for event in _drained.values():
        event.clear()
    _cell.update(id=cell_id, marker=b"\0" + token.encode() + b"\0")
    runtime.send(code, token)
    prefix = token.encode() + b" "
    while True:
        line = _statuses.get()
        if line.startswith(prefix):
            break
    try:
        status = json.loads(line[len(prefix) :])
    except ValueError:
        status = {}
    status = status if isinstance(status, dict) else {}
    for flag, name in (("o", "stdout"), ("e", "stderr")):
        # No marker (the cell closed that fd): what it wrote before is through once the pump reads EOF.
        (_drained if status.get(flag) == 1 else _closed)[name].wait(DRAIN_WAIT_S)
    if runtime.cell_file:
        with contextlib.suppress(OSError):
            os.unlink(runtime.cell_file)  # sourced by now; a big cell does not sit in /tmp (the sandbox's memory)
    return status


def report(cell_id: int, status: dict[str, Any]) -> None:
    value, error = status.get("value"), status.get("error")
    if isinstance(value, str):
        emit({"event": "value", "id": cell_id}, value.encode("utf-8", "replace"))
    if isinstance(error, dict):
        for field in ("type", "message", "traceback"):
            text = str(error.get(field, ""))[:MAX_TEXT_CHARS]
            emit({"event": "error", "id": cell_id, "field": field}, text.encode("utf-8", "replace"))
    done: dict[str, Any] = {"event": "done", "id": cell_id, "status": "error" if error else "ok"}
    if type(status.get("exit_status")) is int:
        done["exit_status"] = status["exit_status"]
    emit(done)


def read_requests(fd: int, inbox: queue.Queue[dict[str, Any]]) -> None:
    """Requests from the host; an interrupt is SIGINT to the runtime's group, at once."""
    buffer = b""
    while True:
        chunk = os.read(fd, READ_CHUNK)
        if not chunk:
            os.killpg(_cell["pgid"], signal.SIGKILL)  # the host closed the context
            os._exit(0)
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            try:
                request = json.loads(line)
            except ValueError:
                continue  # not the host's (a cell can reach this pipe through /proc): nothing to do
            if not isinstance(request, dict):
                continue
            if request.get("op") == "interrupt":
                if _cell["id"] is not None:
                    os.killpg(_cell["pgid"], signal.SIGINT)
            elif type(request.get("id")) is int and isinstance(request.get("code"), str):
                inbox.put(request)


def main() -> None:
    language, runtime_path = sys.argv[1], sys.argv[2]
    _channel["fd"] = os.dup(1)
    requests = os.dup(0)
    folder = tempfile.mkdtemp(prefix=f".bastion-{language}-")
    fifo = os.path.join(folder, "status")
    os.mkfifo(fifo, 0o600)
    runtime: Bash | Node = (Bash if language == "bash" else Node)(runtime_path, folder, fifo)
    cells_r, runtime.input = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    fds = {0: cells_r, 1: out_w, 2: err_w} if language == "bash" else {0: null, 1: out_w, 2: err_w, 3: cells_r}
    pid = start(runtime.argv, fds)
    _cell["pgid"] = pid
    for fd in (cells_r, out_w, err_w, null):
        os.close(fd)
    streams = ((out_r, "stdout"), (err_r, "stderr"))
    pumps = [threading.Thread(target=pump, args=(fd, name), daemon=True) for fd, name in streams]
    for thread in pumps:
        thread.start()
    threading.Thread(target=read_statuses, args=(fifo,), daemon=True).start()
    threading.Thread(target=reap, args=(pid, language, pumps), daemon=True).start()
    run_cell(runtime, None, runtime.setup)  # past the runtime's start (bash says it has no job control)
    inbox: queue.Queue[dict[str, Any]] = queue.Queue()
    threading.Thread(target=read_requests, args=(requests, inbox), daemon=True).start()
    emit({"event": "ready", "language": language})
    while True:
        request = inbox.get()
        cell_id = request["id"]
        try:
            status = run_cell(runtime, cell_id, request["code"])
        except OSError as exc:  # e.g. /tmp is full: the cell's file cannot be written
            status = {"error": {"type": "OSError", "message": f"the cell could not be handed over: {exc}"}}
        _cell["id"] = None
        report(cell_id, status)


if __name__ == "__main__":
    main()
