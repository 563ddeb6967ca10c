"""Kernel sandboxes. `_spawn`, `_disk` and `_idmap` are the dangerous layer; `warm` is the checked one above it.

What other packages use of the private modules is exported here. `_spawn` and `_disk` themselves
may be imported only by the files pyproject.toml names (TID251); tests/test_contracts.py checks it.
"""

from bastion.sandbox._devices import SCRATCH_INODES, SHM_SIZE_BYTES, TMP_SIZE_BYTES, DeviceFolder, ScratchSizes
from bastion.sandbox._disk import quota_available
from bastion.sandbox._idmap import idmap_supported, idmapped_mount, is_mounted, unmount
from bastion.sandbox._spawn import (
    EGRESS_DIR,
    EGRESS_SOCKET_NAME,
    FORWARDER_PATH,
    KERNEL_PATH,
    PROGRAMS_DIR,
    REPL_PATH,
    SANDBOX_NODE_OPTIONS,
    SANDBOX_PATH,
    SANDBOX_WORKSPACE,
    LinkOnPath,
    SandboxSpec,
    open_beneath,
    sandbox_python,
)
from bastion.sandbox.backend import Backend, Process, RunOutcome, Sandbox
from bastion.sandbox.warm import BubblewrapBackend, WarmSandbox

__all__ = [
    "EGRESS_DIR",
    "EGRESS_SOCKET_NAME",
    "FORWARDER_PATH",
    "KERNEL_PATH",
    "PROGRAMS_DIR",
    "REPL_PATH",
    "SANDBOX_NODE_OPTIONS",
    "SANDBOX_PATH",
    "SANDBOX_WORKSPACE",
    "SCRATCH_INODES",
    "SHM_SIZE_BYTES",
    "TMP_SIZE_BYTES",
    "Backend",
    "BubblewrapBackend",
    "DeviceFolder",
    "LinkOnPath",
    "Process",
    "RunOutcome",
    "Sandbox",
    "SandboxSpec",
    "ScratchSizes",
    "WarmSandbox",
    "idmap_supported",
    "idmapped_mount",
    "is_mounted",
    "open_beneath",
    "quota_available",
    "sandbox_python",
    "unmount",
]
