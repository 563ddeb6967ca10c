"""`/healthz`, `/readyz` and `/metrics`: what a supervisor and a Prometheus server ask the HTTP listener.

- `/healthz`: 200 `ok` while the process serves requests. No auth, no detail.
- `/readyz`: 200 or 503 with `{"ready": bool, "checks": {"audit": bool, "cgroups": bool, "warm_pool": bool}}`.
  Booleans only: no path, no reason (those are in the server log). No auth: a prober rarely has one,
  and which of three checks failed tells a stranger nothing they could use.
- `/metrics`: the Prometheus exposition. With `[metrics] token_file`, only with `Authorization: Bearer
  <token>` (compared as SHA-256 digests, in constant time); without it, only from a loopback client
  whose request no proxy relayed (a same-host reverse proxy connects from 127.0.0.1 for everyone: a
  request carrying Forwarded, X-Forwarded-For or X-Real-IP is refused). Refusals are a bare 401 or 403.

These three answer before `HostGuard`, because probes and scrapers on the host use 127.0.0.1 whatever
`public_url` is. `/metrics` checks Host itself: with a token, one of the server's own names or a loopback
literal; without, a loopback literal with the listening port only (a same-host proxy that passes the
public Host but adds no X-Forwarded-For relays the internet from 127.0.0.1). A
DNS-rebinding page (Host: its own domain, resolved to 127.0.0.1) is refused, so a page the administrator
opens cannot read the metrics through the browser's loopback connection.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import stat
from pathlib import Path
from typing import Final

from starlette.types import ASGIApp, Receive, Scope, Send

from bastion.app import Services
from bastion.metrics import CONTENT_TYPE, Metrics
from bastion.safety.errors import ConfigError
from bastion.safety.paths import file_replaceable_by

__all__ = ["MIN_TOKEN_CHARS", "Observe", "read_scrape_token", "scrape_token_problem"]

logger = logging.getLogger("bastion.http.observe")
MIN_TOKEN_CHARS: Final = 32
MAX_TOKEN_BYTES: Final = 4096
_RELAYED: Final = frozenset({b"forwarded", b"x-forwarded-for", b"x-real-ip"})
_LOOPBACK_HOSTS: Final = ("127.0.0.1", "localhost", "[::1]")
_PATHS: Final = frozenset({"/healthz", "/readyz", "/metrics"})


def read_scrape_token(path: Path) -> bytes:
    """The SHA-256 digest of the token in `path` (surrounding whitespace ignored).

    Only the digest is kept: the token itself leaves no copy in the server's memory to leak. The file is
    judged first as the other secrets are (`scrape_token_problem`), then opened without following a link or
    waiting on a FIFO, and read only if what was opened is a regular file.

    Raises:
        ConfigError: the file is not the server's alone, cannot be read, is not a regular file, or holds
            fewer than `MIN_TOKEN_CHARS` characters.
    """
    problem = scrape_token_problem(path)
    if problem is not None:
        raise ConfigError(problem)
    try:
        token = _read_regular(path).strip()
    except OSError as exc:
        raise ConfigError(_unreadable(path, exc)) from None
    if len(token) < MIN_TOKEN_CHARS or len(token) > MAX_TOKEN_BYTES:
        raise ConfigError(
            f"[metrics] token_file {path} must hold one token of {MIN_TOKEN_CHARS} to {MAX_TOKEN_BYTES} characters "
            "(e.g. from 'openssl rand -hex 32')"
        )
    return hashlib.sha256(token).digest()


def scrape_token_problem(path: Path) -> str | None:
    """Why the server must not take its scrape token from `path` (one line), or None; opens nothing.

    Whoever may replace the file chooses the token, or puts a FIFO there that hangs `serve --http` at start
    (found by attack): it must be a regular file no one but root or the server could change (owner, mode,
    ACL, a folder on the way), and no symbolic link (it is opened without following one). Whoever may read
    it may scrape: any user may not; its group may, as documented, so Prometheus reads the same file.
    """
    if os.path.islink(path):
        return f"[metrics] token_file {path} is a symbolic link: point token_file at the real file"
    try:
        problem = file_replaceable_by(str(path), (os.geteuid(), os.getegid()))
        if problem is None and os.stat(path).st_mode & stat.S_IROTH:
            problem = f"any user: they may read {path}"
    except OSError as exc:
        return _unreadable(path, exc)
    if problem is None:
        return None
    return (
        f"[metrics] token_file {path} is not the server's to trust ({problem}): keep it in a folder only root "
        "can write, mode 0640 at most (the group may be Prometheus')"
    )


def _read_regular(path: Path) -> bytes:
    """Up to `MAX_TOKEN_BYTES` + 1 bytes of the regular file at `path`: a link or a FIFO put there after
    the check is refused, never followed or waited on."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"[metrics] token_file {path} is not a regular file: give a plain file")
    with os.fdopen(fd, "rb") as f:
        return f.read(MAX_TOKEN_BYTES + 1)


