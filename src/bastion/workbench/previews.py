"""Preview URLs: capability tokens that name one port of one sandbox (expose_port).

A token is 256 bits from `secrets`; whoever holds the URL reaches 127.0.0.1:<port> inside that sandbox
(and, unless the exposure is public, only with the administrator's login session: checked by the HTTP
side, `bastion.transports.http.preview`). A token is logged and audited only as `token_id`, a short
digest. It dies with its sandbox (closed by a call or the reaper: checked at every use), at its
lifetime's end, or by unexpose_port; a dead token and one that never existed look the same.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from bastion.safety.errors import Forbidden, InvalidRequest, NotFound, ResourceLimit, Unavailable
from bastion.workbench.manager import Sandbox, SandboxManager

MAX_PER_SANDBOX: Final = 16
TOKEN_BYTES: Final = 32  # 256 bits


def token_id(token: str) -> str:
    """A short digest of a token, for logs and audit records (never the token itself)."""
    return hashlib.sha256(token.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Preview:
    """One exposed port; `box` is the sandbox it was made for (a later sandbox of the same id is not it)."""

    token: str
    box: Sandbox
    port: int
    public: bool
    created_wall: float
    expires: float  # time.monotonic()

    @property
    def sandbox_id(self) -> str:
        return self.box.id

    def summary(self, base_url: str) -> dict[str, object]:
        return {
            "url": f"{base_url}/preview/{self.token}/",
            "sandbox_id": self.sandbox_id,
            "port": self.port,
            "public": self.public,
            "expires_in_s": max(0, round(self.expires - time.monotonic())),
        }


class PreviewRegistry:
    """The live preview tokens of one server process (the one whose sandboxes they reach)."""

    def __init__(self, manager: SandboxManager, *, lifetime_s: float, public_allowed: bool) -> None:
        self.manager = manager
        self.lifetime_s = lifetime_s
        self.public_allowed = public_allowed
        self.base_url: str | None = None  # set by the HTTP listener that serves the URLs
        self._by_token: dict[str, Preview] = {}

    def _require_served(self) -> str:
        if self.base_url is None:
            raise Unavailable(
                "this server has no preview listener: preview URLs are served by `bastion serve` (--http or "
                "--stdio) with [http] preview_listen set, in the process that owns the sandboxes"
            )
        return self.base_url

    def expose(self, sandbox_id: str, port: int, *, public: bool) -> dict[str, object]:
        """A new URL for 127.0.0.1:`port` in the sandbox; one already given for that port stops working.

        Raises:
            InvalidRequest: a port outside 1..65535.
            Forbidden: public=true, and the config does not allow public previews.
            Unavailable: no preview listener in this process.
            SandboxNotFound: no such sandbox.
            ResourceLimit: the sandbox has MAX_PER_SANDBOX URLs already.
        """
        base_url = self._require_served()
        if type(port) is not int or not 0 < port < 65536:
            raise InvalidRequest(f"port {port!r} is not a TCP port: give 1 to 65535")
        if public and not self.public_allowed:
            raise Forbidden("public preview URLs are off: set [http] preview_public_allowed = true, or omit public")
        box = self.manager.get(sandbox_id)
        self._drop(lambda p: p.box is box and p.port == port)
        if len(self.exposed(sandbox_id)) >= MAX_PER_SANDBOX:
            raise ResourceLimit(f"sandbox {sandbox_id} has {MAX_PER_SANDBOX} preview URLs: unexpose_port one first")
        token = secrets.token_urlsafe(TOKEN_BYTES)
        preview = Preview(token, box, port, public, time.time(), time.monotonic() + self.lifetime_s)
        self._by_token[token] = preview
        return preview.summary(base_url)

    def unexpose(self, sandbox_id: str, port: int) -> None:
        """Raises NotFound when that port of that sandbox has no URL."""
        box = self.manager.get(sandbox_id)
        if not self._drop(lambda p: p.box is box and p.port == port):
            raise NotFound(f"port {port} of sandbox {sandbox_id} has no preview URL (list_exposed_ports)")

    def exposed(self, sandbox_id: str) -> list[Preview]:
        self._forget_dead()
        return sorted((p for p in self._by_token.values() if p.sandbox_id == sandbox_id), key=lambda p: p.port)

    def summaries(self, sandbox_id: str) -> list[dict[str, object]]:
        self.manager.get(sandbox_id)  # SandboxNotFound for an unknown id
        base_url = self._require_served()
        return [p.summary(base_url) for p in self.exposed(sandbox_id)]

    def lookup(self, token: str) -> Preview | None:
        """The live preview of `token`, or None (unknown, expired, unexposed, or its sandbox closed)."""
        preview = self._by_token.get(token)
        if preview is None:
            return None
        if not self._alive(preview):
            del self._by_token[token]
            return None
        return preview

    def _alive(self, preview: Preview) -> bool:
        # `peek`, not `get` (found by review): every preview request, and every expose_port of any sandbox (which
        # looks at all previews), counted as a use of each sandbox with a preview, so the idle reaper never
        # closed them; and a sandbox being restored made the look raise Conflict.
        return time.monotonic() < preview.expires and self.manager.peek(preview.sandbox_id) is preview.box

    def _forget_dead(self) -> None:
        self._drop(lambda p: not self._alive(p))

    def _drop(self, which: Callable[[Preview], bool]) -> int:
        dropped = [t for t, p in self._by_token.items() if which(p)]
        for token in dropped:
            del self._by_token[token]
        return len(dropped)
