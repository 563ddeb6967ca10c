"""Where a work tool acts: a configured host workspace, or an agent's sandbox, by id.

The one module that knows both the host workspaces and the sandbox manager; it stands above
them, and neither knows it.
"""

from __future__ import annotations

from collections.abc import Mapping

from bastion.safety.errors import SandboxNotFound
from bastion.workbench.manager import SandboxManager
from bastion.workbench.workspace import HostWorkspace


class WorkspaceRegistry:
    """Resolves the id a call names (None: the default workspace) to its workspace."""

    def __init__(self, hosts: Mapping[str, HostWorkspace], sandboxes: SandboxManager, *, default: str) -> None:
        self._hosts = dict(hosts)
        self._sandboxes = sandboxes
        self._default = default

    def is_host(self, workspace_id: str) -> bool:
        return workspace_id in self._hosts

    def get_id(self, workspace_id: str | None) -> str:
        """The id a call is about, for the audit record (not checked here)."""
        return workspace_id or self._default

    def get(self, workspace_id: str | None) -> HostWorkspace:
        key = workspace_id or self._default
        host = self._hosts.get(key)
        if host is not None:
            host.check_folder()
            return host
        if self._sandboxes.owns(key):
            return self._sandboxes.get(key).workspace
        raise SandboxNotFound(f"no workspace or sandbox named {key!r}: see list_sandboxes or the config")

    def close(self) -> None:
        """Close the host workspaces (the manager closes its sandboxes)."""
        for host in self._hosts.values():
            host.close()
