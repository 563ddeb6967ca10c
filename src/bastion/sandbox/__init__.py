"""Kernel sandboxes. `_spawn` and `_agent` are the dangerous layer; `warm` is the checked one above it."""

from bastion.sandbox.backend import RunOutcome
from bastion.sandbox.warm import WarmSandbox

__all__ = ["RunOutcome", "WarmSandbox"]
