"""Run the server on a transport, telling the operator on stderr what it is doing."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING

import anyio

from bastion.app import build_server, build_services
from bastion.config import Config, HttpConfig
from bastion.logs import configure_logging
from bastion.safety.errors import ConfigError, Unavailable
from bastion.systemd import Notifier

if TYPE_CHECKING:
    import uvicorn
    from starlette.types import ASGIApp

    from bastion.transports.http.connections import FdLimits


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Stopped(SystemExit):
    """SIGTERM or SIGHUP arrived: unwind, so `finally` closes the services (mounts, sandboxes, audit)."""


def _stop(signum: int, _frame: FrameType | None) -> None:
    # The default action ends the process on the spot: every mount and sandbox disk would stay behind.
    raise Stopped(0)


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """While serving stdio: SIGTERM and SIGHUP (systemd stop, a closed terminal) end the server cleanly."""
    previous = {sig: signal.signal(sig, _stop) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def client_snippet(config_path: str) -> str:
    """The Claude Desktop / Claude Code `mcpServers` entry that spawns this server over stdio."""
    command = os.path.abspath(sys.argv[0]) if os.path.basename(sys.argv[0]) == "bastion" else "bastion"
    entry = {"mcpServers": {"bastion": {"command": command, "args": ["serve", "--config", config_path, "--stdio"]}}}
    return json.dumps(entry, indent=2)


def serve_stdio(config: Config, config_path: str) -> int:
    configure_logging(config.log_level)
    notifier = Notifier.from_environment()  # before anything starts a process that would inherit it
    services = build_services(config)
    server = build_server(services, caller="stdio")
    absolute = os.path.abspath(config_path)
    workspaces = ", ".join(f"{ws.id}={ws.path}" for ws in config.workspace)
    if sys.stdin.isatty():
        print(
            f"bastion: serving MCP over stdio from {absolute}\n"
            f"bastion: workspaces: {workspaces}; audit log: {config.audit_path}\n"
            "bastion: this process speaks JSON-RPC on stdin/stdout: an MCP client should start it.\n"
            "bastion: for Claude Desktop (claude_desktop_config.json) or Claude Code (.mcp.json), add:\n"
            f"{client_snippet(absolute)}\n"
            "bastion: press Ctrl-D or Ctrl-C to stop.",
            file=sys.stderr,
        )
    else:
        print(f"bastion: serving MCP over stdio from {absolute} (workspaces: {workspaces})", file=sys.stderr)
    try:
        with stop_signals():
            notifier.ready(f"serving MCP over stdio from {absolute}")
            anyio.run(_serve_until_stopped, server.run_stdio_async)
    except Stopped:
        pass
    finally:
        notifier.stopping()
        with _signals_ignored():
            services.close()
    return 0


async def _serve_until_stopped(serve: Callable[[], Awaitable[None]]) -> None:
    """Serve until the transport ends or SIGTERM/SIGHUP arrives. Once the loop runs, a signal cancels
    the serving task (raising from the handler could land inside a task group, as an exception
    group `except Stopped` never sees, and the server exited 1 with a traceback); before that,
    `stop_signals` covers the start."""
    loop = asyncio.get_running_loop()
    with anyio.CancelScope() as scope:
        for sig in _STOP_SIGNALS:
            loop.add_signal_handler(sig, scope.cancel)
        try:
            await serve()
        finally:
            for sig in _STOP_SIGNALS:
                loop.remove_signal_handler(sig)
                signal.signal(sig, _stop)  # asyncio leaves the default action, which ends the process at once


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """While the services close: a second SIGTERM must not cut the cleanup short (systemd's
    SIGKILL after its timeout still ends a cleanup that hangs)."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def http_connect_help(mcp_url: str) -> str:
    """How to point the usual clients at the HTTP endpoint."""
    return (
        f"bastion: MCP URL: {mcp_url}\n"
        "bastion: a client opens a browser where you log in with the admin password and approve it:\n"
        f"  Claude Code:    claude mcp add --transport http bastion {mcp_url}\n"
        f"  Claude Desktop: Settings > Connectors > Add custom connector, URL {mcp_url}\n"
        "                  (claude.ai and Claude Desktop connectors need a public https URL: see the README)\n"
        f"  MCP Inspector:  npx @modelcontextprotocol/inspector, transport Streamable HTTP, URL {mcp_url}"
    )


def is_loopback(host: str) -> bool:
    """Whether a host name or address names this machine only (localhost, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_listen(value: str) -> tuple[str, int]:
    """HOST:PORT (IPv6 in brackets) as (host, port); ConfigError with one line if it is not one."""
    host, sep, port = value.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--listen {value!r} must be HOST:PORT with a port from 1 to 65535, e.g. 127.0.0.1:8765")
    return host, int(port)


def listen_socket(host: str, port: int, backlog: int) -> socket.socket:
    """The HTTP listener's socket, bound and listening.

    Raises:
        Unavailable: the address is in use, not this machine's, or not allowed to this user.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose proto says TCP,
    # and accepted sockets inherit the listener's. With proto 0 every small response waited ~40 ms for a
    # delayed ACK (a preview request: 44 ms instead of 2.5).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        raise Unavailable(f"cannot listen on {host}:{port}: {why}") from None
    return sock


