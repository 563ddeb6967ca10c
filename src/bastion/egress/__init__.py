"""The logging egress proxy: the only way out of a sandbox, one allowlist per sandbox."""
