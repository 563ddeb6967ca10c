"""SQLite store of the authorization server: clients, grants, codes, tokens, admin sessions.

SECURITY BOUNDARY. Codes, access tokens, refresh tokens, client secrets and admin session ids are
stored only as SHA-256 digests (they are 256-bit random values, so a plain digest is enough: there is
nothing to brute-force). A grant is one approval by the administrator; every code and token belongs to
one, and revoking it (replay, refresh-token reuse, revocation, password change) kills them all at once.

Each operation is one statement or one `BEGIN IMMEDIATE` transaction, so a code or a refresh token is
consumed atomically even with several server processes or the CLI on the same file (WAL mode).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import sqlite3
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from bastion.safety.approvals import database_problem
from bastion.safety.errors import ConfigError, NotFound

TOKEN_BYTES: Final = 32  # 256-bit opaque tokens
AUTHORIZATION_KEPT_S: Final = 600.0
"""A client whose authorization started this recently is neither pruned nor evicted (the lifetime of a
pending authorization request, `provider.TRANSACTION_TTL_S`)."""
KEPT_USED_REFRESH_TOKENS: Final = 64
"""Used refresh tokens kept per grant to catch their reuse; an older one presented again is only invalid
(an hourly refresh rotates 64 times in under three days)."""
IDS_PER_QUERY: Final = 500
"""Grant ids looked up per statement (older SQLite builds allow 999 parameters)."""
_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS oauth_clients (
    client_id TEXT PRIMARY KEY,
    info TEXT NOT NULL,
    secret_digest TEXT,
    ip TEXT NOT NULL,
    created_at REAL NOT NULL,
    last_used_at REAL,
    authorizing_at REAL
);
CREATE TABLE IF NOT EXISTS oauth_grants (
    grant_id TEXT PRIMARY KEY,
    client_id TEXT NOT NULL,
    scopes TEXT NOT NULL,
    resource TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    revoked_at REAL,
    revoked_reason TEXT
);
CREATE TABLE IF NOT EXISTS oauth_codes (
    digest TEXT PRIMARY KEY,
    grant_id TEXT NOT NULL,
    client_id TEXT NOT NULL,
    redirect_uri TEXT NOT NULL,
    code_challenge TEXT NOT NULL,
    expires_at REAL NOT NULL,
    used_at REAL
);
CREATE TABLE IF NOT EXISTS oauth_tokens (
    digest TEXT PRIMARY KEY,
    kind TEXT NOT NULL CHECK (kind IN ('access', 'refresh')),
    grant_id TEXT NOT NULL,
    client_id TEXT NOT NULL,
    scopes TEXT NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    used_at REAL
);
CREATE INDEX IF NOT EXISTS oauth_tokens_grant ON oauth_tokens (grant_id);
-- Registration prunes and evicts never-used clients, oldest first: at max_clients = 100,000 a full scan
-- for each registration stalled the loop for 65-170 ms.
CREATE INDEX IF NOT EXISTS oauth_clients_unused ON oauth_clients (created_at) WHERE last_used_at IS NULL;
CREATE INDEX IF NOT EXISTS oauth_grants_client ON oauth_grants (client_id);
CREATE TABLE IF NOT EXISTS admin_sessions (
    digest TEXT PRIMARY KEY,
    csrf TEXT NOT NULL,
    expires_at REAL NOT NULL
);
"""


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def new_secret() -> str:
    return secrets.token_urlsafe(TOKEN_BYTES)


@dataclass(frozen=True)
class Grant:
    grant_id: str
    client_id: str
    scopes: tuple[str, ...]
    resource: str
    created_at: float
    expires_at: float
    revoked_at: float | None


@dataclass(frozen=True)
class CodeRecord:
    grant_id: str
    client_id: str
    redirect_uri: str
    code_challenge: str
    expires_at: float
    used_at: float | None
    scopes: tuple[str, ...]
    resource: str


@dataclass(frozen=True)
class TokenRecord:
    kind: str
    grant_id: str
    client_id: str
    scopes: tuple[str, ...]
    resource: str
    expires_at: float
    used_at: float | None
    grant_expires_at: float


@dataclass(frozen=True)
class IssuedTokens:
    access_token: str
    refresh_token: str
    expires_in: int
    scopes: tuple[str, ...]


