"""A persistent Python context: runs INSIDE a sandbox, like a notebook kernel.

Started by `bastion.workbench.code` as a background process of the sandbox
(``python -I -c <this source> <site dir>``). Standard library only at start; it
imports what the agent's code imports. It runs the agent's code, so nothing
here is trusted by the host: the host reads its messages as untrusted JSON,
with a size cap.

Protocol:
  host -> kernel (stdin), one JSON object per line:
      {"op": "exec", "id": N, "code": "..."}  |  {"op": "interrupt"}
  kernel -> host (saved stdout), a header line of at most 4096 bytes (a JSON object), then, if
  it has "bytes": n, exactly n raw bytes of payload. Bulk data is never inside the JSON, so
  the host parses only small headers and can bound, skip or stream every payload:
      {"event": "ready", "python": "3.11.2"}
      {"event": "stream", "id": N, "name": "stdout"|"stderr", "bytes": n}   + the bytes written
      {"event": "image", "id": N, "width": W, "height": H, "bytes": n}      + a PNG
      {"event": "image", "id": N, "mime": "image/svg+xml", "bytes": n}    + an SVG, UTF-8
      {"event": "value", "id": N, "bytes": n}                              + repr, UTF-8
      {"event": "display", "id": N, "mime": "text/markdown"|"text/html", "bytes": n}  + UTF-8
      {"event": "error", "id": N, "field": "type"|"message"|"traceback", "bytes": n}  + UTF-8
      {"event": "done", "id": N, "status": "ok"|"error"}

The kernel's fds 1 and 2 are pipes it reads itself, so output of C code and of
child processes is captured too, in the order it was written per stream.
"""

from __future__ import annotations

import ast
import importlib
import io
import json
import linecache
import os
import signal
import site
import sys
import threading
import traceback
from typing import Any

MAX_VALUE_CHARS = 8192
MAX_RICH_CHARS = 65536  # of a markdown or HTML form of a value (the host's cap on text fields)
MAX_TABLE_ROWS = 50
MAX_TABLE_COLUMNS = 20
MAX_TABLE_CELL_CHARS = 200
MAX_ERROR_CHARS = 65536  # each of message and traceback (the traceback keeps its end)
MAX_IMAGES = 8
MAX_IMAGE_BYTES = 4 << 20  # the host takes no bigger PNG
READ_CHUNK = 65536
MARKER = b"\x00bastion-drain-" + os.urandom(8).hex().encode() + b"\x00"

_proto_lock = threading.Lock()
_channel = {"fd": -1}  # the saved stdout: the only channel to the host
_current: dict[str, int | None] = {"id": None}
_running = [False]  # True exactly while the agent's code runs: only then does SIGINT interrupt


def on_interrupt(_signum: int, _frame: object) -> None:
    # Serialized with the main thread's code: once a cell has ended, a late interrupt does nothing.
    if _running[0]:
        raise KeyboardInterrupt


def emit(message: dict[str, Any], payload: bytes | None = None) -> None:
    if payload is not None:
        message = {**message, "bytes": len(payload)}
    data = (json.dumps(message, separators=(",", ":")) + "\n").encode("ascii") + (payload or b"")
    with _proto_lock:
        view = memoryview(data)
        while view:
            written = os.write(_channel["fd"], view)
            view = view[written:]


def held_tail(data: bytes, marker: bytes) -> int:
    """Length of the longest end of `data` that could be the start of `marker`."""
    for size in range(min(len(data), len(marker) - 1), 0, -1):
        if marker.startswith(data[-size:]):
            return size
    return 0


def forward(name: str, data: bytes) -> None:
    if data:
        emit({"event": "stream", "id": _current["id"], "name": name}, data)


