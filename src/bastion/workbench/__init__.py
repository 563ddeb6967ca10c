"""The service layer: host workspaces, agent sandboxes and what runs in them (code, network, packages)."""

# Nothing is exported here: other packages import from the public modules.
__all__: list[str] = []
