"""bastion: a kernel-isolated workbench for AI agents, served over MCP."""

__version__ = "0.1.0"
__all__ = ["__version__"]