def pump(fd: int, name: str, drained: threading.Event) -> None:
    """Forward what the code writes to fd 1 or 2, as stream events of the running execution.

    `drain` writes MARKER to the fd after a cell: when the marker comes out of the pipe,
    everything written before it has been forwarded (a pipe keeps order).
    """
    carry = b""
    while True:
        chunk = os.read(fd, READ_CHUNK)
        if not chunk:
            return
        data, carry = carry + chunk, b""
        while True:
            found = data.find(MARKER)
            if found < 0:
                break
            forward(name, data[:found])
            data = data[found + len(MARKER) :]
            drained.set()
        keep = held_tail(data, MARKER)
        forward(name, data[: len(data) - keep])
        carry = data[len(data) - keep :]


_drained = {1: threading.Event(), 2: threading.Event()}


def capture(fd_number: int, name: str) -> None:
    read_end, write_end = os.pipe()
    os.dup2(write_end, fd_number)
    os.close(write_end)
    threading.Thread(target=pump, args=(read_end, name, _drained[fd_number]), daemon=True).start()


def drain() -> None:
    """Wait until everything written to fds 1 and 2 so far has been forwarded."""
    for stream in (sys.stdout, sys.stderr):
        try:  # noqa: SIM105 - contextlib is not imported into the agent's process for this
            stream.flush()
        except Exception:  # noqa: S110 - the agent may have replaced or closed them
            pass
    for fd, drained in _drained.items():
        drained.clear()
        try:
            os.write(fd, MARKER)
        except OSError:
            continue  # the agent's code closed it: nothing more can come through it
        drained.wait(1.0)


def figures() -> list[tuple[bytes, int, int]]:
    """PNGs of the matplotlib figures the code left open (those within MAX_IMAGE_BYTES); they are closed after."""
    pyplot: Any = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return []
    images: list[tuple[bytes, int, int]] = []
    try:
        for number in pyplot.get_fignums()[:MAX_IMAGES]:
            figure = pyplot.figure(number)
            buffer = io.BytesIO()
            figure.savefig(buffer, format="png", dpi=figure.dpi)
            width, height = (int(v * figure.dpi + 0.5) for v in figure.get_size_inches())
            if buffer.tell() <= MAX_IMAGE_BYTES:
                images.append((buffer.getvalue(), width, height))
    finally:
        pyplot.close("all")
    return images


def quiet_show() -> None:
    # Figures come back as images after each execution; show() on the Agg backend only warns.
    pyplot: Any = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None and getattr(pyplot.show, "__module__", "") != __name__:
        pyplot.show = lambda *args, **kwargs: None
        pyplot.show.__module__ = __name__


def run_cell(cell_id: int, code: str, namespace: dict[str, Any]) -> dict[str, str | bytes] | None:
    """Run one cell; the value of a last expression is returned in each form it has (`shown`)."""
    filename = f"<cell-{cell_id}>"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    tree = ast.parse(code, filename, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body[-1].value)
        del tree.body[-1]
    exec(compile(tree, filename, "exec"), namespace)  # noqa: S102 - running the agent's code is the point
    quiet_show()
    if last is None:
        return None
    value = eval(compile(last, filename, "eval"), namespace)  # noqa: S307 - the agent's own expression
    quiet_show()
    if value is None:
        return None
    namespace["_"] = value
    text = repr(value)
    if not isinstance(text, str):
        raise TypeError(f"__repr__ returned {kind_name(text)}, not str")
    forms: dict[str, str | bytes] = {"text/plain": cut(str.__getitem__(text, slice(None)), MAX_VALUE_CHARS)}
    forms.update(shown(value))
    return forms


def cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def shown(value: object) -> dict[str, str | bytes]:
    """The rich forms of a value, as Jupyter shows them: markdown (a table of a DataFrame, built here),
    HTML, SVG, PNG. A `_repr_*_` method that raises or returns the wrong type is skipped with a note on
    stderr; one that loops is stopped by the cell's timeout (this runs while the cell does)."""
    forms: dict[str, str | bytes] = {}
    table = frame_markdown(value)
    if table is not None:
        forms["text/markdown"] = table
    for mime, method in (
        ("text/markdown", "_repr_markdown_"),
        ("text/html", "_repr_html_"),
        ("image/svg+xml", "_repr_svg_"),
        ("image/png", "_repr_png_"),
    ):
        if mime in forms:
            continue
        data = call_repr(value, method, bytes if mime == "image/png" else str)
        if isinstance(data, bytes) or (mime == "image/svg+xml" and isinstance(data, str)):
            if len(data) <= MAX_IMAGE_BYTES:  # an image is whole or not at all
                forms[mime] = data
        elif data is not None:
            forms[mime] = cut(data, MAX_RICH_CHARS)
    return forms


