"""Host workspaces: a real folder of the host, behind the jail and the command policy.

Wiring only: every decision is the safety core's (`CommandPolicy.check`,
`Jail`, `Redactor`); the kernel sandbox (`WarmSandbox`) is what makes an allowed
command harmless to the rest of the host.
"""

from __future__ import annotations

import base64
import codecs
import contextlib
import dataclasses
import hashlib
import itertools
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal

from bastion.config import Config, WorkspaceConfig
from bastion.safety.commands import CommandPolicy, Decision
from bastion.safety.errors import (
    BastionError,
    ConfigError,
    Conflict,
    InvalidRequest,
    NotFound,
    PolicyDenied,
    ResourceLimit,
    SandboxNotFound,
    Unavailable,
)
from bastion.safety.paths import MAX_READ_BYTES, MAX_SCAN_ENTRIES, Jail, privileged_file
from bastion.safety.redact import SLICE_CONTEXT_BYTES, Redactor, StreamRedactor, sanitize_terminal
from bastion.sandbox import (
    SANDBOX_PATH,
    SANDBOX_WORKSPACE,
    DeviceFolder,
    SandboxSpec,
    idmap_supported,
    idmapped_mount,
    is_mounted,
    unmount,
)
from bastion.sandbox.cgroups import CgroupLayout, Limits
from bastion.sandbox.identity import HostIdentity, IdentityPool
from bastion.sandbox.processes import BackgroundProcess, OutputLog
from bastion.sandbox.warm import RunOutcome, WarmSandbox

if TYPE_CHECKING:
    from bastion.workbench.manager import SandboxManager

logger = logging.getLogger("bastion.workspaces")

Encoding = Literal["utf-8", "base64"]
IDMAP_DIR: Final = "idmap"  # in state_dir: one idmapped mount per host workspace, while the server runs
LANG: Final = "C.UTF-8"

MAX_PROCESSES: Final = 16  # background processes per sandbox, running or exited (the oldest exited go first)
RING_BYTES: Final = 1 << 20  # raw output kept per stream of a background process
LOG_CHARS: Final = 1 << 20  # cleaned output kept per background process, both streams
MAX_INPUT_BYTES: Final = 65_536  # per send_process_input call
INPUT_TIMEOUT_S: Final = 5.0  # for the process to take its input
EXIT_OUTPUT_WAIT_S: Final = 1.0  # after an exit, for the last output to arrive
# An escape sequence (or CR of a CRLF) still open at the end of a chunk: held until more arrives,
# so the chunks are sanitized as the whole would be. Bounded: a longer tail is not held.
_UNFINISHED_ESCAPE: Final = re.compile(
    r"(?:\x1b\[[0-?]*[ -/]*|\x1b[ -/]*|\x9b[0-?]*[ -/]*"
    r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*\x1b?|\r)\Z"
)
_ESCAPE_HOLD_CHARS: Final = 4096


def decode_base64(text: str) -> bytes:
    """Standard base64 (line breaks and spaces allowed), or InvalidRequest."""
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except ValueError:
        raise InvalidRequest("content is not valid base64 (standard alphabet, with padding)") from None


@dataclass(frozen=True)
class CommandOutput:
    """The redacted, sanitized, capped result of one command."""

    argv: tuple[str, ...]
    cwd: str
    exit_status: int | None
    stdout: str
    stderr: str
    truncated: bool
    timed_out: bool
    oom_killed: bool
    memory_note: str = ""
    """On an OOM kill: how much of the memory files in /tmp and /dev/shm held."""


