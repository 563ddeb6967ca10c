"""bastion as a systemd service: readiness notification (notify) and the unit and its installation (unit, install)."""

from bastion.systemd.notify import Notifier

__all__ = ["Notifier"]
