#!/usr/bin/env python3
"""bastion gateway dispatch: the forced command on a production host. SECURITY BOUNDARY.

Installed on the TARGET host, not where bastion runs. One file, standard library only,
Python 3.9+, no import from bastion. The authorized_keys line of bastion's dedicated key
pins it (``restrict,from="...",command="/usr/bin/python3 -I /path/dispatch.py --config
/path/dispatch.toml" ssh-ed25519 ...``), so whatever a client sends through that key,
only this script runs, and it runs only what its own config allows.

What it does, in rrsync's shape (rsync support/rrsync):
- reads its config only if the SSH user cannot have changed it: the file and every folder
  above it must be owned by root (or by this script's owner, if that is not the SSH user)
  and not writable by group or others (a sticky folder such as /tmp excepted), with no
  symlink on the way; else nothing runs. The SSH user owning its own policy would let an
  action, or anything else running as that user, rewrite what the gateway allows;
- reads ``SSH_ORIGINAL_COMMAND``: refuses an empty one (an interactive login), more than
  256 characters, anything but printable ASCII (control characters, NUL, newlines),
  anything but single spaces between words, an unknown verb, a wrong number of arguments,
  an argument outside its pattern, starting with ``-``, or naming a project not listed;
- resolves a ``path`` argument beneath ``root`` one component at a time with directory
  file descriptors (``O_NOFOLLOW``), so ``..``, symlinks and sibling prefixes cannot
  escape, and hands the program the opened descriptor as ``/dev/fd/N``; only a plain file
  with one link (a hard link may be a file from outside ``root``) or a folder is accepted,
  never a FIFO (the action would block on it until its timeout), socket or device;
- runs the action's fixed program with an argv (never a shell), a clean environment,
  no stdin, a timeout (the whole process group is killed) and an output cap; if the
  client goes away mid-run, the action is not cut off halfway: it runs on, drained,
  under the same timeout, and its end is recorded (``client_gone``);
- writes one JSONL record per request, allowed or refused, to ``log`` (opened with
  ``O_NOFOLLOW | O_NONBLOCK`` and checked to be a regular file, so a symlink or a FIFO put
  there is refused at once instead of followed or waited on; fsync'd; if it cannot be
  written nothing runs) and a syslog line;
- exits 126 with one line ``dispatch: refused: REASON`` (and nothing on stdout) on any
  refusal, 124 with a last line ``dispatch: timeout: ...`` on timeout, else with the program's
  exit status; when that is 126 or 124 too, a last line says it is the action's own, so a
  client reading the last line never takes an action that ran for one refused or timed out
  (dispatch's lines after an action's always start a line: one the action left open is ended).

Config (TOML via tomllib on Python 3.11+, else JSON with the same structure)::

    root = "/srv/apps"                       # path arguments resolve beneath this
    log = "/var/log/bastion-gateway/dispatch.jsonl"
    projects = ["biscuit"]                   # values a "project" argument may take
    timeout_s = 300
    max_output_bytes = 1048576               # per stream
    [actions.deploy]
    argv = ["/usr/local/bin/deploy-app", "{project}", "{version}"]
    args = [{ name = "project", kind = "project" },
            { name = "version", pattern = "v[0-9]+[.][0-9]+[.][0-9]+" }]

A token of ``argv`` that is exactly ``{name}`` is replaced by that argument; nothing else
is substituted. An argument has a ``kind``: ``pattern`` (default; ``pattern`` is a regex
that must match the whole value), ``project`` (one of ``projects``) or ``path``. A
``project`` or ``path`` argument may have a ``pattern`` too; it must then match as well.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import selectors
import signal
import stat
import subprocess  # allowed in pyproject.toml (this script runs on the target host; spawning the action is its job)
import sys
import syslog
import time
from typing import Any, NoReturn

EXIT_REFUSED = 126
EXIT_TIMEOUT = 124
MAX_COMMAND_CHARS = 256
MAX_ARG_CHARS = 128
CLEAN_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
ARG_SHAPE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:@+=,/-]*")
VERB_SHAPE = re.compile(r"[a-z][a-z0-9_-]{0,31}")
KINDS = ("pattern", "project", "path")
CHUNK = 65536


class Refused(Exception):
    """A request this script will not run; the message is the one line the client sees."""


class Untrusted(Exception):
    """The config, or a folder above it, could have been changed by someone this script does not trust.

    `why` is the short reason the client sees; the message, with the path, goes to syslog only.
    """

    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"{where}: {why}")
        self.why = why


class Action:
    def __init__(self, name: str, argv: list[str], args: list[dict[str, str]]) -> None:
        self.name = name
        self.argv = argv
        self.args = args


class Config:
    def __init__(self, data: dict[str, Any]) -> None:
        known = {"root", "log", "projects", "timeout_s", "max_output_bytes", "actions"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r}")
        self.root = _text(data, "root")
        self.log = _text(data, "log")
        if not os.path.isabs(self.root) or not os.path.isabs(self.log):
            raise ValueError("root and log must be absolute paths")
        self.projects = [str(p) for p in data.get("projects", [])]
        for project in self.projects:
            if not ARG_SHAPE.fullmatch(project) or "/" in project:
                raise ValueError(f"project name {project!r} is not valid")
        self.timeout_s = float(data.get("timeout_s", 300))
        self.max_output_bytes = int(data.get("max_output_bytes", 1024 * 1024))
        if not 0 < self.timeout_s <= 86400 or not 0 < self.max_output_bytes <= 64 * 1024 * 1024:
            raise ValueError("timeout_s or max_output_bytes out of range")
        self.actions: dict[str, Action] = {}
        actions = data.get("actions", {})
        if not isinstance(actions, dict):
            raise ValueError("actions must be a table")
        for name, spec in actions.items():
            self.actions[name] = _action(name, spec)


def _text(data: dict[str, Any], key: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key} must be a non-empty string")
    return value


def _action(name: str, spec: Any) -> Action:
    if not VERB_SHAPE.fullmatch(name) or not isinstance(spec, dict):
        raise ValueError(f"action {name!r}: a lowercase name and a table")
    if set(spec) - {"argv", "args"}:
        raise ValueError(f"action {name!r}: only argv and args")
    argv = spec.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"action {name!r}: argv must be a list of strings")
    if not os.path.isabs(argv[0]):
        raise ValueError(f"action {name!r}: argv[0] must be an absolute path")
    args: list[dict[str, str]] = []
    for arg in spec.get("args", []):
        if not isinstance(arg, dict) or set(arg) - {"name", "kind", "pattern"}:
            raise ValueError(f"action {name!r}: an argument is a table of name, kind, pattern")
        kind = str(arg.get("kind", "pattern"))
        arg_name = str(arg.get("name", ""))
        if kind not in KINDS or not VERB_SHAPE.fullmatch(arg_name):
            raise ValueError(f"action {name!r}: argument {arg_name!r} has a bad name or kind")
        pattern = str(arg.get("pattern", ""))
        if kind == "pattern" and not pattern:
            raise ValueError(f"action {name!r}: argument {arg_name!r} needs a pattern")
        if pattern:
            re.compile(pattern)
        args.append({"name": arg_name, "kind": kind, "pattern": pattern})
    names = {arg["name"] for arg in args}
    for token in argv:
        if token.startswith("{") and token.endswith("}") and token[1:-1] not in names:
            raise ValueError(f"action {name!r}: argv names {token} but no such argument")
    return Action(name, argv, args)


def trusted_owners() -> set[int]:
    """Who may own the config and the folders above it: root, and this script's owner unless that is the SSH user.

    The script's owner could rewrite the script itself, so trusting it for the config adds no one.
    The SSH user (the uid this runs as) is never trusted unless it is root: an action, or any other
    process of that user, could then rewrite the policy.
    """
    owners = {0}
    script = globals().get("__file__")
    if isinstance(script, str):
        with contextlib.suppress(OSError):
            owner = os.stat(script).st_uid
            if owner not in (os.getuid(), os.geteuid()):
                owners.add(owner)
    return owners


def _check_trusted(info: os.stat_result, where: str, owners: set[int]) -> None:
    if info.st_uid not in owners:
        raise Untrusted(where, f"owned by uid {info.st_uid}, not by root")
    # In a sticky folder (/tmp) others may add entries but not rename or remove ours (unlink(2), EPERM).
    sticky = stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX
    if info.st_mode & 0o022 and not sticky:
        raise Untrusted(where, "writable by group or others")


def open_config(path: str) -> int:
    """Open the config for reading after checking that only trusted owners could have changed it.

    Walks from ``/`` one component at a time with ``O_NOFOLLOW`` and fstat()s each opened folder,
    then the file itself, so what is checked is what is read (no stat-then-open race). A symlink
    anywhere on the path is refused: the folder holding it would need checking too. The file is
    opened with ``O_NONBLOCK`` so a FIFO there is refused, not waited on.

    Raises:
        Untrusted: a component is a symlink, not a folder or regular file, owned by an untrusted
            user, or writable by group or others.
        OSError: a component does not exist or cannot be opened.
    """
    parts = path.split("/")[1:]
    if not path.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise Untrusted(path, "not a plain absolute path")
    owners = trusted_owners()
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    where = "/"
    try:
        for index, part in enumerate(parts):
            _check_trusted(os.fstat(fd), where, owners)
            where = os.path.join(where, part)
            last = index == len(parts) - 1
            flags = os.O_RDONLY | os.O_NONBLOCK if last else os.O_PATH | os.O_DIRECTORY
            try:
                child = os.open(part, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise Untrusted(where, "a symlink") from None
                if exc.errno == errno.ENOTDIR:
                    raise Untrusted(where, "a symlink or not a folder") from None
                raise
            os.close(fd)
            fd = child
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise Untrusted(where, "not a regular file")
        _check_trusted(info, where, owners)
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def load_config(path: str) -> Config:
    with os.fdopen(open_config(path), "rb") as handle:
        raw = handle.read()
    data: Any
    if path.endswith(".json"):
        data = json.loads(raw.decode("utf-8"))
    else:
        try:
            import tomllib
        except ImportError:  # Python < 3.11: the config must then be JSON
            data = json.loads(raw.decode("utf-8"))
        else:
            data = tomllib.loads(raw.decode("utf-8"))
    if not isinstance(data, dict):
        raise ValueError("the config must be a table")
    return Config(data)


def parse(command: str | None, config: Config) -> tuple[Action, list[str]]:
    """Split and check SSH_ORIGINAL_COMMAND. Returns the action and its raw argument values."""
    if not command:
        raise Refused("no command: interactive logins are not allowed")
    if len(command) > MAX_COMMAND_CHARS:
        raise Refused(f"command longer than {MAX_COMMAND_CHARS} characters")
    if any(not " " <= ch <= "~" for ch in command):
        raise Refused("command contains a control or non-ASCII character")
    words = command.split(" ")
    if any(not word for word in words):
        raise Refused("malformed command: words are separated by one space")
    verb, values = words[0], words[1:]
    action = config.actions.get(verb)
    if action is None:
        raise Refused(f"unknown action {verb[:32]!r}")
    if len(values) != len(action.args):
        raise Refused(f"{verb} takes {len(action.args)} argument(s), got {len(values)}")
    for spec, value in zip(action.args, values):  # noqa: B905 (strict= needs 3.10; lengths checked above)
        if len(value) > MAX_ARG_CHARS or not ARG_SHAPE.fullmatch(value):
            raise Refused(f"argument {spec['name']} is malformed")
        if spec["pattern"] and not re.fullmatch(spec["pattern"], value):
            raise Refused(f"argument {spec['name']} does not match its pattern")
        if spec["kind"] == "project" and value not in config.projects:
            raise Refused(f"project {value!r} is not allowed here")
    return action, values


def open_beneath(root: str, relative: str) -> int:
    """Open `relative` beneath `root`, one component at a time, never following a symlink.

    Returns an O_PATH descriptor. `..`, `.`, empty components, absolute paths and any symlink
    (at any depth) are refused, so the result is inside `root` whatever the tree looks like.
    """
    parts = relative.split("/")
    if relative.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise Refused("path argument must be relative, without '.', '..' or empty parts")
    flags = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise Refused(f"the gateway's root cannot be opened ({type(exc).__name__}): fix it on the host") from None
    try:
        for index, part in enumerate(parts):
            last = index == len(parts) - 1
            try:
                child = os.open(part, flags | (0 if last else os.O_DIRECTORY), dir_fd=fd)
            except OSError:
                raise Refused("path argument does not exist beneath the root, or is a symlink") from None
            os.close(fd)
            fd = child
        _check_path_argument(os.fstat(fd))
        return fd
    except BaseException:
        os.close(fd)
        raise


def _check_path_argument(info: os.stat_result) -> None:
    """Only a folder, or a plain file with one link, may be handed to an action.

    O_PATH opened the last component without opening the file itself, so a FIFO or device is
    judged here before the action reopens it through /dev/fd/N (where a FIFO would block it until
    the timeout). A second link may be a file from outside the root, linked in: its one name
    inside the root says nothing about where it belongs.
    """
    if stat.S_ISLNK(info.st_mode):  # O_PATH|O_NOFOLLOW opens a symlink itself: refuse it
        raise Refused("path argument is a symlink")
    if stat.S_ISDIR(info.st_mode):
        return
    if not stat.S_ISREG(info.st_mode):
        raise Refused("path argument is not a plain file or folder (a FIFO, socket or device)")
    if info.st_nlink != 1:
        raise Refused("path argument is a file with more than one link (a hard link)")


def build_argv(action: Action, values: list[str], config: Config) -> tuple[list[str], list[int]]:
    by_name: dict[str, str] = {}
    fds: list[int] = []
    for spec, value in zip(action.args, values):  # noqa: B905 (strict= needs 3.10; parse checked lengths)
        if spec["kind"] == "path":
            fd = open_beneath(config.root, value)
            os.set_inheritable(fd, True)
            fds.append(fd)
            by_name[spec["name"]] = f"/dev/fd/{fd}"
        else:
            by_name[spec["name"]] = value
    argv = [_substitute(token, by_name) for token in action.argv]
    return argv, fds


def _substitute(token: str, values: dict[str, str]) -> str:
    # Only a whole token "{name}" is replaced: no format strings, no partial expansion.
    if token.startswith("{") and token.endswith("}") and token[1:-1] in values:
        return values[token[1:-1]]
    return token


class Log:
    """The target-side audit trail: one fsync'd JSONL record per event, plus syslog."""

    def __init__(self, path: str) -> None:
        self.path = path
        # O_NONBLOCK: a FIFO put at the path fails with ENXIO (no reader) or opens at once (a
        # reader), instead of blocking open() with no timeout; fstat then refuses all but a file.
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        self.fd = os.open(path, flags, 0o600)
        try:
            if not stat.S_ISREG(os.fstat(self.fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file", path)
            os.set_blocking(self.fd, True)
        except BaseException:
            os.close(self.fd)
            raise

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=True, separators=(",", ":"), sort_keys=True) + "\n"
        data = line.encode("ascii")
        while data:
            written = os.write(self.fd, data)
            data = data[written:]
        os.fsync(self.fd)
        syslog.syslog(syslog.LOG_NOTICE, line.strip()[:900])


class Outcome:
    """How a run ended: the exit status, and whether it timed out, was cut, or lost its client."""

    def __init__(self) -> None:
        self.status = 0
        self.timed_out = False
        self.truncated = False
        self.client_gone = False
        self.err_mid_line = False
        """The action's stderr, as passed on, ends without a newline: dispatch's own line starts a new one."""


def run(argv: list[str], fds: list[int], config: Config) -> Outcome:
    """Run argv; stream stdout and stderr up to the cap, within the timeout."""
    process = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(CLEAN_ENV),
        cwd="/",
        close_fds=True,
        pass_fds=fds,
        start_new_session=True,
    )
    for fd in fds:
        os.close(fd)
    outcome = Outcome()
    deadline = time.monotonic() + config.timeout_s
    try:
        _pump(process, config, deadline, outcome)
        if outcome.timed_out:
            _kill_group(process.pid)
        try:
            status = process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill_group(process.pid)
            status = process.wait()
            outcome.timed_out = True
        outcome.status = 128 - status if status < 0 else status
    finally:
        # Anything the action left running in its session goes with it, whatever happened above.
        _kill_group(process.pid)
    return outcome


