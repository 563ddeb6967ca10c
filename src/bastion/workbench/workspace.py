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
import functools
import hashlib
import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

import anyio

from bastion.config import Config, WorkspaceConfig
from bastion.safety.commands import ApprovedCommand, CommandPolicy, Decision
from bastion.safety.environment import no_shell_escape_env
from bastion.safety.errors import (
    BastionError,
    ConfigError,
    Forbidden,
    InvalidRequest,
    PolicyDenied,
    ResourceLimit,
    Unavailable,
)
from bastion.safety.output import clean_output
from bastion.safety.paths import (
    MAX_PRIVILEGED_NAMED,
    MAX_READ_BYTES,
    MAX_SCAN_ENTRIES,
    Jail,
    open_real_folder,
    privileged_files,
    replaceable_by,
    writers_besides,
)
from bastion.safety.redact import SLICE_CONTEXT_BYTES, Redactor, sanitize_name
from bastion.safety.search import search_pattern
from bastion.safety.trees import MAX_WALK_DEPTH
from bastion.sandbox import (
    SANDBOX_NODE_OPTIONS,
    SANDBOX_PATH,
    SANDBOX_WORKSPACE,
    DeviceFolder,
    SandboxSpec,
    idmap_supported,
    idmapped_mount,
    is_mounted,
    unmount,
)
from bastion.sandbox.backend import RunOutcome, Sandbox
from bastion.sandbox.cgroups import CgroupLayout, Limits
from bastion.sandbox.identity import HostIdentity, IdentityPool
from bastion.sandbox.processes import OutputSink
from bastion.sandbox.warm import BubblewrapBackend
from bastion.workbench.background import RING_BYTES, BackgroundProcesses
from bastion.workbench.edit import edit_text
from bastion.workbench.media import MAX_IMAGE_BYTES, Image, image_type
from bastion.workbench.repository import GIT, Protection, repository_protection
from bastion.workbench.search import search_tree
from bastion.workbench.terminals import TERM, Terminals
from bastion.workbench.workers import INLINE_CLEAN_CHARS, InThread, any_thread

logger = logging.getLogger("bastion.workspaces")
MAX_SHOWN_NAME_CHARS: Final = 160
"""Of a file's path in the workspace, in a refusal at start (`_shown_name`): its end."""

Encoding = Literal["utf-8", "base64"]
IDMAP_DIR: Final = "idmap"  # in state_dir: one folder per host workspace, holding its idmapped mount
IDMAP_MOUNT: Final = "root"  # in idmap/<id>: the mount point, while the server runs
LANG: Final = "C.UTF-8"
PROTECTED_REASON: Final = (
    "is the repository's, whose hooks and config the folder's owner runs with git: read-only to agents "
    "in this workspace (protect_git); use git commands, or ask the administrator"
)
SYSTEM_PYTHON: Final = "/usr/bin/python3"
OWN_VENV: Final = f"{SANDBOX_WORKSPACE}/.venv"  # a sandbox's own environment (install_package)


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


MAX_UNDECODABLE_BYTES: Final = 32
"""A page with more bytes than this that are not UTF-8 (or with a NUL) is binary: read_file refuses it as text
and says to use base64, instead of answering with a page of U+FFFD."""
INLINE_READ_BYTES: Final = 8 * 1024
"""A file up to this size is read and redacted on the event loop (`is_small_file`): ~0.1 ms of work,
less than the two thread wake-ups a hop costs on a busy machine. Secret-dense text redacts at ~0.8 s
per MiB, so the worst inline stall stays near Python's 5 ms thread switch interval."""
MAX_ESCAPED_READ_BYTES: Final = MAX_READ_BYTES * 3 // 2
"""What a read's text may take once escaped for JSON: a text file's newlines and tabs cost it a few percent."""
_TWO_BYTE_ESCAPES: Final = b'\b\f\n\r\t"\\'
_SIX_BYTE_ESCAPES: Final = bytes(c for c in range(0x20) if c not in b"\b\f\n\r\t")


