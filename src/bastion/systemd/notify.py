"""systemd's readiness protocol (sd_notify(3)), by hand: one datagram per state change to $NOTIFY_SOCKET.

A `Type=notify` unit is "started" when the main process sends READY=1, so `systemctl start` and the
units ordered after bastion wait until the listeners are bound and the services built (mounts
recovered, warm pool started), instead of until the process exists. STOPPING=1 says a stop has
begun, so `systemctl status` shows "deactivating" while sandboxes are torn down.

The variable is removed from the environment when read (libsystemd's `unset_environment`): a
command bastion starts must not be able to speak for the service. systemd also ignores messages
from any process but the main one (`NotifyAccess=main`, the unit says so explicitly). Outside
systemd, with no $NOTIFY_SOCKET, every method does nothing.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Final

__all__ = ["NOTIFY_SOCKET_ENV", "Notifier", "notify_address"]

NOTIFY_SOCKET_ENV: Final = "NOTIFY_SOCKET"

_log = logging.getLogger(__name__)


def notify_address(value: str) -> str | None:
    """The AF_UNIX address $NOTIFY_SOCKET names: a path, or `@name` for the abstract namespace
    (a leading NUL, unix(7)); None for anything else (systemd 254's `vsock:` addresses included)."""
    if value.startswith("/"):
        return value
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    return None


class Notifier:
    """Tells systemd when the server is ready and when it stops; each state is sent at most once."""

    def __init__(self, address: str | None) -> None:
        self._address = address
        self._sent: set[str] = set()

    @classmethod
    def from_environment(cls) -> Notifier:
        """The notifier for $NOTIFY_SOCKET, which this removes from the environment."""
        value = os.environ.pop(NOTIFY_SOCKET_ENV, "")
        if not value:
            return cls(None)
        address = notify_address(value)
        if address is None:
            _log.warning(
                "$%s=%r is not a unix socket address: systemd will not hear of readiness", NOTIFY_SOCKET_ENV, value
            )
        return cls(address)

    @property
    def active(self) -> bool:
        return self._address is not None

    def ready(self, status: str) -> None:
        """READY=1, with a one-line STATUS= that `systemctl status` shows."""
        self._send("READY=1", f"STATUS={_one_line(status)}")

    def stopping(self) -> None:
        self._send("STOPPING=1", "STATUS=stopping: closing sandboxes and the audit log")

    def _send(self, state: str, *extra: str) -> None:
        if self._address is None or state in self._sent:
            return
        self._sent.add(state)
        message = "\n".join((state, *extra)).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(self._address)
                sock.send(message)
        except OSError as exc:
            # Never fatal: a READY=1 lost makes systemd time the start out, and its journal says so.
            _log.warning("cannot notify systemd (%s): %s", state, os.strerror(exc.errno) if exc.errno else exc)


def _one_line(text: str) -> str:
    return " ".join(text.split())