class OutputCleaner:
    """Cleans one output stream chunk by chunk as `HostWorkspace._clean` cleans a whole one.

    Bytes are decoded incrementally (a UTF-8 character may be split), escape sequences
    still open at the end are held, then terminal escapes are neutralised and the text
    goes through one `StreamRedactor`, which holds back what could be the start of a secret.
    """

    def __init__(self, redactor: Redactor) -> None:
        self._redactor = redactor
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stream: StreamRedactor = redactor.stream()
        self._pending = ""

    def reset(self) -> None:
        """Bytes were lost before cleaning: drop what is held (never flush half a secret) and start over."""
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stream = self._redactor.stream()
        self._pending = ""

    def feed(self, raw: bytes, *, final: bool = False) -> str:
        """Clean `raw`; with `final`, the stream ended: flush everything held."""
        text = self._pending + self._decoder.decode(raw, final=final)
        self._pending = ""
        if not final:
            tail = _UNFINISHED_ESCAPE.search(text, max(0, len(text) - _ESCAPE_HOLD_CHARS))
            if tail is not None:
                text, self._pending = text[: tail.start()], text[tail.start() :]
        safe = self._stream.feed(sanitize_terminal(text))
        if final:
            safe += self._stream.flush()
        return safe


@dataclass
class _Background:
    """A background process and the cleaning state of its output."""

    id: int
    process: BackgroundProcess
    argv: tuple[str, ...]  # redacted
    cleaners: tuple[OutputCleaner, OutputCleaner]
    log: OutputLog
    consumed: list[int] = field(default_factory=lambda: [0, 0])  # raw bytes cleaned, per stream
    dropped: list[int] = field(default_factory=lambda: [0, 0])  # raw bytes lost before cleaning
    flushed: list[bool] = field(default_factory=lambda: [False, False])

    @property
    def state(self) -> str:
        return "exited" if self.process.exited else "running"

    def summary(self) -> dict[str, object]:
        out, err = self.process.stdout, self.process.stderr
        return {
            "pid": self.id,
            "argv": list(self.argv),
            "state": self.state,
            "exit_status": self.process.status,
            "age_s": round(time.monotonic() - self.process.started, 3),
            "stdin_open": self.process.stdin_open,
            "output_bytes": out.total + err.total,
            "unread_bytes": out.total - max(out.start, self.consumed[0]) + err.total - max(err.start, self.consumed[1]),
            "dropped_bytes": self.dropped[0]
            + self.dropped[1]
            + max(0, out.start - self.consumed[0])
            + max(0, err.start - self.consumed[1]),
        }