def _escaped_size(data: bytes) -> int:
    """The length of `data`'s text as a JSON string (its UTF-8 bytes, and what each escape adds)."""
    short = len(data) - len(data.translate(None, _TWO_BYTE_ESCAPES))
    long = len(data) - len(data.translate(None, _SIX_BYTE_ESCAPES))
    return len(data) + short + 5 * long


_SIGNATURES: Final = (
    (b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"GIF8", "a GIF image"),
    (b"%PDF-", "a PDF document"),
    (b"PK\x03\x04", "a zip archive"),
    (b"\x7fELF", "an ELF program"),
    (b"\x1f\x8b", "gzip data"),
)


def undecodable_bytes(data: bytes, *, cut_before: bool, cut_after: bool) -> int:
    """How many bytes of a page are not UTF-8 (counting stops past the limit), not counting a character
    the page's edges cut: up to three continuation bytes at a start inside the file, an unfinished one at
    an end before the file's."""
    start = 0
    while cut_before and start < min(3, len(data)) and data[start] & 0xC0 == 0x80:
        start += 1
    bad, view = 0, data[start:]
    while bad <= MAX_UNDECODABLE_BYTES:
        try:
            codecs.utf_8_decode(view, "strict", not cut_after)
            return bad
        except UnicodeDecodeError as exc:
            bad += exc.end - exc.start
            view = view[exc.end :]
    return bad


def _kind_of(data: bytes, offset: int) -> str:
    if offset == 0:
        for signature, kind in _SIGNATURES:
            if data.startswith(signature):
                return kind
        if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            return "a WebP image"
    return "binary data"


