"""The service layer: host workspaces, agent sandboxes and what runs in them (code, network, packages)."""
