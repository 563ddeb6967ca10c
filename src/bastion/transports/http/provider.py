"""bastion's OAuth 2.1 authorization server provider: one administrator, opaque tokens, SQLite.

It implements the parts of `mcp.server.auth.provider.OAuthAuthorizationServerProvider` that the SDK's
registration handler and bearer middleware call (`register_client`, `get_client`, `load_access_token`),
plus what bastion's own authorize, token and revocation handlers need. The rules the SDK leaves to the
provider live here: registration caps and redirect-URI schemes, scope narrowing, single-use codes whose
replay revokes the grant, refresh rotation with reuse detection, tokens bound to one resource.
"""

from __future__ import annotations

import contextvars
import hmac
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Final

from mcp.server.auth.provider import AccessToken, RegistrationError
from mcp.shared.auth import OAuthClientInformationFull

from bastion.config import HttpConfig
from bastion.safety.errors import ResourceLimit
from bastion.tools.server import SCOPES
from bastion.transports.http.cimd import CimdFetcher, is_url_client_id
from bastion.transports.http.ratelimit import is_device_key
from bastion.transports.http.redirects import registration_problem
from bastion.transports.http.store import AUTHORIZATION_KEPT_S, AuthStore, IssuedTokens

logger = logging.getLogger("bastion.http.auth")

MAX_REDIRECT_URIS: Final = 5
MAX_NAME_CHARS: Final = 200
MAX_FIELD_CHARS: Final = 2000
MAX_METADATA_BYTES: Final = 16 * 1024
TRANSACTION_TTL_S: Final = AUTHORIZATION_KEPT_S
MAX_LOGIN_TRIES: Final = 5
"""Passwords one authorization request's login form takes; then it is closed and the app must start again."""
MAX_TRANSACTIONS: Final = 1000
"""Pending authorization requests in all; past it (or an address's own cap) a new one is refused: a flood
never drops a request in progress (issue 20). A browser with a device cookie has its own cap and is not
held by this one (only a login makes a device cookie, so a flood cannot multiply them)."""
_ALLOWED_GRANTS: Final = frozenset({"authorization_code", "refresh_token"})
_ALLOWED_AUTH_METHODS: Final = frozenset({"none", "client_secret_post", "client_secret_basic"})
_STRING_FIELDS: Final = (
    "client_uri",
    "logo_uri",
    "tos_uri",
    "policy_uri",
    "jwks_uri",
    "software_id",
    "software_version",
)

registering_ip: contextvars.ContextVar[str] = contextvars.ContextVar("registering_ip", default="unknown")


@dataclass
class Transaction:
    """One /authorize request waiting for the administrator: server-side, single use, bound to a browser."""

    txn_id: str
    client_id: str
    client_name: str
    redirect_uri: str
    scopes: tuple[str, ...]
    state: str | None
    code_challenge: str
    browser_digest: str
    checked: tuple[str, ...] = ()
    """The scopes the consent page ticks; the others in `scopes` are offered unticked."""
    address: str = ""
    """The rate-limit key (`ratelimit.address_key`) of the address that opened it: pending ones are capped per key."""
    csrf: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    authenticated: bool = False
    login_tries: int = 0
    """Passwords checked (or being checked) for it: at `MAX_LOGIN_TRIES` it is closed."""
    credential_version: str = ""
    """`AdminCredential.version()` at login: a password change since then voids the login."""
    created: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Endpoints:
    issuer: str
    resource: str
    aliases: tuple[str, ...] = ()
    """The same MCP URL under the other loopback names (localhost, 127.0.0.1, [::1]) of a loopback
    public_url: accepted as `resource`; tokens are still bound to `resource`."""

    @property
    def resource_metadata_url(self) -> str:
        return f"{self.issuer}/.well-known/oauth-protected-resource/mcp"

    def accepts_resource(self, value: str) -> bool:
        return value == self.resource or value in self.aliases