class AuthStore:
    """The OAuth tables in `<state_dir>/bastion.db`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            os.close(fd)
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10.0)
        except (OSError, sqlite3.Error) as exc:
            raise ConfigError(database_problem(path, exc)) from None
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA busy_timeout=10000")
            self._db.executescript(_SCHEMA)
            self._add_authorizing_column()
        except sqlite3.Error as exc:
            self._db.close()
            raise ConfigError(database_problem(path, exc)) from None

    def close(self) -> None:
        self._db.close()

    def _add_authorizing_column(self) -> None:
        """A database made before `authorizing_at` existed gets the column (SQLite has no ADD IF NOT EXISTS)."""
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(oauth_clients)")}
        if "authorizing_at" not in columns:
            self._db.execute("ALTER TABLE oauth_clients ADD COLUMN authorizing_at REAL")

    def _begin(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    # -- clients -------------------------------------------------------------------------------

    def add_client(self, client_id: str, info: dict[str, object], secret: str | None, ip: str) -> None:
        self._db.execute(
            "INSERT INTO oauth_clients (client_id, info, secret_digest, ip, created_at) VALUES (?, ?, ?, ?, ?)",
            (client_id, json.dumps(info), digest(secret) if secret else None, ip, time.time()),
        )

    def client(
        self, client_id: str, *, unused_ttl_s: float | None = None
    ) -> tuple[dict[str, object], str | None] | None:
        """The client's metadata and secret digest; with `unused_ttl_s`, None for a client that expired unused."""
        sql = "SELECT info, secret_digest FROM oauth_clients WHERE client_id = ?"
        params: tuple[object, ...] = (client_id,)
        if unused_ttl_s is not None:
            # last_used_at is set when the client's first grant is made: NULL means it never got one.
            sql += " AND (last_used_at IS NOT NULL OR created_at >= ? OR authorizing_at >= ?)"
            params = (client_id, time.time() - unused_ttl_s, time.time() - AUTHORIZATION_KEPT_S)
        row = self._db.execute(sql, params).fetchone()
        if row is None:
            return None
        info: dict[str, object] = json.loads(row[0])
        return info, row[1]

    def mark_authorizing(self, client_id: str) -> None:
        """An authorization for the client started now: it is kept for `AUTHORIZATION_KEPT_S`."""
        self._db.execute("UPDATE oauth_clients SET authorizing_at = ? WHERE client_id = ?", (time.time(), client_id))

    def touch_client(self, client_id: str) -> None:
        self._db.execute("UPDATE oauth_clients SET last_used_at = ? WHERE client_id = ?", (time.time(), client_id))

    def client_count(self) -> int:
        return int(self._db.execute("SELECT count(*) FROM oauth_clients").fetchone()[0])

    def _unstamp_future(self, now: float) -> None:
        """Clients stamped after `now` were stamped before a step of the wall clock back: they are taken as made
        now. Found by attack (wall-clock jumps): with the clock a year ahead, a full table of never-used clients
        could be neither expired, evicted nor pruned once it stepped back, and every registration, claude.ai's
        included, was refused with a Retry-After of a year."""
        self._db.execute("UPDATE oauth_clients SET created_at = ? WHERE created_at > ?", (now, now))
        self._db.execute("UPDATE oauth_clients SET authorizing_at = ? WHERE authorizing_at > ?", (now, now))

    def expire_unused_clients(self, older_than_s: float) -> int:
        """Forget clients registered more than `older_than_s` ago that never got a grant, but not one whose
        authorization started in the last `AUTHORIZATION_KEPT_S` (its approval may be a click away)."""
        now = time.time()
        self._unstamp_future(now)
        cursor = self._db.execute(
            "DELETE FROM oauth_clients WHERE last_used_at IS NULL AND created_at < ? "
            "AND (authorizing_at IS NULL OR authorizing_at < ?) "
            "AND client_id NOT IN (SELECT client_id FROM oauth_grants)",
            (now - older_than_s, now - AUTHORIZATION_KEPT_S),
        )
        return cursor.rowcount

    def evict_unused_clients(self, count: int, older_than_s: float) -> int:
        """Forget up to `count` never-used clients registered more than `older_than_s` ago, oldest first.

        Called when the table is full, so that a registration flood cannot keep a real client out: what a
        flood leaves behind is unused; the youngest and those whose authorization started recently stay.
        """
        now = time.time()
        self._unstamp_future(now)
        cursor = self._db.execute(
            "DELETE FROM oauth_clients WHERE client_id IN (SELECT client_id FROM oauth_clients "
            "WHERE last_used_at IS NULL AND created_at < ? AND (authorizing_at IS NULL OR authorizing_at < ?) "
            "AND client_id NOT IN (SELECT client_id FROM oauth_grants) ORDER BY created_at LIMIT ?)",
            (now - older_than_s, now - AUTHORIZATION_KEPT_S, max(count, 0)),
        )
        return cursor.rowcount

    def oldest_unused_client_at(self) -> float | None:
        """When the oldest never-used client registered (None if there is none)."""
        row = self._db.execute(
            "SELECT min(created_at) FROM oauth_clients WHERE last_used_at IS NULL "
            "AND client_id NOT IN (SELECT client_id FROM oauth_grants)"
        ).fetchone()
        return None if row[0] is None else float(row[0])

    def _has_client(self, client_id: str) -> bool:
        return self._db.execute("SELECT 1 FROM oauth_clients WHERE client_id = ?", (client_id,)).fetchone() is not None

    def client_scopes(self, client_id: str) -> tuple[str, ...] | None:
        """The scopes the client registered (already narrowed to known ones), or None if it named none.

        None means the registration did not bound the scopes; a tuple bounds what may be granted to it.
        """
        row = self._db.execute("SELECT info FROM oauth_clients WHERE client_id = ?", (client_id,)).fetchone()
        if row is None:
            return None
        scope = json.loads(row[0]).get("scope")
        return tuple(scope.split()) if isinstance(scope, str) and scope.split() else None

    def clients(self) -> list[dict[str, object]]:
        rows = self._db.execute(
            "SELECT client_id, info, ip, created_at, last_used_at FROM oauth_clients ORDER BY created_at"
        ).fetchall()
        out = []
        for client_id, info, ip, created_at, last_used_at in rows:
            meta = json.loads(info)
            out.append(
                {
                    "client_id": client_id,
                    "client_name": meta.get("client_name"),
                    "redirect_uris": meta.get("redirect_uris"),
                    "scope": meta.get("scope"),
                    "ip": ip,
                    "created_at": created_at,
                    "last_used_at": last_used_at,
                }
            )
        return out

    # -- grants and codes ----------------------------------------------------------------------

    def create_grant_with_code(
        self,
        *,
        client_id: str,
        scopes: tuple[str, ...],
        resource: str,
        redirect_uri: str,
        code_challenge: str,
        code_lifetime_s: float,
        grant_lifetime_s: float,
        registered: bool = True,
    ) -> str:
        """Record the administrator's approval and return a fresh authorization code.

        The scopes are narrowed to those the client registered, if it registered any: a backstop behind
        the consent page, which should never offer more.

        Raises:
            NotFound: `registered` (a client of this table, not a metadata-document URL) and the client is
                no longer in the table; nothing is recorded (a grant for a deleted client skipped the
                scope backstop).
        """
        now = time.time()
        code = new_secret()
        grant_id = secrets.token_hex(16)
        self._begin()
        try:
            if registered and not self._has_client(client_id):
                raise NotFound(f"client {client_id} is no longer registered: start the authorization again")
            bound = self.client_scopes(client_id)
            if bound is not None:
                scopes = tuple(scope for scope in scopes if scope in bound)
            self._db.execute(
                "INSERT INTO oauth_grants (grant_id, client_id, scopes, resource, created_at, expires_at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (grant_id, client_id, " ".join(scopes), resource, now, now + grant_lifetime_s),
            )
            self._db.execute(
                "INSERT INTO oauth_codes (digest, grant_id, client_id, redirect_uri, code_challenge, expires_at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (digest(code), grant_id, client_id, redirect_uri, code_challenge, now + code_lifetime_s),
            )
            self._db.execute("UPDATE oauth_clients SET last_used_at = ? WHERE client_id = ?", (now, client_id))
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        return code

    def issue_admin_token(
        self, *, client_id: str, scopes: tuple[str, ...], resource: str, lifetime_s: float
    ) -> tuple[str, str]:
        """A grant with one access token and no refresh token (`bastion admin token`): (token, grant_id).

        The grant ends when the token does, and is listed and revoked like any other.
        """
        now = time.time()
        token = new_secret()
        grant_id = secrets.token_hex(16)
        self._begin()
        try:
            self._db.execute(
                "INSERT INTO oauth_grants (grant_id, client_id, scopes, resource, created_at, expires_at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (grant_id, client_id, " ".join(scopes), resource, now, now + lifetime_s),
            )
            self._db.execute(
                "INSERT INTO oauth_tokens (digest, kind, grant_id, client_id, scopes, created_at, expires_at) "
                "VALUES (?, 'access', ?, ?, ?, ?, ?)",
                (digest(token), grant_id, client_id, " ".join(scopes), now, now + lifetime_s),
            )
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        return token, grant_id

    def code(self, code: str) -> CodeRecord | None:
        row = self._db.execute(
            "SELECT c.grant_id, c.client_id, c.redirect_uri, c.code_challenge, c.expires_at, c.used_at, "
            "g.scopes, g.resource FROM oauth_codes c JOIN oauth_grants g ON g.grant_id = c.grant_id "
            "WHERE c.digest = ?",
            (digest(code),),
        ).fetchone()
        if row is None:
            return None
        return CodeRecord(row[0], row[1], row[2], row[3], row[4], row[5], tuple(row[6].split()), row[7])

    def consume_code_and_issue(
        self, code: str, *, access_lifetime_s: float, refresh_lifetime_s: float
    ) -> IssuedTokens | None:
        """Mark the code used and mint the grant's first tokens, atomically; None if it was already used."""
        now = time.time()
        self._begin()
        try:
            cursor = self._db.execute(
                "UPDATE oauth_codes SET used_at = ? WHERE digest = ? AND used_at IS NULL AND expires_at >= ?",
                (now, digest(code), now),
            )
            if cursor.rowcount != 1:
                self._db.execute("ROLLBACK")
                return None
            row = self._db.execute(
                "SELECT g.grant_id, g.client_id, g.scopes FROM oauth_codes c JOIN oauth_grants g "
                "ON g.grant_id = c.grant_id WHERE c.digest = ? AND g.revoked_at IS NULL",
                (digest(code),),
            ).fetchone()
            if row is None:
                self._db.execute("ROLLBACK")
                return None
            grant_id, client_id, scopes = row
            issued = self._issue(grant_id, client_id, tuple(scopes.split()), now, access_lifetime_s, refresh_lifetime_s)
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        return issued

    def _issue(
        self,
        grant_id: str,
        client_id: str,
        scopes: tuple[str, ...],
        now: float,
        access_lifetime_s: float,
        refresh_lifetime_s: float,
    ) -> IssuedTokens:
        access, refresh = new_secret(), new_secret()
        text = " ".join(scopes)
        self._db.executemany(
            "INSERT INTO oauth_tokens (digest, kind, grant_id, client_id, scopes, created_at, expires_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            [
                (digest(access), "access", grant_id, client_id, text, now, now + access_lifetime_s),
                (digest(refresh), "refresh", grant_id, client_id, text, now, now + refresh_lifetime_s),
            ],
        )
        return IssuedTokens(access, refresh, int(access_lifetime_s), scopes)

    # -- tokens --------------------------------------------------------------------------------

    def token(self, token: str, kind: str) -> TokenRecord | None:
        """A live token of this kind: not revoked, grant not revoked. Expiry and use are left to the caller."""
        row = self._db.execute(
            "SELECT t.grant_id, t.client_id, t.scopes, g.resource, t.expires_at, t.used_at, g.expires_at "
            "FROM oauth_tokens t JOIN oauth_grants g ON g.grant_id = t.grant_id "
            "WHERE t.digest = ? AND t.kind = ? AND g.revoked_at IS NULL",
            (digest(token), kind),
        ).fetchone()
        if row is None:
            return None
        return TokenRecord(kind, row[0], row[1], tuple(row[2].split()), row[3], row[4], row[5], row[6])

    def rotate_refresh(
        self, token: str, scopes: tuple[str, ...], *, access_lifetime_s: float, refresh_lifetime_s: float
    ) -> IssuedTokens | None:
        """Consume a refresh token and mint its successors; None if it was used meanwhile (a race or a reuse)."""
        now = time.time()
        self._begin()
        try:
            cursor = self._db.execute(
                "UPDATE oauth_tokens SET used_at = ? WHERE digest = ? AND kind = 'refresh' AND used_at IS NULL",
                (now, digest(token)),
            )
            if cursor.rowcount != 1:
                self._db.execute("ROLLBACK")
                return None
            grant_id, client_id = self._db.execute(
                "SELECT grant_id, client_id FROM oauth_tokens WHERE digest = ?", (digest(token),)
            ).fetchone()
            issued = self._issue(grant_id, client_id, scopes, now, access_lifetime_s, refresh_lifetime_s)
            # A used refresh token is kept to catch its reuse (a theft), but only the grant's newest few:
            # each rotation left a row for the token's whole lifetime, a disk a looping client could fill.
            self._db.execute(
                "DELETE FROM oauth_tokens WHERE grant_id = ? AND kind = 'refresh' AND used_at IS NOT NULL"
                " AND digest NOT IN (SELECT digest FROM oauth_tokens WHERE grant_id = ? AND kind = 'refresh'"
                " AND used_at IS NOT NULL ORDER BY used_at DESC LIMIT ?)",
                (grant_id, grant_id, KEPT_USED_REFRESH_TOKENS),
            )
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        return issued

    def grant_of_token(self, token: str) -> tuple[str, str] | None:
        """(grant_id, client_id) of any token or code, revoked or not: for replay handling and revocation."""
        for table in ("oauth_tokens", "oauth_codes"):
            row = self._db.execute(
                f"SELECT grant_id, client_id FROM {table} WHERE digest = ?",  # noqa: S608 (fixed table names)
                (digest(token),),
            ).fetchone()
            if row is not None:
                return row[0], row[1]
        return None

    def revoke_grant(self, grant_id: str, reason: str) -> bool:
        cursor = self._db.execute(
            "UPDATE oauth_grants SET revoked_at = ?, revoked_reason = ? WHERE grant_id = ? AND revoked_at IS NULL",
            (time.time(), reason, grant_id),
        )
        return cursor.rowcount == 1

    def revoke_client(self, client_id: str, reason: str) -> int:
        cursor = self._db.execute(
            "UPDATE oauth_grants SET revoked_at = ?, revoked_reason = ? WHERE client_id = ? AND revoked_at IS NULL",
            (time.time(), reason, client_id),
        )
        return cursor.rowcount

    def revoke_everything(self, reason: str) -> int:
        """Every grant (and so every code and token) and every admin session."""
        self._begin()
        try:
            cursor = self._db.execute(
                "UPDATE oauth_grants SET revoked_at = ?, revoked_reason = ? WHERE revoked_at IS NULL",
                (time.time(), reason),
            )
            self._db.execute("DELETE FROM admin_sessions")
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        return cursor.rowcount

    def live_grants(self, grant_ids: Collection[str]) -> set[str]:
        """Those of `grant_ids` that are neither revoked nor expired (the MCP sessions they hold may stay)."""
        ids = list(grant_ids)
        now = time.time()
        live: set[str] = set()
        for start in range(0, len(ids), IDS_PER_QUERY):
            chunk = ids[start : start + IDS_PER_QUERY]
            marks = ",".join("?" * len(chunk))
            where = f"revoked_at IS NULL AND expires_at > ? AND grant_id IN ({marks})"
            sql = f"SELECT grant_id FROM oauth_grants WHERE {where}"  # noqa: S608 (placeholders only)
            live.update(row[0] for row in self._db.execute(sql, (now, *chunk)))
        return live

    def grants(self, *, include_revoked: bool = False) -> list[Grant]:
        sql = "SELECT grant_id, client_id, scopes, resource, created_at, expires_at, revoked_at FROM oauth_grants"
        if not include_revoked:
            sql += " WHERE revoked_at IS NULL"
        rows = self._db.execute(sql + " ORDER BY created_at").fetchall()
        return [Grant(r[0], r[1], tuple(r[2].split()), r[3], r[4], r[5], r[6]) for r in rows]

    def purge_expired(self) -> None:
        """Drop spent codes and dead tokens; revoked grants stay as history."""
        now = time.time()
        self._db.execute("DELETE FROM oauth_codes WHERE expires_at < ? - 86400", (now,))
        self._db.execute("DELETE FROM oauth_tokens WHERE expires_at < ?", (now,))
        self._db.execute("DELETE FROM admin_sessions WHERE expires_at < ?", (now,))

    # -- admin sessions ------------------------------------------------------------------------

    def new_admin_session(self, lifetime_s: float) -> tuple[str, str]:
        session, csrf = new_secret(), new_secret()
        self._db.execute(
            "INSERT INTO admin_sessions (digest, csrf, expires_at) VALUES (?, ?, ?)",
            (digest(session), csrf, time.time() + lifetime_s),
        )
        return session, csrf

    def admin_session_csrf(self, session: str) -> str | None:
        row = self._db.execute(
            "SELECT csrf FROM admin_sessions WHERE digest = ? AND expires_at > ?", (digest(session), time.time())
        ).fetchone()
        return None if row is None else str(row[0])

    def end_admin_session(self, session: str) -> None:
        self._db.execute("DELETE FROM admin_sessions WHERE digest = ?", (digest(session),))