class HostWorkspace:
    """One configured host folder: jail, policy and a warm kernel sandbox."""

    def __init__(
        self,
        config: WorkspaceConfig,
        redactor: Redactor,
        cgroups: CgroupLayout | None,
        *,
        via_sh: bool = False,
        sandbox: WarmSandbox | None = None,
        path_prefix: tuple[str, ...] = (),
        identity: HostIdentity | None = None,
        owner: tuple[int, int] | None = None,
        bind_source: str | None = None,
        unmount_on_close: bool = False,
        devices: str | None = None,
    ) -> None:
        """A workspace behind a warm sandbox.

        Args:
            via_sh: run commands as ``sh -c COMMAND`` (sandboxes, whose policy allows a shell)
                instead of parsing them into argv without one (host workspaces).
            sandbox: an already started sandbox over ``config.path`` (from a warm pool);
                its limits are set from ``config``.
            path_prefix: folders inside the sandbox searched before the system's (its Python environments).
            identity: the host uid and gid the sandbox runs as (`bastion.sandbox.identity`); None: the server's.
            owner: (uid, gid) the file tools give what they create: the folder's owner, or the identity.
            bind_source: what is bound at /workspace when it is not the folder itself (its idmapped mount).
            unmount_on_close: `bind_source` is a mount of the workspace's own, removed by `close`.
            devices: a folder of device nodes of its own (`_devices`); None: the host's.
        """
        self.config = config
        self.via_sh = via_sh
        self.id = config.id
        self._path = ":".join((*path_prefix, SANDBOX_PATH))
        self.extra_env: dict[str, str] = {}
        """Set by bastion itself (the egress proxy's address), never by an agent."""
        self.policy = CommandPolicy(config.policy)
        self.identity = identity
        self._bind_source = bind_source
        self._unmount_on_close = unmount_on_close
        self.jail = Jail(
            config.path, secret_patterns=config.secret_files, allow_hardlinks=config.allow_hardlinks, owner=owner
        )
        self.redactor = redactor
        limits = None
        if config.use_cgroups:
            lim = config.limits
            limits = Limits(memory_bytes=lim.memory_bytes, pids=lim.pids, cpu_cores=lim.cpu_cores)
        if sandbox is None:
            ids = None if identity is None or not identity.switch else (identity.uid, identity.gid)
            spec = SandboxSpec(workspace=bind_source or self.jail.root, identity=ids, devices=devices)
            sandbox = WarmSandbox(spec, cgroups=cgroups, limits=limits)
        elif limits is not None:
            sandbox.set_limits(limits)
        self.sandbox = sandbox
        self._processes: dict[int, _Background] = {}
        self._process_ids = itertools.count(1)
        self._folder = _held_folder(self.jail)
        self._replaced_logged = False

    def check_folder(self) -> None:
        """Refuse to serve a folder that was deleted or replaced since the server opened it.

        The jail, the idmapped mount and the warm sandbox all hold the folder the server opened;
        a folder re-created at the configured path is another inode they never see (empty
        listings, NOT_FOUND on writes). Compares the held folder with a fresh stat of the path.
        A point-in-time check: a replacement after it is seen at the next call.

        Raises:
            Unavailable: the path is gone or names another folder now.
        """
        try:
            info = os.stat(self.config.path)
        except OSError:
            now = "was deleted or renamed"
        else:
            if (info.st_dev, info.st_ino) == self._folder:
                self._replaced_logged = False  # put back: a later replacement is logged again
                return
            now = "was replaced by another folder"
        message = (
            f"workspace {self.id!r}: its folder {self.config.path} {now} while the server ran, and the server "
            "still holds the old one: restart the server to serve the folder now at that path"
        )
        if not self._replaced_logged:
            logger.error("%s", message)
            self._replaced_logged = True
        raise Unavailable(message)

    def environment(self) -> dict[str, str]:
        """Exactly PATH, HOME and LANG, plus the administrator's variables."""
        return {"PATH": self._path, "HOME": SANDBOX_WORKSPACE, "LANG": LANG, **self.config.env, **self.extra_env}

    def explain(self, command: str) -> Decision:
        decision = self.policy.explain_script(command) if self.via_sh else self.policy.explain(command)
        argv = self._redact_argv(decision.argv)
        return decision if argv == decision.argv else dataclasses.replace(decision, argv=argv)

    def _redact_argv(self, argv: tuple[str, ...]) -> tuple[str, ...]:
        # argv is echoed back to the client: a secret typed into a command is scrubbed like output.
        return tuple(self.redactor.redact(arg) for arg in argv)

    def sandbox_cwd(self, cwd: str | None) -> str:
        """Map a workspace-relative cwd to its path inside the sandbox, checked by the jail."""
        if cwd is None or cwd in ("", "."):
            return SANDBOX_WORKSPACE
        relative = self.jail.relative(cwd)
        fd = self.jail.open_dir_fd(relative)
        os.close(fd)
        return SANDBOX_WORKSPACE if relative in ("", ".") else f"{SANDBOX_WORKSPACE}/{relative}"

    async def run(self, command: str, *, cwd: str | None, timeout_s: float | None) -> CommandOutput:
        approved = self.policy.check_script(command) if self.via_sh else self.policy.check(command)
        sandbox_cwd = self.sandbox_cwd(cwd)
        limit = self.config.timeout_s if timeout_s is None else min(timeout_s, self.config.timeout_s)
        if limit <= 0:
            raise InvalidRequest("timeout_s must be positive")
        outcome = await self.sandbox.run(
            approved.executable,
            approved.argv,
            cwd=sandbox_cwd,
            env=self.environment(),
            timeout_s=limit,
            max_output_bytes=self.config.max_output_bytes,
        )
        return self._render(approved.argv, sandbox_cwd, outcome)

    async def run_argv(
        self, executable: str, argv: tuple[str, ...], *, timeout_s: float | None, ceiling_s: float | None = None
    ) -> CommandOutput:
        """Run a program bastion chose (an interpreter, an installer) in a sandbox that allows a shell.

        `ceiling_s` replaces the per-command time limit (installs take longer than commands).
        """
        if not self.via_sh:
            raise PolicyDenied("this workspace runs only commands its policy allows: use run_command")
        ceiling = self.config.timeout_s if ceiling_s is None else ceiling_s
        limit = ceiling if timeout_s is None else min(timeout_s, ceiling)
        if limit <= 0:
            raise InvalidRequest("timeout_s must be positive")
        outcome = await self.sandbox.run(
            executable,
            argv,
            cwd=SANDBOX_WORKSPACE,
            env=self.environment(),
            timeout_s=limit,
            max_output_bytes=self.config.max_output_bytes,
        )
        return self._render(argv, SANDBOX_WORKSPACE, outcome)

    def _render(self, argv: tuple[str, ...], cwd: str, outcome: RunOutcome) -> CommandOutput:
        stdout = self._clean(outcome.stdout, cut=outcome.stdout_total > len(outcome.stdout))
        stderr = self._clean(outcome.stderr, cut=outcome.stderr_total > len(outcome.stderr))
        return CommandOutput(
            argv=self._redact_argv(argv),
            cwd=cwd,
            exit_status=outcome.status,
            stdout=stdout,
            stderr=stderr,
            truncated=outcome.truncated,
            timed_out=outcome.timed_out,
            oom_killed=outcome.oom_killed,
            memory_note=outcome.memory_note,
        )

    def _clean(self, raw: bytes, *, cut: bool) -> str:
        """Neutralise terminal escapes, then redact, then (if the capture was cut) drop the held tail.

        Escapes go first so a secret split by one (``AKIA\\x1b[0m...``) is whole again
        when the redactor sees it. The stream redactor holds back any tail that could
        be the start of a secret; when the output was cut, that tail is dropped rather
        than flushed, so a cut never leaves half a secret behind.
        """
        text = sanitize_terminal(codecs.decode(raw, "utf-8", errors="replace"))
        stream = self.redactor.stream()
        safe = stream.feed(text)
        if not cut:
            safe += stream.flush()
        return safe

    def read_file(self, path: str, *, offset: int, length: int | None, encoding: Encoding) -> dict[str, object]:
        if offset < 0:
            raise InvalidRequest("offset must be zero or positive")
        want = MAX_READ_BYTES if length is None else length
        if want <= 0 or want > MAX_READ_BYTES:
            raise InvalidRequest(f"length must be between 1 and {MAX_READ_BYTES} bytes")
        if encoding == "base64":
            result = self.jail.read(path, offset=offset, length=want)
            content = base64.b64encode(result.data).decode("ascii")
        else:
            # Redacted with context on both sides: a secret the slice cuts is hidden as the whole file would hide it.
            result = self.jail.read(path, offset=offset, length=want, margin=SLICE_CONTEXT_BYTES)
            window = result.before + result.data + result.after
            content = self.redactor.redact_slice(window, len(result.before), len(result.before) + len(result.data))
        return {
            "path": result.path,
            "content": content,
            "encoding": encoding,
            "offset": offset,
            "bytes": len(result.data),
            "size": result.size,
            "eof": result.eof,
        }

    def write_file(self, path: str, content: str, *, encoding: Encoding, append: bool) -> dict[str, object]:
        data = decode_base64(content) if encoding == "base64" else content.encode("utf-8")
        result = self.jail.write(path, data, append=append, create_parents=True)
        return {"path": result.path, "bytes_written": result.bytes_written, "created": result.created}

    def upload_file(self, path: str, content_base64: str, *, overwrite: bool) -> dict[str, object]:
        """Create a file from base64 bytes; an existing one is replaced only with `overwrite`."""
        data = decode_base64(content_base64)
        result = self.jail.write(path, data, create_parents=True, exclusive=not overwrite)
        return {
            "path": result.path,
            "bytes_written": result.bytes_written,
            "created": result.created,
            "sha256": hashlib.sha256(data).hexdigest(),
        }

    def list_directory(self, path: str) -> dict[str, object]:
        entries = self.jail.list_dir(path)
        return {
            "path": self.jail.relative(path),
            "entries": [{"name": self._shown_name(e.name), "kind": e.kind, "size": e.size} for e in entries],
        }

    def _shown_name(self, name: str) -> str:
        # A file name is output too: cleaned and redacted as `ls` printing it would be.
        return self.redactor.redact(sanitize_terminal(name))

    # Background processes (sandboxes only): started by run_command(background=true).

    async def start_background(self, command: str, *, cwd: str | None) -> dict[str, object]:
        """Start `command` in the background; return its summary (pid is this sandbox's own number)."""
        if not self.via_sh:
            raise PolicyDenied("background processes are for sandboxes: create_sandbox, then run it there")
        approved = self.policy.check_script(command)
        sandbox_cwd = self.sandbox_cwd(cwd)
        self._make_room()
        process = await self.sandbox.spawn(
            approved.executable, approved.argv, cwd=sandbox_cwd, env=self.environment(), ring_bytes=RING_BYTES
        )
        record = _Background(
            id=next(self._process_ids),
            process=process,
            argv=self._redact_argv(approved.argv),
            cleaners=(OutputCleaner(self.redactor), OutputCleaner(self.redactor)),
            log=OutputLog(LOG_CHARS),
        )
        self._processes[record.id] = record
        return {**record.summary(), "cwd": sandbox_cwd}

    def _make_room(self) -> None:
        if len(self._processes) < MAX_PROCESSES:
            return
        exited = [pid for pid, record in self._processes.items() if record.process.exited]
        if not exited:
            raise ResourceLimit(f"{MAX_PROCESSES} background processes are running: kill_process one first")
        del self._processes[exited[0]]

    def _process(self, pid: int) -> _Background:
        record = self._processes.get(pid)
        if record is None:
            raise NotFound(f"no background process {pid} in {self.id}: see list_processes")
        return record

    def list_processes(self) -> list[dict[str, object]]:
        return [record.summary() for record in self._processes.values()]

    async def read_process(self, pid: int, *, since: int | None) -> dict[str, object]:
        """Cleaned output from offset `since` (default: the oldest kept), at most max_output_bytes characters."""
        record = self._process(pid)
        if since is not None and since > record.log.end:
            raise InvalidRequest(f"since={since} is past the end of the output ({record.log.end}): use detail.next")
        if record.process.exited:
            await record.process.wait_output(EXIT_OUTPUT_WAIT_S)
        cap = self.config.max_output_bytes
        self._clean_more(record, cap)
        start = record.log.start if since is None else since
        first, (stdout, stderr), following = record.log.read(start, cap)
        process = record.process
        unread_raw = process.stdout.total > record.consumed[0] or process.stderr.total > record.consumed[1]
        summary = record.summary()
        return {
            "pid": pid,
            "state": summary["state"],
            "exit_status": process.status,
            "stdout": stdout,
            "stderr": stderr,
            "since": first,
            "next": following,
            "more": following < record.log.end or unread_raw,
            "skipped_chars": first - start,
            "dropped_bytes": summary["dropped_bytes"],
        }

    def _clean_more(self, record: _Background, budget: int) -> None:
        """Clean at most `budget` more raw bytes of each stream into the log (a held tail stays held)."""
        process = record.process
        for stream, capture in enumerate((process.stdout, process.stderr)):
            if record.consumed[stream] < capture.start:
                # The ring dropped bytes nobody had read: they are lost, and so is what the cleaner held.
                record.dropped[stream] += capture.start - record.consumed[stream]
                record.consumed[stream] = capture.start
                record.cleaners[stream].reset()
            _, raw = capture.read(record.consumed[stream], budget)
            record.consumed[stream] += len(raw)
            final = capture.closed and record.consumed[stream] == capture.total and not record.flushed[stream]
            if raw or final:
                record.flushed[stream] = final
                record.log.append(stream, record.cleaners[stream].feed(raw, final=final))

    async def send_input(self, pid: int, data: str, *, eof: bool) -> dict[str, object]:
        """Write `data` to the process's stdin; with `eof`, close it afterwards."""
        record = self._process(pid)
        raw = data.encode("utf-8")
        if len(raw) > MAX_INPUT_BYTES:
            raise ResourceLimit(f"data is {len(raw)} bytes, over {MAX_INPUT_BYTES} per call: send it in parts")
        if record.process.exited:
            raise Conflict(f"process {pid} has exited (status {record.process.status}): it reads no more input")
        if self.sandbox.paused:
            raise Conflict("the sandbox is paused: resume it first")
        written = await record.process.write(raw, timeout_s=INPUT_TIMEOUT_S) if raw else 0
        if eof and written == len(raw):
            record.process.close_stdin()
        return {"pid": pid, "bytes": len(raw), "bytes_written": written, "eof": eof and written == len(raw)}

    async def kill_process(self, pid: int) -> dict[str, object]:
        """SIGKILL the process's PID 1: everything it started dies with its PID namespace."""
        record = self._process(pid)
        was_running = not record.process.exited
        await self.sandbox.kill(record.process)
        return {**record.summary(), "killed": was_running}

    def close(self) -> None:
        self.sandbox.close()
        self._processes.clear()
        self.jail.close()
        if self._unmount_on_close and self._bind_source is not None:
            # The sandbox's own copy of the mount dies with it; this is the host's.
            with contextlib.suppress(BastionError):
                unmount(self._bind_source)
            self._unmount_on_close = False


