"""The `mcp` SDK's own OAuth client (`OAuthClientProvider`), its browser played by a live server's `Browser`."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import httpx2
from mcp import Client
from mcp.client.auth import OAuthClientProvider
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.auth import AuthorizationCodeResult, OAuthClientInformationFull, OAuthClientMetadata, OAuthToken

from .live import Browser, LiveServer, callback_params


class MemoryStorage:
    def __init__(self) -> None:
        self.tokens: OAuthToken | None = None
        self.client_info: OAuthClientInformationFull | None = None

    async def get_tokens(self) -> OAuthToken | None:
        return self.tokens

    async def set_tokens(self, tokens: OAuthToken) -> None:
        self.tokens = tokens

    async def get_client_info(self) -> OAuthClientInformationFull | None:
        return self.client_info

    async def set_client_info(self, client_info: OAuthClientInformationFull) -> None:
        self.client_info = client_info


def sdk_provider(
    server: LiveServer,
    browser: Browser,
    storage: MemoryStorage,
    scope: str | None,
    log: list[str],
    approve: Callable[[str], str] | None = None,
) -> OAuthClientProvider:
    """The SDK's provider whose browser approves as the administrator would: `approve(authorize URL)` returns
    the callback location (by default the browser logs in and approves `scope`, unticking the rest)."""
    location: dict[str, str] = {}
    consent = scope.split() if scope else None

    def approved(url: str) -> str:
        return browser.approve(url, scopes=consent) if approve is None else approve(url)

    async def redirect_handler(url: str) -> None:
        log.append(url)
        location["value"] = await anyio.to_thread.run_sync(approved, url)

    async def callback_handler() -> AuthorizationCodeResult:
        params = callback_params(location["value"])
        return AuthorizationCodeResult(code=params["code"][0], state=params["state"][0], iss=params["iss"][0])

    metadata = OAuthClientMetadata.model_validate(
        {
            "client_name": "sdk test client",
            "redirect_uris": ["http://127.0.0.1/callback"],
            "grant_types": ["authorization_code", "refresh_token"],
            "response_types": ["code"],
            "token_endpoint_auth_method": "none",
            **({"scope": scope} if scope else {}),
        }
    )
    return OAuthClientProvider(server.mcp_url, metadata, storage, redirect_handler, callback_handler)


def mcp_client(server: LiveServer, http: httpx2.AsyncClient, mode: str) -> Client:
    return Client(streamable_http_client(server.mcp_url, http_client=http), mode=mode)
