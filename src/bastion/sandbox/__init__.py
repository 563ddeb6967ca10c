"""Kernel sandboxes. `_spawn` and `_agent` are the dangerous layer; `warm` is the checked one above it."""

from bastion.sandbox.warm import RunOutcome, WarmSandbox

__all__ = ["RunOutcome", "WarmSandbox"]