def _held_folder(jail: Jail) -> tuple[int, int]:
    """(st_dev, st_ino) of the folder the jail holds, opened beneath its own fd."""
    fd = jail.open_dir_fd(".")
    try:
        info = os.fstat(fd)
    finally:
        os.close(fd)
    return info.st_dev, info.st_ino


def _open_host(
    config: WorkspaceConfig,
    redactor: Redactor,
    cgroups: CgroupLayout | None,
    pool: IdentityPool,
    mounts: Path,
    device_folder: DeviceFolder | None,
) -> HostWorkspace:
    """A host workspace whose commands run as an id of its own and still make files that are the folder owner's.

    A root server binds the folder through an idmapped mount (`_idmap`): the workspace's own
    id acts as the folder's owner on disk, and as uid 1000 inside. Without idmapped mounts, a
    folder of an ordinary user is worked on as that user; a root-owned one is refused, since
    its commands would otherwise need root.

    Raises:
        ConfigError: this kernel or filesystem has no idmapped mounts and the folder is root's, or
            is owned by an id of the range (which a sandbox could be given too).
    """
    if not pool.switches:
        return HostWorkspace(config, redactor, cgroups)
    _refuse_privileged_files(config)
    info = os.stat(config.path)
    owner = (info.st_uid, info.st_gid)
    reason = idmap_supported(config.path)
    if reason is not None:
        if owner[0] == 0:
            raise ConfigError(
                f"workspace {config.id!r}: {config.path} is root's and idmapped mounts are unavailable ({reason}): "
                "chown it to an ordinary user, whose id its commands will then run as"
            )
        first, count = pool.range
        if first <= owner[0] < first + count:
            raise ConfigError(
                f"workspace {config.id!r}: {config.path} is owned by uid {owner[0]}, inside host_id_range, and "
                f"idmapped mounts are unavailable ({reason}): chown it to an ordinary user"
            )
        logger.warning("workspace %s runs as its folder's owner, uid %d: %s", config.id, owner[0], reason)
        identity = HostIdentity(owner[0], owner[1], switch=True)
        devices = device_folder.make(f"ws-{config.id}", owner) if device_folder is not None else None
        return HostWorkspace(config, redactor, cgroups, identity=identity, owner=owner, devices=devices)
    identity = pool.acquire()
    target = mounts / config.id
    try:
        devices = device_folder.make(f"ws-{config.id}", (identity.uid, identity.gid)) if device_folder else None
        target.mkdir(mode=0o700, exist_ok=True)
        if is_mounted(target):
            unmount(target)  # a crashed server's
        idmapped_mount(config.path, target, owner=owner, identity=(identity.uid, identity.gid))
        return HostWorkspace(
            config,
            redactor,
            cgroups,
            identity=identity,
            owner=owner,
            bind_source=str(target),
            unmount_on_close=True,
            devices=devices,
        )
    except BaseException:
        pool.release(identity)
        raise


