"""Snapshots of a sandbox's workspace: archives written and restored without trusting their contents."""

# Nothing is exported here: other packages import from the public modules.
__all__: list[str] = []
