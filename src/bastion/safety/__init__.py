"""The safety core: every rule that can hurt lives here, and every tool calls it.

results (OperationResult, ResultCode), errors (one error tree), commands (parser and
policy), paths (openat2 jail), redact (secrets and terminal escapes), audit (the
hash-chained, fail-closed log).
"""

from bastion.safety.errors import BastionError, ConfigError
from bastion.safety.results import OperationResult, ResultCode

__all__ = ["BastionError", "ConfigError", "OperationResult", "ResultCode"]
