"""Host workspaces: a real folder of the host, behind the jail and the command policy.

Wiring only: every decision is the safety core's (`CommandPolicy.check`,
`Jail`, `Redactor`); the kernel sandbox (`WarmSandbox`) is what makes an allowed
command harmless to the rest of the host.
"""

from __future__ import annotations

import base64
import codecs
import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal

from bastion.config import Config, WorkspaceConfig
from bastion.safety.commands import ApprovedCommand, CommandPolicy, Decision
from bastion.safety.errors import InvalidRequest, SandboxNotFound
from bastion.safety.paths import MAX_READ_BYTES, Jail
from bastion.safety.redact import Redactor, sanitize_terminal
from bastion.sandbox._spawn import SANDBOX_PATH, SANDBOX_WORKSPACE, SandboxSpec
from bastion.sandbox.cgroups import CgroupLayout, Limits
from bastion.sandbox.warm import RunOutcome, WarmSandbox

if TYPE_CHECKING:
    from bastion.sandboxes import SandboxManager

Encoding = Literal["utf-8", "base64"]
LANG: Final = "C.UTF-8"


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
    ) -> None:
        """A workspace behind a warm sandbox.

        Args:
            via_sh: run commands as ``sh -c COMMAND`` (sandboxes, whose policy allows a shell)
                instead of parsing them into argv without one (host workspaces).
            sandbox: an already started sandbox over ``config.path`` (from a warm pool);
                its limits are set from ``config``.
        """
        self.config = config
        self.via_sh = via_sh
        self.id = config.id
        self.policy = CommandPolicy(config.policy)
        self.jail = Jail(config.path, secret_patterns=config.secret_files, allow_hardlinks=config.allow_hardlinks)
        self.redactor = redactor
        limits = None
        if config.use_cgroups:
            lim = config.limits
            limits = Limits(memory_bytes=lim.memory_bytes, pids=lim.pids, cpu_cores=lim.cpu_cores)
        if sandbox is None:
            sandbox = WarmSandbox(SandboxSpec(workspace=self.jail.root), cgroups=cgroups, limits=limits)
        elif limits is not None:
            sandbox.set_limits(limits)
        self.sandbox = sandbox

    def environment(self) -> dict[str, str]:
        """Exactly PATH, HOME and LANG, plus the administrator's variables."""
        return {"PATH": SANDBOX_PATH, "HOME": SANDBOX_WORKSPACE, "LANG": LANG, **self.config.env}

    def explain(self, command: str) -> Decision:
        decision = self.policy.explain(command)
        return dataclasses.replace(decision, argv=self._redact_argv(decision.argv))

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
        return self._render(approved, sandbox_cwd, outcome)

    def _render(self, approved: ApprovedCommand, cwd: str, outcome: RunOutcome) -> CommandOutput:
        stdout = self._clean(outcome.stdout, cut=outcome.stdout_total > len(outcome.stdout))
        stderr = self._clean(outcome.stderr, cut=outcome.stderr_total > len(outcome.stderr))
        return CommandOutput(
            argv=self._redact_argv(approved.argv),
            cwd=cwd,
            exit_status=outcome.status,
            stdout=stdout,
            stderr=stderr,
            truncated=outcome.truncated,
            timed_out=outcome.timed_out,
            oom_killed=outcome.oom_killed,
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
        result = self.jail.read(path, offset=offset, length=want)
        if encoding == "base64":
            content = base64.b64encode(result.data).decode("ascii")
        else:
            content = self.redactor.redact(result.data.decode("utf-8", errors="replace"))
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
        if encoding == "base64":
            try:
                data = base64.b64decode(content, validate=True)
            except ValueError:
                raise InvalidRequest("content is not valid base64") from None
        else:
            data = content.encode("utf-8")
        result = self.jail.write(path, data, append=append, create_parents=True)
        return {"path": result.path, "bytes_written": result.bytes_written, "created": result.created}

    def list_directory(self, path: str) -> dict[str, object]:
        entries = self.jail.list_dir(path)
        return {
            "path": self.jail.relative(path),
            "entries": [{"name": e.name, "kind": e.kind, "size": e.size} for e in entries],
        }

    def close(self) -> None:
        self.sandbox.close()
        self.jail.close()


class WorkspaceRegistry:
    """Where a work tool acts: a configured host workspace, or an agent's sandbox, by id."""

    def __init__(self, config: Config, redactor: Redactor, cgroups: CgroupLayout | None) -> None:
        self._default = config.default_workspace
        self._workspaces = {ws.id: HostWorkspace(ws, redactor, cgroups) for ws in config.workspace}
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
            return host
        if self.sandboxes is not None and self.sandboxes.owns(key):
            return self.sandboxes.get(key).workspace
        raise SandboxNotFound(f"no workspace or sandbox named {key!r}: see list_sandboxes or the config")

    def close(self) -> None:
        for ws in self._workspaces.values():
            ws.close()
