"""Snapshots of a sandbox's workspace: archives written and restored without trusting their contents."""
