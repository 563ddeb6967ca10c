"""The logging egress proxy: the only way out of a sandbox, one allowlist per sandbox."""

# Nothing is exported here: other packages import from the public modules.
__all__: list[str] = []