def _pump(process: subprocess.Popen[bytes], config: Config, deadline: float, outcome: Outcome) -> None:
    assert process.stdout is not None
    assert process.stderr is not None
    sinks = {process.stdout.fileno(): 1, process.stderr.fileno(): 2}
    sent = dict.fromkeys(sinks, 0)
    with selectors.DefaultSelector() as selector:
        for fd in sinks:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                outcome.timed_out = True
                return
            for key, _ in selector.select(left):
                chunk = os.read(key.fd, CHUNK)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                room = config.max_output_bytes - sent[key.fd]
                if len(chunk) > room:
                    outcome.truncated = True
                    chunk = chunk[: max(room, 0)]
                sent[key.fd] += len(chunk)
                if chunk and not outcome.client_gone:
                    # A client that went away does not stop the action halfway: it runs on, drained,
                    # under the same timeout, and its end is recorded.
                    outcome.client_gone = not _write_all(sinks[key.fd], chunk)
                    if sinks[key.fd] == 2:
                        outcome.err_mid_line = not chunk.endswith(b"\n")


def _write_all(fd: int, data: bytes) -> bool:
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:
        return False
    return True


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _say(line: str) -> None:
    """One line to the client on stderr; a client that is gone is not an error."""
    _write_all(2, (line + "\n").encode("ascii", "replace"))