def _refuse_privileged_files(config: WorkspaceConfig) -> None:
    """A setuid, setgid or capability-carrying file in a root server's host workspace stops the start.

    Its commands act as the folder's owner on disk: one could rewrite such a file through a
    shared mapping, which keeps the bit (see `privileged_file`).

    Raises:
        ConfigError: one is there.
    """
    found, cut = privileged_file(config.path)
    if found is not None:
        raise ConfigError(
            f"workspace {config.id!r}: {config.path / found} runs with privileges (setuid, setgid or file "
            "capabilities), and a command could rewrite it keeping them: remove them (chmod u-s,g-s; "
            "setcap -r) or move the file out of the workspace"
        )
    if cut:
        logger.warning(
            "workspace %s: over %d entries, not all checked for setuid or setgid files", config.id, MAX_SCAN_ENTRIES
        )


def _drop_stale_mounts(mounts: Path) -> None:
    """Unmount and remove what a crashed server left in `mounts` (its workspaces' idmapped mounts)."""
    if not mounts.is_dir() or mounts.is_symlink():
        return
    for entry in mounts.iterdir():
        try:
            if is_mounted(entry):
                unmount(entry)
            entry.rmdir()
        except (BastionError, OSError) as exc:
            reason = exc.reason if isinstance(exc, BastionError) else str(exc)
            logger.warning("a previous server's mount %s is left: %s", entry, reason)


