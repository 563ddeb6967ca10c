"""Where a work tool acts: a configured host workspace, or an agent's sandbox, by id.

The one module that knows both the host workspaces and the sandbox manager; it stands above
them, and neither knows it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from bastion.safety.errors import NotFound, SandboxNotFound, shown
from bastion.safety.redact import sanitize_terminal
from bastion.workbench.manager import Sandbox, SandboxManager
from bastion.workbench.workspace import HostWorkspace


@dataclass(frozen=True)
class Target:
    """The workspace one call acts on, resolved once: its id is known to exist."""

    id: str
    workspace: HostWorkspace
    sandbox: Sandbox | None = None
    """The manager's record when `workspace` is an agent's sandbox."""

    @property
    def is_sandbox(self) -> bool:
        return self.workspace.is_sandbox

    def require_sandbox(self, what: str) -> Sandbox:
        """The sandbox, or FORBIDDEN for a host workspace (see `HostWorkspace.require_sandbox`)."""
        self.workspace.require_sandbox(what)
        assert self.sandbox is not None
        return self.sandbox


class WorkspaceRegistry:
    """Resolves the id a call names (None: the default workspace) to its workspace.

    A tool resolves once, before its operation runs, and names `Target.id` in its audit record;
    an unknown id is refused there (SANDBOX_NOT_FOUND), so no record names an id that does not
    exist. A tool wiring that audits the refusal itself:

        try:
            target = registry.resolve(sandbox_id)
        except SandboxNotFound as exc:
            return await runner.refuse(action, args, exc)  # audited, workspace null
    """

    def __init__(self, hosts: Mapping[str, HostWorkspace], sandboxes: SandboxManager, *, default: str) -> None:
        self._hosts = dict(hosts)
        self._sandboxes = sandboxes
        self._default = default

    def resolve(self, workspace_id: str | None, *, while_restoring: bool = False) -> Target:
        """The workspace `workspace_id` names, once per call (a sandbox being restored only `while_restoring`).

        Raises:
            SandboxNotFound: no host workspace or live sandbox has that id.
            Unavailable: the host workspace's folder was deleted or replaced (`HostWorkspace.check_folder`).
            Conflict: the sandbox is being restored (and not `while_restoring`).
        """
        key = workspace_id or self._default
        host = self._hosts.get(key)
        if host is not None:
            host.check_folder()
            return Target(key, host)
        if self._sandboxes.owns(key):
            box = self._sandboxes.get(key, while_restoring=while_restoring)
            return Target(key, box.workspace, box)
        raise SandboxNotFound(f"no workspace or sandbox named {shown(key)}: see list_sandboxes or the config")

    def known_id(self, workspace_id: str | None) -> str | None:
        """The id a call names if a workspace or live sandbox has it, else None. Checks nothing else."""
        key = workspace_id or self._default
        return key if key in self._hosts or self._sandboxes.owns(key) else None

    def get_id(self, workspace_id: str | None) -> str | None:
        """The id for the audit record: `known_id`, so an unknown id is never recorded as if it were real.

        Kept for tools that audit before they resolve: their operation's `get` then refuses the
        unknown id with SANDBOX_NOT_FOUND before anything runs, and that refusal is audited
        (workspace null). New code calls `resolve` once instead.
        """
        return self.known_id(workspace_id)

    def find_terminal(self, terminal_id: str) -> Target:
        """The workspace a terminal (from open_terminal) belongs to; a sandbox's counts as used.

        Raises:
            NotFound: no open terminal has that id.
        """
        for key, host in self._hosts.items():
            if host.terminals.has(terminal_id):
                return Target(key, host)
        for box in self._sandboxes.all():
            if box.workspace.terminals.has(terminal_id):
                return Target(box.id, box.workspace, self._sandboxes.get(box.id))
        raise NotFound(f"no open terminal {sanitize_terminal(terminal_id)[:80]!r}: open_terminal first")

    def terminal_workspace(self, terminal_id: str) -> str | None:
        """The id of the workspace a terminal belongs to, for the audit record; None if there is none."""
        try:
            return self.find_terminal(terminal_id).id
        except NotFound:
            return None

    def get(self, workspace_id: str | None) -> HostWorkspace:
        """`resolve(workspace_id).workspace`."""
        return self.resolve(workspace_id).workspace

    def close(self) -> None:
        """Close the host workspaces (the manager closes its sandboxes)."""
        for host in self._hosts.values():
            host.close()