def _unreadable(path: Path, exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return f"[metrics] token_file {path} is a symbolic link: point token_file at the real file"
    return f"[metrics] token_file {path}: {exc.strerror or exc}: create it or unset token_file"


class Observe:
    """The three routes in front of `app` (everything else goes to `app` unchanged)."""

    def __init__(
        self, app: ASGIApp, services: Services, hosts: list[str], port: int, token_digest: bytes | None
    ) -> None:
        """`token_digest`: `read_scrape_token`'s answer for `[metrics] token_file`, or None (loopback only)."""
        self.app = app
        self.services = services
        self.metrics: Metrics | None = services.metrics
        self.token_digest = token_digest
        loopback = frozenset(f"{h}:{port}" for h in _LOOPBACK_HOSTS)
        # Without a token the client must be local, and a local scraper names the loopback address; the
        # public name from 127.0.0.1 is a same-host proxy relaying someone (one that adds no X-Forwarded-For).
        self.metrics_hosts = loopback if token_digest is None else loopback | {h.lower() for h in hosts}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in _PATHS:
            await self.app(scope, receive, send)
            return
        if scope["method"] not in ("GET", "HEAD"):
            await _answer(send, 405, b"Method Not Allowed\n", extra=[(b"allow", b"GET, HEAD")])
            return
        path = scope["path"]
        if path == "/healthz":
            await _answer(send, 200, b"ok\n")
        elif path == "/readyz":
            await self._ready(send)
        else:
            await self._metrics(scope, send)

    async def _ready(self, send: Send) -> None:
        services = self.services
        checks = {
            "audit": services.audit.problem() is None,
            "cgroups": services.cgroups is None or services.cgroups.usable(),
            "warm_pool": services.sandboxes.pool_ready(),
        }
        ready = all(checks.values())
        body = json.dumps({"ready": ready, "checks": checks}).encode() + b"\n"
        await _answer(send, 200 if ready else 503, body, content_type=b"application/json")

    async def _metrics(self, scope: Scope, send: Send) -> None:
        if self.metrics is None:
            await _answer(send, 404, b"Not Found\n")
            return
        headers = scope.get("headers", ())
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            await _refuse(send, refusal)
            return
        await _answer(send, 200, self.metrics.render(), content_type=CONTENT_TYPE.encode())

    def _refusal(self, scope: Scope, headers: list[tuple[bytes, bytes]]) -> int | None:
        host = b""
        authorization = b""
        relayed = False
        for key, value in headers:
            if key == b"host":
                host = value
            elif key == b"authorization":
                authorization = value
            elif key in _RELAYED:
                relayed = True
        if host.decode("latin-1").lower() not in self.metrics_hosts:
            return 403
        if self.token_digest is not None:
            return None if self._token_ok(authorization) else 401
        client = scope.get("client")
        return None if client is not None and not relayed and _is_loopback(client[0]) else 403

    def _token_ok(self, authorization: bytes) -> bool:
        if self.token_digest is None:
            return False
        scheme, _, token = authorization.partition(b" ")
        presented = hashlib.sha256(token.strip()).digest()
        # Both sides compared, whatever the scheme: the time taken says nothing about the token.
        same = hmac.compare_digest(presented, self.token_digest)
        return same and scheme.lower() == b"bearer"


async def _refuse(send: Send, status: int) -> None:
    if status == 401:
        await _answer(send, 401, b"Unauthorized\n", extra=[(b"www-authenticate", b"Bearer")])
    else:
        await _answer(send, 403, b"Forbidden\n")


def _is_loopback(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


async def _answer(
    send: Send,
    status: int,
    body: bytes,
    *,
    content_type: bytes = b"text/plain; charset=utf-8",
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    headers = [
        (b"content-type", content_type),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
        (b"x-content-type-options", b"nosniff"),
        *(extra or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