class HostWorkspace:
    """One configured host folder: jail, policy and a warm kernel sandbox."""

    def __init__(
        self,
        config: WorkspaceConfig,
        redactor: Redactor,
        cgroups: CgroupLayout | None,
        *,
        via_sh: bool = False,
        sandboxed: bool = False,
        sandbox: Sandbox | None = None,
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
            sandboxed: an agent's sandbox (`SandboxManager`), not a host workspace of the administrator.
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
        self._sandboxed = sandboxed
        self.id = config.id
        self._path = ":".join((*path_prefix, SANDBOX_PATH))
        self.extra_env: dict[str, str] = {}
        """Set by bastion itself (the egress proxy's address), never by an agent."""
        self.policy = CommandPolicy(config.policy)
        # An agent's sandbox is its own box with a shell: its editors and pagers are its to use.
        self._quiet_env = {} if sandboxed else no_shell_escape_env(config.env)
        self.identity = identity
        self._bind_source = bind_source
        self._unmount_on_close = unmount_on_close
        # The folder owner's git runs what the repository names: an agent's program, were it writable.
        guarded = config.protect_git and not sandboxed
        self._repository = repository_protection(str(config.path), config.id) if guarded else Protection()
        # A sandbox's file tools see paths as its commands do: /workspace/x is x (`Jail` view_root).
        self.jail = Jail(
            config.path,
            secret_patterns=config.secret_files,
            allow_hardlinks=config.allow_hardlinks,
            owner=owner,
            view_root=SANDBOX_WORKSPACE if sandboxed else None,
            act_as_owner=not sandboxed,
            protected_names=dict.fromkeys((GIT,) if guarded else (), PROTECTED_REASON),
            protected_paths=dict.fromkeys(self._repository.paths, PROTECTED_REASON),
        )
        self.redactor = redactor
        try:
            limits = None
            if config.use_cgroups:
                lim = config.limits
                limits = Limits(memory_bytes=lim.memory_bytes, pids=lim.pids, cpu_cores=lim.cpu_cores)
            if sandbox is None:
                ids = None if identity is None or not identity.switch else (identity.uid, identity.gid)
                spec = SandboxSpec(
                    workspace=bind_source or self.jail.root,
                    identity=ids,
                    devices=devices,
                    host_folder=not sandboxed,
                    read_only_paths=self._repository.read_only,
                    sealed_paths=self._repository.sealed,
                )
                sandbox = BubblewrapBackend(cgroups).sandbox(spec, limits=limits)
            elif limits is not None:
                sandbox.set_limits(limits)
            self.sandbox = sandbox
            self.processes = BackgroundProcesses(self.id, redactor, sandbox, config.max_output_bytes)
            self.terminals = Terminals(self.id, redactor, sandbox, config.terminals)
            self._folder = _held_folder(self.jail)
        except BaseException:
            self.jail.close()  # its fd would hold the folder (a sandbox's disk: its mount and loop device)
            raise
        self._replaced_logged = False

    @property
    def folder_id(self) -> tuple[int, int]:
        """(st_dev, st_ino) of the folder its jail holds."""
        return self._folder

    @property
    def is_sandbox(self) -> bool:
        """Whether this is an agent's sandbox: the one place that decides it."""
        return self._sandboxed

    def require_sandbox(self, what: str) -> None:
        """Refuse `what` (an operation for sandboxes only) on a host workspace.

        FORBIDDEN, not POLICY_DENIED: a host workspace is the administrator's, and no rule,
        config change of the agent's or approval makes it run code, background processes or
        installs, or lets an agent pause or close it: it is not this caller's to do (`errors`).
        POLICY_DENIED stays for what a policy decides (a template's command policy, a limit
        above the ceiling), which the administrator could decide otherwise.

        Raises:
            Forbidden: this is a host workspace.
        """
        if not self._sandboxed:
            raise Forbidden(
                f"{what}: for sandboxes only, and {self.id!r} is a host workspace of the administrator: "
                "create_sandbox, then pass its sandbox_id"
            )

    def require_shell(self, what: str) -> None:
        """Refuse `what` unless this is a sandbox whose policy allows a shell (no template policy).

        Raises:
            Forbidden: this is a host workspace (`require_sandbox`).
            PolicyDenied: the sandbox's template has a command policy.
        """
        self.require_sandbox(what)
        if not self.via_sh:
            raise PolicyDenied(f"{what}: this sandbox's template has a command policy: use run_command")

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
            info = _stat_folder(str(self.config.path))
        except BastionError:
            now = "was deleted or renamed, or a component of its path replaced by a link"
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
        """PATH, HOME, LANG and NODE_OPTIONS (node's network-interface shim: `_spawn.SANDBOX_NODE_OPTIONS`);
        in a host workspace, editors that refuse and pagers that only print (`no_shell_escape_env`); then
        the administrator's variables."""
        fixed = {"PATH": self._path, "HOME": SANDBOX_WORKSPACE, "LANG": LANG, "NODE_OPTIONS": SANDBOX_NODE_OPTIONS}
        return {**fixed, **self._quiet_env, **self.config.env, **self.extra_env}

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

    async def _checked_cwd(self, cwd: str | None) -> str:
        """`sandbox_cwd`; in a sandbox in a worker thread (its links are the jail's to resolve: see
        `is_small_file`)."""
        if cwd is None or cwd in ("", ".") or not self.is_sandbox:
            return self.sandbox_cwd(cwd)
        return await anyio.to_thread.run_sync(self.sandbox_cwd, cwd)

    async def run(
        self, command: str, *, cwd: str | None, timeout_s: float | None, in_thread: InThread = any_thread
    ) -> CommandOutput:
        """Run `command` to its end; large output is cleaned by `in_thread` (the calling tool's thread shares)."""
        approved = self.policy.check_script(command) if self.via_sh else self.policy.check(command)
        sandbox_cwd = await self._checked_cwd(cwd)
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
        return await self._rendered(approved.argv, sandbox_cwd, outcome, in_thread)

    async def run_argv(
        self,
        executable: str,
        argv: tuple[str, ...],
        *,
        timeout_s: float | None,
        ceiling_s: float | None = None,
        on_output: tuple[OutputSink, OutputSink] | None = None,
        env: Mapping[str, str] | None = None,
        in_thread: InThread = any_thread,
    ) -> CommandOutput:
        """Run a program bastion chose (an interpreter, an installer) in a sandbox that allows a shell.

        `ceiling_s` replaces the per-command time limit (installs take longer than commands);
        `on_output` sees the raw output as it comes (a progress reporter cleans and redacts it);
        `env` adds to `environment()` for this program alone (what must stay off its command line);
        large output is cleaned by `in_thread`.
        """
        self.require_shell("programs bastion chooses (interpreters, installers)")
        ceiling = self.config.timeout_s if ceiling_s is None else ceiling_s
        limit = ceiling if timeout_s is None else min(timeout_s, ceiling)
        if limit <= 0:
            raise InvalidRequest("timeout_s must be positive")
        outcome = await self.sandbox.run(
            executable,
            argv,
            cwd=SANDBOX_WORKSPACE,
            env={**self.environment(), **(env or {})},
            timeout_s=limit,
            max_output_bytes=self.config.max_output_bytes,
            on_output=on_output,
        )
        return await self._rendered(argv, SANDBOX_WORKSPACE, outcome, in_thread)

    async def _rendered(
        self, argv: tuple[str, ...], cwd: str, outcome: RunOutcome, in_thread: InThread
    ) -> CommandOutput:
        """`_render`, by `in_thread` for output over `INLINE_CLEAN_CHARS`: found by attack, a command's 64 KiB of
        `key=` lines took 40 to 70 ms of the event loop to clean, and `max_output_bytes` goes up to 16 MiB."""
        if len(outcome.stdout) + len(outcome.stderr) <= INLINE_CLEAN_CHARS:
            return self._render(argv, cwd, outcome)
        return await in_thread(functools.partial(self._render, argv, cwd, outcome))

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
        return clean_output(self.redactor, raw, cut=cut)

    def is_small_file(self, path: str) -> bool:
        """Whether `path` names a regular file of at most `INLINE_READ_BYTES` right now.

        A point-in-time guess for where to do the work, never a check: the read checks everything
        again (a file grown meanwhile is only read more slowly). Any refusal says False. In a sandbox,
        False: the jail resolves the sandbox's links itself, up to thousands of lookups for a path the
        sandbox made deep (milliseconds a call), so the read goes to a worker thread.
        """
        if self.is_sandbox:
            return False
        try:
            info = self.jail.stat(path)
        except (BastionError, OSError):
            return False
        return stat.S_ISREG(info.st_mode) and info.st_size <= INLINE_READ_BYTES

    def read_file(self, path: str, *, offset: int, length: int | None, encoding: Encoding) -> dict[str, object]:
        if offset < 0:
            raise InvalidRequest("offset must be zero or positive")
        want = MAX_READ_BYTES if length is None else length
        if want <= 0 or want > MAX_READ_BYTES:
            raise InvalidRequest(f"length must be between 1 and {MAX_READ_BYTES} bytes")
        undecodable = 0
        if encoding == "base64":
            result = self.jail.read(path, offset=offset, length=want)
            content = base64.b64encode(result.data).decode("ascii")
        else:
            # Redacted with context on both sides: a secret the slice cuts is hidden as the whole file would hide it.
            result = self.jail.read(path, offset=offset, length=want, margin=SLICE_CONTEXT_BYTES)
            while (escaped := _escaped_size(result.data)) > MAX_ESCAPED_READ_BYTES and len(result.data) > 1:
                # Control characters are text, but six bytes each in JSON, and the answer carries the content
                # twice: 1 MiB of them made a 13.6 MiB answer, ~42 MiB of the server's while a client did not
                # read it. The read stops earlier instead (it says where: `bytes`, `eof`).
                want = max(1, len(result.data) * MAX_ESCAPED_READ_BYTES // escaped)
                result = self.jail.read(path, offset=offset, length=want, margin=SLICE_CONTEXT_BYTES)
            undecodable = undecodable_bytes(result.data, cut_before=offset > 0, cut_after=not result.eof)
            if undecodable > MAX_UNDECODABLE_BYTES or b"\0" in result.data:
                raise InvalidRequest(
                    f"{result.path} is not UTF-8 text ({_kind_of(result.data, offset)}): read it with encoding='base64'"
                    + (", or as_image=true to see it" if offset == 0 and image_type(result.data) else "")
                )
            window = result.before + result.data + result.after
            content = self.redactor.redact_slice(window, len(result.before), len(result.before) + len(result.data))
        detail: dict[str, object] = {
            "path": result.path,
            "content": content,
            "encoding": encoding,
            "offset": offset,
            "bytes": len(result.data),
            "size": result.size,
            "eof": result.eof,
        }
        if undecodable:
            detail["note"] = f"{undecodable} bytes are not UTF-8 and show as U+FFFD: encoding='base64' gives them exact"
        return detail

    def read_image(self, path: str) -> Image:
        """A PNG, JPEG, GIF or WebP file, its type told by its first bytes (never by its name).

        Raises:
            ResourceLimit: over `MAX_IMAGE_BYTES`.
            InvalidRequest: not one of those image types.
        """
        result = self.jail.read(path, length=MAX_IMAGE_BYTES)
        if not result.eof:
            raise ResourceLimit(
                f"{result.path} is {result.size} bytes, over the {MAX_IMAGE_BYTES} byte limit for images: "
                "make it smaller (e.g. with PIL in execute_code) or read it with encoding='base64' in pages"
            )
        mime = image_type(result.data)
        if mime is None:
            raise InvalidRequest(
                f"{result.path} is not a PNG, JPEG, GIF or WebP image ({_kind_of(result.data, 0)}): "
                "read it without as_image"
            )
        return Image(path=result.path, mime_type=mime, data=result.data)

    def search_files(
        self, pattern: str, *, path: str, glob: str | None, regex: bool, max_results: int
    ) -> dict[str, object]:
        checked = search_pattern(pattern, regex=regex)
        return search_tree(self.jail, self.redactor, checked, path=path, glob=glob, max_results=max_results)

    def edit_file(self, path: str, old: str, new: str, *, replace_all: bool, dry_run: bool) -> dict[str, object]:
        return edit_text(self.jail, self.redactor, path, old, new, replace_all=replace_all, dry_run=dry_run)

    def write_file(self, path: str, content: str, *, encoding: Encoding, append: bool) -> dict[str, object]:
        # A lone surrogate ("\ud800") never gets here: the tool decorator refuses it in any argument.
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
        # Escaped, not cleaned as output is: a name with an escape sequence in it must not read as another's.
        return self.redactor.redact(sanitize_name(name))

    # Background processes (sandboxes only): started by run_command(background=true).

    async def start_background(self, command: str, *, cwd: str | None) -> dict[str, object]:
        """Start `command` in the background; return its summary (pid is this sandbox's own number)."""
        self.require_shell("background processes")
        approved = self.policy.check_script(command)
        sandbox_cwd = await self._checked_cwd(cwd)
        with self.processes.reserved() as forgotten:
            process = await self.sandbox.spawn(
                approved.executable, approved.argv, cwd=sandbox_cwd, env=self.environment(), ring_bytes=RING_BYTES
            )
            record = self.processes.add(process, self._redact_argv(approved.argv))
        return {**record.summary(), "cwd": sandbox_cwd, **forgotten}

    async def list_processes(self, in_thread: InThread = any_thread) -> list[dict[str, object]]:
        """Background processes, then what commands left running (their command lines cleaned by `in_thread`
        when long)."""
        return [*self.processes.summaries(), *await self.processes.leftovers(in_thread)]

    async def read_process(self, pid: int, *, since: int | None, in_thread: InThread = any_thread) -> dict[str, object]:
        """Cleaned output from offset `since` (see `BackgroundProcesses.read`)."""
        return await self.processes.read(pid, since=since, in_thread=in_thread)

    async def send_input(self, pid: int, data: str, *, eof: bool) -> dict[str, object]:
        """Write `data` to the process's stdin; with `eof`, close it afterwards."""
        return await self.processes.send_input(pid, data, eof=eof)

    async def kill_process(self, pid: int | None, *, os_pid: int | None = None) -> dict[str, object]:
        """Kill a background process and everything it started (`pid`), or one process a
        command left running (`os_pid`, its pid in the sandbox).

        Raises:
            InvalidRequest: neither or both given.
            NotFound: no such process in this sandbox.
        """
        if (pid is None) == (os_pid is None):
            raise InvalidRequest("give either pid (a background process) or os_pid (a process a command left running)")
        if os_pid is not None:
            return await self.processes.kill_leftover(os_pid)
        assert pid is not None
        return await self.processes.kill(pid)

    # Terminals: a program on a pseudo-terminal (`Terminals`).

    async def open_terminal(self, command: str | None, *, rows: int, cols: int) -> dict[str, object]:
        """Start `command` on a terminal: in a sandbox whose policy allows a shell, any shell command
        (default: bash, else sh); elsewhere only a command the policy allows, run without a shell.

        Raises:
            Forbidden: a host workspace whose policy does not allow `command` (or none given).
            PolicyDenied: a sandbox whose template's policy does not allow it.
        """
        if self.via_sh:
            approved = self.policy.check_script(command or _default_shell())
        else:
            approved = self._terminal_command(command)
        return await self.terminals.open(
            approved.executable,
            approved.argv,
            self._redact_argv(approved.argv),
            cwd=SANDBOX_WORKSPACE,
            env={**self.environment(), "TERM": TERM},
            rows=rows,
            cols=cols,
        )

    def _terminal_command(self, command: str | None) -> ApprovedCommand:
        """The one command a terminal of a policy-bound workspace may run: one the policy allows."""
        if not command:
            what = "a sandbox with a command policy" if self._sandboxed else "a host workspace"
            raise InvalidRequest(f"{self.id!r} is {what}: give the command to run (its policy must allow it)")
        try:
            return self.policy.check(command)
        except PolicyDenied as exc:
            if self._sandboxed:
                raise
            # Not this caller's to change: the administrator's folder opens terminals for allowed commands only.
            raise Forbidden(
                f"open_terminal in host workspace {self.id!r}: {exc.reason}; only a command its policy allows "
                "runs on a terminal here"
            ) from None

    def close(self) -> None:
        self.sandbox.close()
        self.terminals.close_all()
        self.processes.clear()
        self.jail.close()
        if self._unmount_on_close and self._bind_source is not None:
            # The sandbox's own copy of the mount dies with it; this is the host's.
            with contextlib.suppress(BastionError):
                unmount(self._bind_source)
            self._unmount_on_close = False


def _default_shell() -> str:
    """bash if the system has it (sandboxes see the host's /usr), else sh."""
    return "bash" if os.path.exists("/bin/bash") else "sh"


def _stat_folder(path: str) -> os.stat_result:
    """The status of the folder at `path`, which no symlink may lead to (`open_real_folder`)."""
    fd = open_real_folder(path, what="the workspace folder")
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


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
            is owned by an id of the range (which a sandbox could be given too); or users besides root
            and its owner may write or replace it, or it holds a setuid, setgid or capability file.
    """
    if not pool.switches:
        return HostWorkspace(config, redactor, cgroups)
    info = _stat_folder(str(config.path))
    owner = (info.st_uid, info.st_gid)
    _refuse_unsafe_folder(config, owner)
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
        workspace = HostWorkspace(config, redactor, cgroups, identity=identity, owner=owner, devices=devices)
        _require_same_folder(workspace, info, None)
        return workspace
    identity = pool.acquire()
    target = mounts / config.id / IDMAP_MOUNT
    try:
        devices = device_folder.make(f"ws-{config.id}", (identity.uid, identity.gid)) if device_folder else None
        _make_passable_only_by(target.parent, identity.gid)
        target.mkdir(mode=0o700, exist_ok=True)
        if is_mounted(target):
            unmount(target)  # a crashed server's
        idmapped_mount(config.path, target, owner=owner, identity=(identity.uid, identity.gid))
        workspace = HostWorkspace(
            config,
            redactor,
            cgroups,
            identity=identity,
            owner=owner,
            bind_source=str(target),
            unmount_on_close=True,
            devices=devices,
        )
        _require_same_folder(workspace, info, target)
    except BaseException:
        try:
            if is_mounted(target):
                unmount(target)  # a workspace that failed to open after its mount was made
        finally:
            pool.release(identity)
        raise
    return workspace


def _make_passable_only_by(folder: Path, gid: int) -> None:
    """Make `folder` root's, mode 0710, group `gid`: only the workspace's own id passes to its mount.

    The mount's root shows the workspace folder's own mode (often 0755), and the folders above it in
    a private home (0700) are not on this path: a local user who could pass `folder` read the workspace
    through the state folder. bwrap binds the mount as the workspace's id, so that id must pass. A group,
    not an ACL (as `DeviceFolder` gives its folders): `gid` is of host_id_range, which no account holds
    (`identity`), and the state folder's filesystem may have no ACLs.
    """
    folder.mkdir(mode=0o700, exist_ok=True)
    if is_mounted(folder):  # an older server's mount that `_drop_stale_mounts` could not remove: not ours to chown
        raise Unavailable(f"{folder} is still a mount point: unmount it (umount -l) and start again")
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchown(fd, 0, gid)
        os.fchmod(fd, 0o710)
    finally:
        os.close(fd)


def host_workspace_problem(config: WorkspaceConfig) -> str | None:
    """Why a root server would refuse to open this host workspace at start, or None (for `bastion doctor`:
    found by attack, it said "no FAIL" of a workspace holding a setuid-root file that an older bastion's
    agent had left, which the server then refused to start on)."""
    try:
        info = _stat_folder(str(config.path))
        _refuse_unsafe_folder(config, (info.st_uid, info.st_gid))
    except ConfigError as exc:
        return str(exc)
    except BastionError as exc:
        return exc.reason
    except OSError as exc:
        return f"workspace {config.id!r}: {config.path} cannot be examined ({exc.strerror or exc})"
    return None


def _refuse_unsafe_folder(config: WorkspaceConfig, owner: tuple[int, int]) -> None:
    """The folder checks of a root server's host workspace, each a `ConfigError` (`_open_host`)."""
    _refuse_replaceable(config, owner)
    _refuse_open_to_others(config, owner)  # before the setuid scan: an open folder is how one gets planted
    _refuse_privileged_files(config)


def _refuse_replaceable(config: WorkspaceConfig, owner: tuple[int, int]) -> None:
    try:
        who = replaceable_by(str(config.path), owner)
    except OSError as exc:
        raise ConfigError(f"workspace {config.id!r}: {config.path} cannot be examined ({exc.strerror})") from exc
    if who is not None:
        raise ConfigError(
            f"workspace {config.id!r}: {config.path} (owned by uid {owner[0]}) could be replaced by another folder "
            f"by {who}, and the server would serve that one as its owner: move the workspace to a folder only "
            "root or its owner can write"
        )


def _refuse_open_to_others(config: WorkspaceConfig, owner: tuple[int, int]) -> None:
    """A host workspace folder that users besides root and its owner may write stops the start.

    They could rename or replace the owner's files in it, which its commands and file tools then act on as
    the owner, or plant a setuid file. Commands cannot open it (`seccomp.HOST_WORKSPACE_DENIED`); this
    catches a folder opened before. The folder itself only: a sub-folder opened before stays open to them.

    Raises:
        ConfigError: someone else may write it.
    """
    try:
        who = writers_besides(str(config.path), owner)
    except OSError as exc:
        raise ConfigError(f"workspace {config.id!r}: {config.path} cannot be examined ({exc.strerror})") from exc
    if who is not None:
        raise ConfigError(
            f"workspace {config.id!r}: {config.path} may be written by {who}, who could rename or plant files in "
            "it: chmod go-w it (and remove ACL entries that grant write)"
        )


def _require_same_folder(workspace: HostWorkspace, chosen: os.stat_result, target: Path | None) -> None:
    """The folder the jail holds must be the one whose owner was chosen, and the idmapped mount must show it.

    Each was found by the path on its own (a bind mount keeps the device and inode): a folder renamed
    into the path, or a component swapped for a link, in between would give the file tools or the
    commands another folder, or the folder another owner's rights. The workspace is closed on a refusal.
    """
    try:
        held = workspace.folder_id
        mounted = os.stat(target) if target is not None else chosen
        if {(chosen.st_dev, chosen.st_ino), (mounted.st_dev, mounted.st_ino)} != {held}:
            raise Unavailable(
                f"workspace {workspace.id!r}: the folder its file tools hold, the one mounted for its commands and "
                f"the one its owner was taken from are not the same ({workspace.config.path} changed while the "
                "server opened it): check who can change that path"
            )
    except BaseException:
        workspace.close()
        raise


def _refuse_privileged_files(config: WorkspaceConfig) -> None:
    """A setuid, setgid or capability-carrying file in a root server's host workspace stops the start.

    Its commands act as the folder's owner on disk: one could rewrite such a file through a
    shared mapping, which keeps the bit (see `privileged_files`).

    Raises:
        ConfigError: one is there.
    """
    found, cut = privileged_files(config.path)
    if found:
        names = ", ".join(_shown_name(name) for name in found)
        more = f" (the first {len(found)}; there may be more)" if len(found) >= MAX_PRIVILEGED_NAMED else ""
        raise ConfigError(
            f"workspace {config.id!r}: files in {config.path} run with privileges (setuid, setgid or file "
            f"capabilities): {names}{more}; a command could rewrite them keeping those: remove them (chmod "
            "u-s,g-s; setcap -r) or move them out of the workspace"
        )
    if cut:
        logger.warning(
            "workspace %s: over %d entries or %d folders deep, not all checked for setuid or setgid files",
            config.id,
            MAX_SCAN_ENTRIES,
            MAX_WALK_DEPTH,
        )


def _shown_name(name: str) -> str:
    """A name an agent chose, quoted (found by attack: one of terminal escapes cleared the administrator's screen)
    and cut to the end that fits in `MAX_SHOWN_NAME_CHARS` quoted (found by review: ten names 3,000 characters deep
    made a line of 195,876), where the file's own name is."""
    if len(shown := repr(name)) <= MAX_SHOWN_NAME_CHARS:
        return shown
    kept, size = [], 0
    for char in reversed(name):  # by what each character takes quoted: a byte that is not UTF-8 takes 6
        size += len(repr(char)) - 2
        if size > MAX_SHOWN_NAME_CHARS:
            break
        kept.append(char)
    return f"{'…' + ''.join(reversed(kept))!r} (cut, {len(name)} characters)"


def _drop_stale_mounts(mounts: Path) -> None:
    """Unmount and remove what a crashed server left in `mounts` (its workspaces' idmapped mounts)."""
    if not mounts.is_dir() or mounts.is_symlink():
        return
    for entry in mounts.iterdir():
        try:
            if is_mounted(entry):
                unmount(entry)  # an older server's, mounted at idmap/<id> itself: never look inside it
            inner = entry / IDMAP_MOUNT
            if is_mounted(inner):
                unmount(inner)
            with contextlib.suppress(FileNotFoundError):
                inner.rmdir()
            entry.rmdir()
        except (BastionError, OSError) as exc:
            reason = exc.reason if isinstance(exc, BastionError) else str(exc)
            logger.warning("a previous server's mount %s is left: %s", entry, reason)


def open_host_workspaces(
    config: Config,
    redactor: Redactor,
    cgroups: CgroupLayout | None,
    identities: IdentityPool | None = None,
    devices: DeviceFolder | None = None,
) -> dict[str, HostWorkspace]:
    """Every configured host workspace, by id; on a failure the ones opened are closed again."""
    pool = identities or IdentityPool(*config.sandboxes.host_ids)
    mounts = config.state_dir / IDMAP_DIR
    if pool.switches:
        _drop_stale_mounts(mounts)
    if pool.switches and config.workspace:
        mounts.mkdir(mode=0o711, exist_ok=True)
        os.chmod(mounts, 0o711)  # noqa: S103 - passable, not listable: by the workspaces' own ids
    hosts: dict[str, HostWorkspace] = {}
    try:
        for ws in config.workspace:
            hosts[ws.id] = _open_host(ws, redactor, cgroups, pool, mounts, devices)
    except BaseException:
        for host in hosts.values():
            host.close()
        raise
    return hosts