class BastionAuthProvider:
    """The provider: registration policy, transactions, codes, tokens."""

    def __init__(
        self, store: AuthStore, config: HttpConfig, endpoints: Endpoints, cimd: CimdFetcher | None = None
    ) -> None:
        self.store = store
        self.config = config
        self.endpoints = endpoints
        self.cimd = cimd if cimd is not None else CimdFetcher(config.app_callbacks)
        self._transactions: dict[str, Transaction] = {}

    # -- clients (called by the SDK's RegistrationHandler and by bastion's handlers) ------------------

    async def get_client(self, client_id: str) -> OAuthClientInformationFull | None:
        if is_url_client_id(client_id):
            return await self.cimd.client(client_id)
        if len(client_id) > 200:
            return None
        # A client unused for unused_client_ttl_s is gone even before a purge deletes its row.
        found = self.store.client(client_id, unused_ttl_s=self.config.unused_client_ttl_s)
        if found is None:
            return None
        return OAuthClientInformationFull.model_validate(found[0])

    def client_secret_digest(self, client_id: str) -> str | None:
        found = self.store.client(client_id, unused_ttl_s=self.config.unused_client_ttl_s)
        return None if found is None else found[1]

    async def register_client(self, client_info: OAuthClientInformationFull) -> None:
        """Apply bastion's registration policy, narrow the scope, and store the client (secret as a digest).

        Raises:
            RegistrationError: the metadata breaks a rule (400 to the client).
        """
        uris = [str(uri) for uri in client_info.redirect_uris or ()]
        if not uris:
            raise RegistrationError("invalid_redirect_uri", "redirect_uris is required")
        if len(uris) > MAX_REDIRECT_URIS:
            raise RegistrationError("invalid_redirect_uri", f"at most {MAX_REDIRECT_URIS} redirect URIs")
        for uri in uris:
            problem = registration_problem(uri, self.config.app_callbacks)
            if problem is not None:
                raise RegistrationError("invalid_redirect_uri", problem)
        if not set(client_info.grant_types) <= _ALLOWED_GRANTS:
            raise RegistrationError(
                "invalid_client_metadata", "grant_types may only be authorization_code, refresh_token"
            )
        if list(client_info.response_types) != ["code"]:
            raise RegistrationError("invalid_client_metadata", "response_types must be exactly ['code']")
        if client_info.token_endpoint_auth_method not in _ALLOWED_AUTH_METHODS:
            raise RegistrationError("invalid_client_metadata", "token_endpoint_auth_method is not supported")
        if client_info.client_name is not None and len(client_info.client_name) > MAX_NAME_CHARS:
            raise RegistrationError("invalid_client_metadata", f"client_name is longer than {MAX_NAME_CHARS}")
        for name in _STRING_FIELDS:
            value = getattr(client_info, name, None)
            if value is not None and len(str(value)) > MAX_FIELD_CHARS:
                raise RegistrationError("invalid_client_metadata", f"{name} is too long")
        if client_info.contacts is not None and (
            len(client_info.contacts) > 5 or any(len(c) > MAX_NAME_CHARS for c in client_info.contacts)
        ):
            raise RegistrationError("invalid_client_metadata", "at most 5 short contacts")
        # Unknown scopes (claude.ai asks for "claudeai") are dropped, never granted, never an error.
        asked = (client_info.scope or "").split()
        known = [scope for scope in SCOPES if scope in asked]
        client_info.scope = " ".join(known) if known else None
        info = client_info.model_dump(mode="json", exclude_none=True)
        secret = info.pop("client_secret", None)
        if len(json.dumps(info)) > MAX_METADATA_BYTES:
            raise RegistrationError("invalid_client_metadata", "client metadata is too large")
        self.store.add_client(client_info.client_id or "", info, secret, registering_ip.get())
        logger.info("registered OAuth client %s (%r)", client_info.client_id, client_info.client_name)

    # -- authorization transactions --------------------------------------------------------------------

    def start_transaction(
        self,
        client: OAuthClientInformationFull,
        *,
        redirect_uri: str,
        scopes: tuple[str, ...],
        checked: tuple[str, ...],
        state: str | None,
        code_challenge: str,
        browser_digest: str,
        address: str,
    ) -> Transaction:
        """A new pending request; the same browser's undecided one for the same client is replaced.

        Raises:
            ResourceLimit: this address (or the server) has too many pending requests; none is dropped.
        """
        self._expire_transactions()
        client_id = client.client_id or ""
        for old in list(self._transactions.values()):
            if old.browser_digest == browser_digest and old.client_id == client_id and not old.authenticated:
                del self._transactions[old.txn_id]  # a client's retry from the same browser
        cap = self.config.pending_authorizations_per_ip
        if sum(1 for t in self._transactions.values() if t.address == address) >= cap:
            raise ResourceLimit(
                f"{cap} authorization requests from this address are waiting: finish one, or wait for them to expire"
            )
        if len(self._transactions) >= MAX_TRANSACTIONS and not is_device_key(address):
            raise ResourceLimit("too many authorization requests are waiting: try again in a few minutes")
        txn = Transaction(
            txn_id=secrets.token_urlsafe(24),
            client_id=client_id,
            client_name=client.client_name or "",
            redirect_uri=redirect_uri,
            scopes=scopes,
            checked=checked,
            state=state,
            code_challenge=code_challenge,
            browser_digest=browser_digest,
            address=address,
        )
        self._transactions[txn.txn_id] = txn
        if not is_url_client_id(client_id):
            # Neither `clients prune` nor the table's eviction may remove it while this is pending.
            self.store.mark_authorizing(client_id)
        return txn

    def rebind_browser(self, old_digest: str, new_digest: str) -> None:
        """After a login the browser gets a new cookie: its pending requests follow it, and the old value
        (which an attacker may have planted) no longer opens any of them."""
        for txn in self._transactions.values():
            if hmac.compare_digest(txn.browser_digest, old_digest):
                txn.browser_digest = new_digest

    def transaction(self, txn_id: str) -> Transaction | None:
        self._expire_transactions()
        return self._transactions.get(txn_id)

    def finish_transaction(self, txn_id: str) -> Transaction | None:
        """Remove and return the transaction: it can be decided once."""
        self._expire_transactions()
        return self._transactions.pop(txn_id, None)

    def _expire_transactions(self) -> None:
        limit = time.monotonic() - TRANSACTION_TTL_S
        for txn_id in [t.txn_id for t in self._transactions.values() if t.created < limit]:
            del self._transactions[txn_id]

    def issue_code(self, txn: Transaction, scopes: tuple[str, ...]) -> str:
        """A code for the administrator's approval.

        Raises:
            NotFound: the client's registration is gone (deleted by hand, or expired): no grant is made.
        """
        return self.store.create_grant_with_code(
            client_id=txn.client_id,
            scopes=scopes,
            resource=self.endpoints.resource,
            redirect_uri=txn.redirect_uri,
            code_challenge=txn.code_challenge,
            code_lifetime_s=self.config.code_lifetime_s,
            grant_lifetime_s=self.config.grant_lifetime_s,
            registered=not is_url_client_id(txn.client_id),
        )

    def revoke_code_grant(self, code: str, reason: str) -> None:
        """Revoke the grant a code just issued belongs to (the code with it)."""
        record = self.store.code(code)
        if record is not None:
            self.store.revoke_grant(record.grant_id, reason)

    # -- tokens ------------------------------------------------------------------------------------------

    def redeem_code(self, code: str) -> IssuedTokens | None:
        return self.store.consume_code_and_issue(
            code,
            access_lifetime_s=self.config.access_token_lifetime_s,
            refresh_lifetime_s=self.config.refresh_token_lifetime_s,
        )

    def rotate(self, refresh_token: str, scopes: tuple[str, ...]) -> IssuedTokens | None:
        return self.store.rotate_refresh(
            refresh_token,
            scopes,
            access_lifetime_s=self.config.access_token_lifetime_s,
            refresh_lifetime_s=self.config.refresh_token_lifetime_s,
        )

    def revoke_grant(self, grant_id: str, reason: str) -> None:
        if self.store.revoke_grant(grant_id, reason):
            logger.warning("revoked grant %s: %s", grant_id, reason)

    async def load_access_token(self, token: str) -> AccessToken | None:
        """The SDK's bearer middleware calls this for every request to /mcp."""
        if not 20 <= len(token) <= 128:
            return None
        record = self.store.token(token, "access")
        now = time.time()
        if record is None or record.expires_at < now or record.grant_expires_at < now:
            return None
        if record.resource != self.endpoints.resource:
            # RFC 8707: a token for another resource is never accepted here.
            return None
        return AccessToken(
            token=token,
            client_id=record.client_id,
            scopes=list(record.scopes),
            expires_at=int(record.expires_at),
            resource=record.resource,
            # The grant is the principal: a session opened with one grant's token is refused with another's.
            subject=record.grant_id,
        )