def kind_name(value: object) -> str:
    return str(type(value).__name__)[:100]


def call_repr(value: object, method: str, kind: type) -> str | bytes | None:
    function = getattr(type(value), method, None)
    if function is None:
        return None
    try:
        data = function(value)
    except Exception as exc:
        # Only the exception's type: its message is the agent's object too, and may raise or flood.
        print(f"{method} of {kind_name(value)} raised {kind_name(exc)}: shown as text only", file=sys.stderr)
        return None
    if type(data) is tuple and data:
        data = data[0]  # IPython allows (data, metadata)
    if not isinstance(data, (str, bytes)) or not isinstance(data, kind):
        return None
    # An exact copy: a subclass's own len, slicing or encode would be the agent's code running after the cell.
    return str.__getitem__(data, slice(None)) if isinstance(data, str) else bytes.__getitem__(data, slice(None))


def frame_markdown(value: object) -> str | None:
    """A pandas DataFrame (or Series) as a bounded markdown table: the first MAX_TABLE_ROWS rows and
    MAX_TABLE_COLUMNS columns, cells cut and their '|' escaped; None for anything else or on any error."""
    kind = type(value)
    # pandas 3 names its classes' module "pandas"; earlier versions "pandas.core.frame".
    if kind.__module__.split(".")[0] != "pandas" or kind.__name__ not in ("DataFrame", "Series"):
        return None
    try:
        frame: Any = value.to_frame() if kind.__name__ == "Series" else value  # type: ignore[attr-defined]
        rows, columns = frame.shape
        part = frame.iloc[:MAX_TABLE_ROWS, :MAX_TABLE_COLUMNS]
        header = [table_cell(frame.index.name or ""), *(table_cell(c) for c in part.columns)]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for label, row in zip(part.index, part.itertuples(index=False, name=None), strict=False):
            lines.append("| " + " | ".join(table_cell(v) for v in (label, *row)) + " |")
    except Exception:
        return None
    if rows > MAX_TABLE_ROWS or columns > MAX_TABLE_COLUMNS:
        lines.append(f"\n({rows} rows x {columns} columns; the first {len(part)} x {len(part.columns)} shown)")
    return "\n".join(lines)


def table_cell(value: object) -> str:
    text = " ".join(str(value).split())[:MAX_TABLE_CELL_CHARS]
    return text.replace("\\", "\\\\").replace("|", "\\|")


def error_of(exc: BaseException) -> dict[str, str]:
    # The agent sees the frames of its own code, not the kernel's (whose file is this one).
    summary = traceback.TracebackException.from_exception(exc)
    own = error_of.__code__.co_filename
    summary.stack = traceback.StackSummary.from_list([f for f in summary.stack if f.filename != own])
    text = "".join(summary.format())
    if len(text) > MAX_ERROR_CHARS:
        text = "...\n" + text[-MAX_ERROR_CHARS:]
    return {"type": type(exc).__name__[:200], "message": str(exc)[:MAX_ERROR_CHARS], "traceback": text}


def execute(request: dict[str, Any], namespace: dict[str, Any], site_dir: str) -> None:
    cell_id = int(request["id"])
    _current["id"] = cell_id
    if os.path.isdir(site_dir) and site_dir not in sys.path:
        site.addsitedir(site_dir)  # packages installed since the context started
    importlib.invalidate_caches()
    status, value, error = "ok", None, None
    try:
        _running[0] = True
        value = run_cell(cell_id, request["code"], namespace)
        _running[0] = False
    except BaseException as exc:  # the agent's error, KeyboardInterrupt included, is data
        _running[0] = False
        if isinstance(exc, SystemExit):
            status, error = "error", {"type": "SystemExit", "message": str(exc.code)[:MAX_ERROR_CHARS], "traceback": ""}
        else:
            status, error = "error", error_of(exc)
    images: list[tuple[bytes, int, int]] = []
    try:
        images = figures()
    except Exception as exc:
        error = error or error_of(exc)
        status = "error"
    drain()
    report(cell_id, value, error, images)
    emit({"event": "done", "id": cell_id, "status": status})
    _current["id"] = None


