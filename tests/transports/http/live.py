"""A live `bastion serve --http` on loopback, and a scripted browser for its OAuth pages.

The server is the real command in a child process, with a demo config in a temporary folder; the tests
talk to it over TCP only. `Browser` plays the administrator's browser with plain HTTP (cookies, forms,
no JavaScript, which the pages do not use); the Chromium tests drive the same pages with a real browser.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import hashlib
import html.parser
import os
import re
import resource
import secrets
import signal
import sqlite3
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urljoin, urlsplit

import anyio
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from bastion.demo import init_demo
from bastion.transports.http.password import write_hash
from tests.helpers import client_tls, write_cheap_hash
from tests.helpers import free_port as free_port  # the HTTP tests take it from here

from .tls import self_signed

REPO = Path(__file__).resolve().parents[2]
BASTION = Path(sys.executable).with_name("bastion")
PASSWORD = "correct horse battery staple"
START_TIMEOUT_S = 30.0
LOOPBACK_CB_FOR_TESTS = "http://127.0.0.1/callback"


def pkce() -> tuple[str, str]:
    verifier = secrets.token_urlsafe(48)
    challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).decode().rstrip("=")
    return verifier, challenge


def write_config(root: Path, port: int, *, http_extra: str = "", auth: bool = True) -> Path:
    """A demo config for HTTP tests: sandboxes off, no cgroups (fast, and works unprivileged)."""
    path = init_demo(root)
    text = path.read_text()
    text = text.replace('path = "workspace"\n', 'path = "workspace"\nuse_cgroups = false\n', 1)
    text = re.sub(r"(?m)^\[sandboxes\]\nenabled = true", "[sandboxes]\nenabled = false", text)
    text = text.replace('log_level = "WARNING"', 'log_level = "INFO"')
    text = text.replace('public_url = "http://127.0.0.1:8765"', f'public_url = "http://127.0.0.1:{port}"')
    text = text.replace('listen = "127.0.0.1:8765"', f'listen = "127.0.0.1:{port}"')
    extra = http_extra + ("" if auth else "\nauth = false")
    text = text.replace("[http]\n", f"[http]\n{extra}\n", 1)
    path.write_text(text)
    return path


@dataclass
class LiveServer:
    root: Path
    port: int
    config_path: Path
    process: subprocess.Popen[bytes]
    log_path: Path
    tls: ssl.SSLContext | None = None
    """A client context trusting the server's certificate, when it serves https (`live_tls_server`)."""

    @property
    def base(self) -> str:
        scheme = "http" if self.tls is None else "https"
        return f"{scheme}://127.0.0.1:{self.port}"

    @property
    def mcp_url(self) -> str:
        return f"{self.base}/mcp"

    @property
    def db_path(self) -> Path:
        return self.root / "state" / "bastion.db"

    def db(self) -> sqlite3.Connection:
        return sqlite3.connect(self.db_path, isolation_level=None, timeout=10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def http(self, **kwargs: Any) -> httpx2.Client:
        kwargs.setdefault("verify", self.tls or client_tls())
        return httpx2.Client(base_url=self.base, timeout=30, **kwargs)

    def register(self, **metadata: Any) -> dict[str, Any]:
        body = {"redirect_uris": ["http://127.0.0.1/callback"], "token_endpoint_auth_method": "none"}
        body.update(metadata)
        with self.http() as client:
            response = client.post("/register", json=body)
        assert response.status_code == 201, response.text
        result: dict[str, Any] = response.json()
        return result

    def admin(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        """`bastion admin ARGS` on this server's config (another process, as the administrator's); it must succeed."""
        done = subprocess.run(
            [str(BASTION), "admin", *args, "--config", str(self.config_path)],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


TRUST_LOOPBACK_PROXY = 'trusted_proxies = ["127.0.0.1"]'


@contextlib.contextmanager
def live_server(
    root: Path,
    *,
    http_extra: str = "",
    auth: bool = True,
    nofile: int | None = None,
    behind_proxy: bool = False,
    cheap_hash: bool = False,
) -> Iterator[LiveServer]:
    """`nofile`: the server's open-file limit (soft and hard), for tests that exhaust it. `behind_proxy`:
    the server believes X-Forwarded-For from 127.0.0.1 (`trusted_proxies`), so a test plays other addresses.
    `cheap_hash`: the password is stored with `CHEAP_HASHER`, for tests whose subject is not the argon2 cost
    nor a race that needs a slow check."""
    if behind_proxy:
        http_extra = f"{http_extra}\n{TRUST_LOOPBACK_PROXY}"
    port = free_port()
    config_path = write_config(root, port, http_extra=http_extra, auth=auth)
    if auth:
        hash_file = root / "state" / "admin-password.argon2"
        if cheap_hash:
            write_cheap_hash(hash_file, PASSWORD)
        else:
            write_hash(hash_file, PASSWORD)
    with serve_config(root, config_path, port, nofile=nofile) as server:
        yield server


@contextlib.contextmanager
def live_tls_server(root: Path, *, http_extra: str = "", auth: bool = True) -> Iterator[LiveServer]:
    """`live_server` serving https, with a certificate made at test time (`LiveServer.tls` trusts it)."""
    cert, key = self_signed(root)
    port = free_port()
    extra = f'tls_cert = "{cert}"\ntls_key = "{key}"\n{http_extra}'
    config_path = write_config(root, port, http_extra=extra, auth=auth)
    text = config_path.read_text()
    config_path.write_text(text.replace(f'"http://127.0.0.1:{port}"', f'"https://127.0.0.1:{port}"'))
    if auth:
        write_hash(root / "state" / "admin-password.argon2", PASSWORD)
    with serve_config(root, config_path, port, tls=ssl.create_default_context(cafile=str(cert))) as server:
        yield server


@contextlib.contextmanager
def serve_config(
    root: Path, config_path: Path, port: int, *, nofile: int | None = None, tls: ssl.SSLContext | None = None
) -> Iterator[LiveServer]:
    """`bastion serve --http` on a config written by the caller (its `[http]` names 127.0.0.1:`port`);
    `tls`: it serves https, with a certificate this client context trusts."""
    log_path = root / "server.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [str(BASTION), "serve", "--config", str(config_path), "--http"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=None if nofile is None else lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile)),
        )
    server = LiveServer(root, port, config_path, process, log_path, tls)
    try:
        _wait_ready(server)
        yield server
    finally:
        server.stop()


def refused_start(config: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """`bastion serve --http` on `config`, expected to refuse at start; one that serves instead is stopped
    cleanly (SIGTERM: its mounts are undone) and fails the test."""
    args = [str(BASTION), "serve", "--config", str(config), "--http", *extra]
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        try:
            out, err = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.terminate()
            process.communicate(timeout=30)
            pytest.fail(f"bastion serve {' '.join(extra)} served instead of refusing to start")
    return subprocess.CompletedProcess(args, process.returncode, out, err)


def _wait_ready(server: LiveServer) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    with httpx2.Client(timeout=1, verify=server.tls or client_tls()) as client:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                raise RuntimeError(f"server exited: {server.log()}")
            try:
                client.get(f"{server.base}/.well-known/oauth-protected-resource")
                return
            except httpx2.TransportError:
                time.sleep(0.05)
    raise RuntimeError(f"server did not start: {server.log()}")


class _Forms(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.forms: list[dict[str, Any]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "form":
            self.forms.append({"action": a.get("action"), "fields": {}, "checkboxes": []})
        elif tag == "input" and self.forms:
            if a.get("type") == "hidden":
                self.forms[-1]["fields"][a.get("name")] = a.get("value") or ""
            elif a.get("type") == "checkbox":
                self.forms[-1]["checkboxes"].append(a.get("value"))


def forms(page: str) -> list[dict[str, Any]]:
    parser = _Forms()
    parser.feed(page)
    return parser.forms


@dataclass
class Browser:
    """The administrator's browser, scripted: cookies kept, redirects followed on our own origin only.

    Browsers treat http://127.0.0.1 as a secure context and send `Secure` (and `__Host-`) cookies to it;
    Python's cookie jar does not, so this class keeps the cookies itself.
    """

    server: LiveServer
    cookies: dict[str, str] = field(default_factory=dict)
    client: httpx2.Client = field(init=False)

    def __post_init__(self) -> None:
        self.client = self.server.http(event_hooks={"request": [self._send_cookies], "response": [self._keep]})

    def _send_cookies(self, request: httpx2.Request) -> None:
        request.headers.pop("cookie", None)
        if self.cookies:
            request.headers["cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())

    def _keep(self, response: httpx2.Response) -> None:
        for header in response.headers.get_list("set-cookie"):
            name, _, rest = header.partition("=")
            value = rest.split(";", 1)[0]
            if "max-age=0" in header.lower() or "expires=thu, 01 jan 1970" in header.lower():
                self.cookies.pop(name, None)
            else:
                self.cookies[name] = value
        self.client.cookies.clear()

    def close(self) -> None:
        self.client.close()

    def authorize_url(self, client_id: str, challenge: str, **params: str) -> str:
        query = {
            "response_type": "code",
            "client_id": client_id,
            "redirect_uri": "http://127.0.0.1/callback",
            "code_challenge": challenge,
            "code_challenge_method": "S256",
            "state": "st",
            "resource": self.server.mcp_url,
        }
        query.update(params)
        return f"/authorize?{urlencode({k: v for k, v in query.items() if v != '<omit>'})}"

    def open(self, url: str) -> httpx2.Response:
        """GET, following our own redirects; stops at a redirect that leaves the server."""
        response = self.client.get(url)
        while response.status_code in (302, 303) and self._ours(response.headers["location"]):
            response = self.client.get(response.headers["location"])
        return response

    def _ours(self, location: str) -> bool:
        return location.startswith(("/", self.server.base + "/"))

    def login(self, page: httpx2.Response, password: str = PASSWORD) -> httpx2.Response:
        form = forms(page.text)[0]
        return self.client.post(form["action"], data={**form["fields"], "password": password})

    def consent(
        self, page: httpx2.Response, decision: str = "approve", scopes: list[str] | None = None
    ) -> httpx2.Response:
        form = forms(page.text)[0]
        chosen = form["checkboxes"] if scopes is None else scopes
        data = [(k, v) for k, v in form["fields"].items()] + [("scope", s) for s in chosen] + [("decision", decision)]
        return self.client.post(
            form["action"], content=urlencode(data), headers={"content-type": "application/x-www-form-urlencoded"}
        )

    def approve(self, url: str, *, password: str = PASSWORD, scopes: list[str] | None = None) -> str:
        """Run login and consent for an /authorize URL; return where the browser is finally sent."""
        login_page = self.open(url)
        assert login_page.status_code == 200, login_page.text
        after_login = self.login(login_page, password)
        assert after_login.status_code == 303, after_login.text
        consent_page = self.open(after_login.headers["location"])
        assert consent_page.status_code == 200, consent_page.text
        decided = self.consent(consent_page, scopes=scopes)
        assert decided.status_code == 303, decided.text
        return str(decided.headers["location"])


def callback_params(location: str) -> dict[str, list[str]]:
    return parse_qs(urlsplit(location).query, keep_blank_values=True)


def get_tokens(
    server: LiveServer,
    client_id: str,
    *,
    scopes: list[str] | None = None,
    redirect_uri: str = "http://127.0.0.1/callback",
    **extra: str,
) -> dict[str, Any]:
    """The whole flow for a public client registered with `redirect_uri`: returns the token response."""
    verifier, challenge = pkce()
    browser = Browser(server)
    try:
        location = browser.approve(
            browser.authorize_url(client_id, challenge, redirect_uri=redirect_uri), scopes=scopes
        )
    finally:
        browser.close()
    return redeem_code(server, location, verifier, client_id, redirect_uri, **extra)


def redeem_code(
    server: LiveServer, callback: str, verifier: str, client_id: str, redirect_uri: str, **extra: str
) -> dict[str, Any]:
    """The token response for the code in `callback` (the URL the browser was sent back to); asserts 200."""
    with server.http() as client:
        response = client.post(
            "/token",
            data={
                "grant_type": "authorization_code",
                "code": callback_params(callback)["code"][0],
                "code_verifier": verifier,
                "client_id": client_id,
                "redirect_uri": redirect_uri,
                **extra,
            },
        )
    assert response.status_code == 200, response.text
    tokens: dict[str, Any] = response.json()
    return tokens


def absolute(server: LiveServer, location: str) -> str:
    return urljoin(server.base + "/", location)


def call_tool(mcp_url: str, token: str, name: str, arguments: dict[str, object]) -> dict[str, Any]:
    """One tools/call by a real MCP client with a bearer token, in an event loop of its own in a worker
    thread (the browser tests are sync, and Playwright's sync API runs a loop in this thread)."""
    with concurrent.futures.ThreadPoolExecutor(1) as worker:
        return worker.submit(anyio.run, _call_tool, mcp_url, token, name, arguments).result()


async def _call_tool(mcp_url: str, token: str, name: str, arguments: dict[str, object]) -> dict[str, Any]:
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60, verify=client_tls()) as http,
        Client(streamable_http_client(mcp_url, http_client=http)) as client,
    ):
        result = await client.call_tool(name, arguments)
    payload = result.structured_content
    assert payload is not None
    return dict(payload)
