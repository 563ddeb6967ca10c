"""MCP wiring: the server that enforces the call contract, and the tools on it."""

from bastion.tools._call import UNKNOWN_TOOL, CallRunner
from bastion.tools.server import BastionServer, to_call_result

__all__ = ["UNKNOWN_TOOL", "BastionServer", "CallRunner", "to_call_result"]