def report(
    cell_id: int,
    value: dict[str, str | bytes] | None,
    error: dict[str, str] | None,
    images: list[tuple[bytes, int, int]],
) -> None:
    """What a cell left: its value in each form, its error and its figures, each a message with a payload."""
    for mime, data in (value or {}).items():
        payload = data if isinstance(data, bytes) else data.encode("utf-8", "replace")
        if mime == "text/plain":
            emit({"event": "value", "id": cell_id}, payload)
        elif mime.startswith("text/"):
            emit({"event": "display", "id": cell_id, "mime": mime}, payload)
        elif len(payload) <= MAX_IMAGE_BYTES:
            width, height = png_size(payload) if mime == "image/png" else (0, 0)
            emit({"event": "image", "id": cell_id, "mime": mime, "width": width, "height": height}, payload)
    for field, text in (error or {}).items():
        emit({"event": "error", "id": cell_id, "field": field}, text.encode("utf-8", "replace"))
    for png, width, height in images:
        emit({"event": "image", "id": cell_id, "width": width, "height": height}, png)


def png_size(data: bytes) -> tuple[int, int]:
    # The IHDR chunk comes first: width and height are its first two big-endian words.
    if len(data) < 24:
        return 0, 0
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def read_requests(fd: int, main_thread: int, inbox: list[dict[str, Any]], wake: threading.Semaphore) -> None:
    """Requests from the host; an interrupt is delivered at once, as SIGINT to the main thread."""
    stream = os.fdopen(fd, "rb", buffering=0)
    buffer = b""
    while True:
        chunk = stream.read(READ_CHUNK)
        if not chunk:
            os._exit(0)  # the host closed the context
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            request = json.loads(line)
            if request.get("op") == "interrupt":
                if _running[0]:
                    signal.pthread_kill(main_thread, signal.SIGINT)
            else:
                inbox.append(request)
                wake.release()


def main() -> None:
    # The sandbox's own venv (argv[1]): packages installed there, even after this context started, import.
    venv = sys.argv[1] if len(sys.argv) > 1 else ""
    site_dir = f"{venv}/lib/python{sys.version_info[0]}.{sys.version_info[1]}/site-packages" if venv else ""
    _channel["fd"] = os.dup(1)
    os.set_inheritable(_channel["fd"], False)
    capture(1, "stdout")
    capture(2, "stderr")
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0, closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0, closefd=False), write_through=True)
    devnull = os.open(os.devnull, os.O_RDONLY)
    stdin_fd = os.dup(0)
    os.dup2(devnull, 0)  # the agent's code reads EOF; requests come on the saved stdin
    os.close(devnull)
    os.set_inheritable(stdin_fd, False)
    signal.signal(signal.SIGINT, on_interrupt)
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
    inbox: list[dict[str, Any]] = []
    wake = threading.Semaphore(0)
    os.environ.setdefault("MPLBACKEND", "Agg")
    # As in a notebook, modules the agent writes in the working folder import; added after the
    # kernel's own imports, so a /workspace/json.py cannot replace the kernel's json.
    sys.path.insert(0, os.getcwd())
    threading.Thread(
        target=read_requests, args=(stdin_fd, threading.main_thread().ident, inbox, wake), daemon=True
    ).start()
    emit({"event": "ready", "python": ".".join(str(v) for v in sys.version_info[:3])})
    while True:
        wake.acquire()
        execute(inbox.pop(0), namespace, site_dir)


if __name__ == "__main__":
    main()