class WorkspaceRegistry:
    """Where a work tool acts: a configured host workspace, or an agent's sandbox, by id."""

    def __init__(
        self,
        config: Config,
        redactor: Redactor,
        cgroups: CgroupLayout | None,
        identities: IdentityPool | None = None,
        devices: DeviceFolder | None = None,
    ) -> None:
        self._default = config.default_workspace
        pool = identities or IdentityPool(*config.sandboxes.host_ids)
        mounts = config.state_dir / IDMAP_DIR
        if pool.switches:
            _drop_stale_mounts(mounts)
        if pool.switches and config.workspace:
            mounts.mkdir(mode=0o711, exist_ok=True)
            os.chmod(mounts, 0o711)  # noqa: S103 - passable, not listable: by the workspaces' own ids
        self._workspaces: dict[str, HostWorkspace] = {}
        try:
            for ws in config.workspace:
                self._workspaces[ws.id] = _open_host(ws, redactor, cgroups, pool, mounts, devices)
        except BaseException:
            self.close()
            raise
        self.sandboxes: SandboxManager | None = None

    def is_host(self, workspace_id: str) -> bool:
        return workspace_id in self._workspaces

    def get_id(self, workspace_id: str | None) -> str:
        """The id a call is about, for the audit record (not checked here)."""
        return workspace_id or self._default

    def get(self, workspace_id: str | None) -> HostWorkspace:
        key = workspace_id or self._default
        host = self._workspaces.get(key)
        if host is not None:
            host.check_folder()
            return host
        if self.sandboxes is not None and self.sandboxes.owns(key):
            return self.sandboxes.get(key).workspace
        raise SandboxNotFound(f"no workspace or sandbox named {key!r}: see list_sandboxes or the config")

    def close(self) -> None:
        for ws in self._workspaces.values():
            ws.close()