def die(reason: str) -> NoReturn:
    _say(f"dispatch: refused: {reason}")
    sys.exit(EXIT_REFUSED)


def _config_path(argv: list[str]) -> str:
    if len(argv) != 3 or argv[1] != "--config":
        die("usage: dispatch.py --config PATH")
    return argv[2]


def _log_after_start(log: Log, record: dict[str, Any]) -> None:
    # The start record is on disk already; a failure now must not turn into a traceback.
    try:
        log.write(record)
    except OSError as exc:
        syslog.syslog(syslog.LOG_ERR, f"cannot write the {record['event']} record to {log.path}: {exc}")
        _say("dispatch: warning: the end of this request could not be logged on the host")


def main(argv: list[str]) -> int:
    syslog.openlog("bastion-dispatch", syslog.LOG_PID, syslog.LOG_AUTH)
    started = time.monotonic()
    try:
        config = load_config(_config_path(argv))
    except Untrusted as exc:
        syslog.syslog(syslog.LOG_ERR, f"config refused: {exc}")
        die(f"the gateway's config is not safe ({exc.why}): make it and its folders root's, group/other read-only")
    except (OSError, ValueError, re.error) as exc:
        syslog.syslog(syslog.LOG_ERR, f"config error: {exc}")
        die(f"the gateway's config is not valid ({type(exc).__name__}): fix it on the host")
    try:
        log = Log(config.log)
    except OSError as exc:
        syslog.syslog(syslog.LOG_ERR, f"cannot open log {config.log}: {exc}")
        die("the gateway's log cannot be written, so nothing runs: fix it on the host")
    command = os.environ.get("SSH_ORIGINAL_COMMAND")
    base: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "pid": os.getpid(),
        "client": (os.environ.get("SSH_CLIENT") or "").split(" ")[0],
        "request": None if command is None else command[:512],
    }
    try:
        action, values = parse(command, config)
        argv_run, fds = build_argv(action, values, config)
    except Refused as exc:
        try:
            log.write({**base, "event": "refused", "reason": str(exc)})
        finally:
            die(str(exc))
    try:
        log.write({**base, "event": "start", "action": action.name, "argv": argv_run})
    except OSError:
        die("the gateway's log cannot be written, so nothing runs: fix it on the host")
    try:
        outcome = run(argv_run, fds, config)
    except OSError as exc:
        failed = {"event": "failed", "action": action.name, "reason": f"{type(exc).__name__}: {exc}"}
        _log_after_start(log, {**base, **failed})
        die(f"the action's program could not start ({type(exc).__name__})")
    end = {"event": "end", "action": action.name, "exit_status": outcome.status, "timed_out": outcome.timed_out}
    end.update(truncated=outcome.truncated, client_gone=outcome.client_gone)
    _log_after_start(log, {**base, **end, "duration_ms": round((time.monotonic() - started) * 1000, 3)})
    if outcome.err_mid_line:
        _say("")  # dispatch's lines start lines of their own, never the end of one the action left open
    if outcome.truncated:
        _say(f"dispatch: output truncated at {config.max_output_bytes} bytes per stream")
    if outcome.timed_out:
        _say(f"dispatch: timeout: the action ran past {config.timeout_s:g} s and was killed")
        return EXIT_TIMEOUT
    if outcome.status in (EXIT_REFUSED, EXIT_TIMEOUT):
        # Last, where the client reads dispatch's verdict: whatever the action wrote came before it.
        _say(f"dispatch: the action ran and exited {outcome.status} itself")
    return outcome.status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