def _clean_stop_server(notifier: Notifier, status: str) -> type[uvicorn.Server]:
    import uvicorn

    from bastion.transports.http.connections import quiet_loop_errors

    class CleanStopServer(uvicorn.Server):
        """uvicorn re-raises a stop signal once it has shut down, so the signal's default action ends
        the process before `serve_http`'s `finally` closes the services: every sandbox disk, idmapped
        mount and tmpfs stayed mounted. This server forgets the signal instead; bastion then exits 0.
        It also tells systemd when it serves (the lifespan has run) and when it begins to stop."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                try:
                    yield
                finally:
                    self._captured_signals.clear()

        async def serve(self, sockets: list[socket.socket] | None = None) -> None:
            # asyncio logs a traceback for every accept() that runs out of descriptors: one line instead.
            asyncio.get_running_loop().set_exception_handler(quiet_loop_errors())
            await super().serve(sockets)

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            # A failed lifespan returns with should_exit set and nothing started: not ready.
            if self.started and not self.should_exit:
                notifier.ready(status)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            notifier.stopping()
            await super().shutdown(sockets)

    return CleanStopServer


def _uvicorn_config(app: ASGIApp, http: HttpConfig, listen: str, limits: FdLimits, *, preview: bool) -> uvicorn.Config:
    """A listener's uvicorn settings: the connection guards, timeouts and TLS both listeners share. The
    main one runs the server's lifespan and no WebSockets; the preview one WebSockets (wsproto) only."""
    import uvicorn

    from bastion.transports.http import connections

    host, port = parse_listen(listen)
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=connections.guarded_protocol(limits.cap, http.request_head_timeout_s, http.request_body_timeout_s),
        ws="wsproto" if preview else "none",
        ws_max_size=1 << 20,
        backlog=limits.backlog,
        timeout_keep_alive=connections.KEEP_ALIVE_S,
        h11_max_incomplete_event_size=connections.MAX_HEAD_BYTES,
        log_config=None,
        access_log=False,
        server_header=False,
        # uvicorn believes X-Forwarded-For from 127.0.0.1 unless told otherwise: only configured proxies.
        proxy_headers=bool(http.trusted_proxies),
        forwarded_allow_ips=list(http.trusted_proxies),
        lifespan="off" if preview else "on",
        ssl_certfile=str(http.tls_cert) if http.tls_cert else None,
        ssl_keyfile=str(http.tls_key) if http.tls_key else None,
        timeout_graceful_shutdown=2,
    )


async def _serve_both(
    main: uvicorn.Server, listener: socket.socket, preview_config: uvicorn.Config, preview_listener: socket.socket
) -> None:
    """Both listeners in one event loop (the sandboxes are this process's); the main one owns the signals."""
    import uvicorn

    class PreviewServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    preview = PreviewServer(preview_config)
    serving = asyncio.ensure_future(preview.serve(sockets=[preview_listener]))
    try:
        await main.serve(sockets=[listener])
    finally:
        preview.should_exit = True
        await serving


def serve_http(config: Config, config_path: str, listen: str | None = None) -> int:
    """Serve Streamable HTTP (and the authorization server) with uvicorn until interrupted."""
    from bastion.transports.http import connections
    from bastion.transports.http.app import build_http_app, build_preview_app, endpoints_for
    from bastion.transports.http.preview import HideTokens

    http = config.http
    host, port = parse_listen(listen or http.listen)
    endpoints = endpoints_for(config, listen)
    if not http.auth and not is_loopback(host):
        raise ConfigError("[http] auth = false is only allowed on a loopback listen address: turn auth on")
    if (http.tls_cert is None) != (http.tls_key is None):
        raise ConfigError("[http] tls_cert and tls_key go together: set both or neither")
    if http.auth and not config.admin_hash_path.exists():
        raise ConfigError(f"no admin password is set: run 'bastion admin set-password --config {config_path}' first")
    connections.raise_fd_limit()
    limits = connections.fd_limits(http.max_connections, listeners=1 if http.preview_listen is None else 2)
    # Bound before anything starts or prints: a port in use is one line and exit 1, not a banner then a trace.
    listener = listen_socket(host, port, limits.backlog)
    preview_listener = None
    if http.preview_listen is not None:
        try:
            preview_listener = listen_socket(*parse_listen(http.preview_listen), limits.backlog)
        except Unavailable:
            listener.close()
            raise
    configure_logging(config.log_level)
    notifier = Notifier.from_environment()  # before anything starts a process that would inherit it
    services = build_services(config)
    store = None
    try:
        server = build_server(services, caller="http")
        built = build_http_app(services, server, listen=listen)
        store = built.store
        print(f"bastion: serving MCP over HTTP from {os.path.abspath(config_path)} on {host}:{port}", file=sys.stderr)
        if not http.auth:
            warning = "bastion: WARNING: [http] auth = false: anyone reaching this address can call every tool"
            print(warning, file=sys.stderr)
        if http.public_url is not None and endpoints.issuer != http.public_url:
            print(
                f"bastion: public_url follows --listen: {endpoints.issuer} (the config has {http.public_url})",
                file=sys.stderr,
            )
        print(http_connect_help(endpoints.resource), file=sys.stderr)
        uv_config = _uvicorn_config(built.app, http, listen or http.listen, limits, preview=False)
        preview = None
        if http.preview_listen is not None:
            preview_app, preview_origin = build_preview_app(services, built, http.preview_listen)
            logging.getLogger("uvicorn.error").addFilter(HideTokens())
            preview = _uvicorn_config(preview_app, http, http.preview_listen, limits, preview=True)
            print(f"bastion: serving preview URLs at {preview_origin}", file=sys.stderr)
        # The preview socket listens already (bound above): a connection before its server runs waits in the backlog.
        main = _clean_stop_server(notifier, f"serving MCP over HTTP on {host}:{port}")(uv_config)
        if preview is None or preview_listener is None:
            main.run(sockets=[listener])
        else:
            asyncio.run(_serve_both(main, listener, preview, preview_listener))
    finally:
        notifier.stopping()  # sent once: uvicorn's shutdown sent it already unless the start failed
        listener.close()
        if preview_listener is not None:
            preview_listener.close()
        if store is not None:
            store.close()
        services.close()
    return 0
