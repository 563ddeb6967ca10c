"""Run the server on a transport, telling the operator on stderr what it is doing."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Final

import anyio

from bastion import heap
from bastion.config import Config, HttpConfig, split_listen
from bastion.logs import announce, configure_logging
from bastion.safety.errors import ConfigError, Unavailable
from bastion.safety.paths import file_replaceable_by, secret_file_problem
from bastion.sandbox.microvm import boot_files_problem
from bastion.systemd import Notifier

if TYPE_CHECKING:
    import uvicorn
    from starlette.types import ASGIApp

    from bastion.app import Services
    from bastion.transports.http.connections import FdLimits, UnsentWatch


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
"""Stop the server cleanly. SIGQUIT (Ctrl-\\ in a terminal) among them: found by attack, its default action ended
the process on the spot, 14 mounts, 2 loop devices and 20 cgroups left until the next start."""
_CLEANUP_SIGNALS = (*_STOP_SIGNALS, signal.SIGINT)
"""Ignored while the services close, and after: Ctrl-C too (found by review: pressed again during the HTTP
server's cleanup, it ended the process with every sandbox mounted). SIGKILL still ends a cleanup that hangs."""
_UNUSED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
"""Do nothing (the log is stderr: there is nothing to reopen). Found by attack: a logrotate habit's `kill -USR1`
ended the server as SIGQUIT did. A handler, not SIG_IGN, which sandboxed programs would inherit across exec."""


class Stopped(SystemExit):
    """SIGTERM, SIGHUP or SIGQUIT arrived: unwind, so `finally` closes the services (mounts, sandboxes, audit)."""


def _stop(signum: int, _frame: FrameType | None) -> None:
    # The default action ends the process on the spot: every mount and sandbox disk would stay behind.
    raise Stopped(0)


def _unused(signum: int, _frame: FrameType | None) -> None:
    """Nothing (`_UNUSED_SIGNALS`); not even a log line: a handler may run in the middle of one."""


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP (systemd stop, a closed terminal) end the server cleanly: from the start (recovery can
    take minutes), while stdio serves, and around uvicorn's own handling of them over HTTP. Left ignored at the
    end: what follows is the process's exit, which a repeated `systemctl stop` would turn into a kill."""
    for sig in _STOP_SIGNALS:
        signal.signal(sig, _stop)
    for sig in _UNUSED_SIGNALS:
        signal.signal(sig, _unused)
    try:
        yield
    finally:
        for sig in _CLEANUP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def client_snippet(config_path: str) -> str:
    """The Claude Desktop / Claude Code `mcpServers` entry that spawns this server over stdio."""
    command = os.path.abspath(sys.argv[0]) if os.path.basename(sys.argv[0]) == "bastion" else "bastion"
    entry = {"mcpServers": {"bastion": {"command": command, "args": ["serve", "--config", config_path, "--stdio"]}}}
    return json.dumps(entry, indent=2)


def serve_stdio(config: Config, config_path: str) -> int:
    """Serve MCP over stdio; with `[http] preview_listen`, the HTTP front (login, admin, previews) too."""
    from bastion.transports.stdio import wire_problem  # late, as the server's own imports below

    problem = wire_problem()
    if problem is not None:
        raise ConfigError(problem)
    check_boot_files(config)
    listeners = None if config.http.preview_listen is None else _Listeners(config, config_path, None)
    configure_logging(config.log_level, log_format=config.log_format)
    notifier = Notifier.from_environment()  # before anything starts a process that would inherit it
    if listeners is None:
        # No listener serves them: counting would cost every call for nothing.
        config = config.model_copy(update={"metrics": config.metrics.model_copy(update={"enabled": False})})
    services = front = None
    # From the start: recovery can take minutes, and a SIGTERM then ended the process on the spot. The cleanup
    # switches the handler to "ignore" within this block, so no default action comes in between.
    with stop_signals():
        try:
            from bastion.app import build_server, build_services  # late: a refused start skips 0.7 s of imports

            services = build_services(config)
            server = build_server(services, caller="stdio")
            _stdio_banner(config, config_path)
            serve: Callable[[], Awaitable[None]] = server.run_stdio_async
            if listeners is not None:
                front = _Front(services, listeners, None)
                announce(
                    f"bastion: the administrator logs in at {front.endpoints.issuer}/admin; "
                    f"preview URLs are served at {front.preview_origin}"
                )
                _warn_if_open(config)  # the HTTP front serves /mcp too: the user asked for stdio
                serve = functools.partial(_stdio_beside_http, server.run_stdio_async, front, listeners)
            heap.settle()
            notifier.ready(f"serving MCP over stdio from {os.path.abspath(config_path)}")
            anyio.run(_serve_until_stopped, serve)
        except Stopped:
            pass
        finally:
            _ignore_stop_signals()
            notifier.stopping()
            if listeners is not None:
                listeners.close()
            if front is not None:
                front.close()
            if services is not None:
                services.close()
    return 0


def _warn_if_open(config: Config) -> None:
    if not config.http.auth:
        logging.getLogger("bastion.serve").warning(
            "bastion: [http] auth = false: anyone reaching this address can call every tool"
        )


def _stdio_banner(config: Config, config_path: str) -> None:
    absolute = os.path.abspath(config_path)
    workspaces = ", ".join(f"{ws.id}={ws.path}" for ws in config.workspace)
    if sys.stdin.isatty() and config.log_format == "text":
        # A person at a terminal: help to read, not a log line.
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
        announce(f"bastion: serving MCP over stdio from {absolute} (workspaces: {workspaces})")


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


def _ignore_stop_signals() -> None:
    """From the cleanup to the exit: a second SIGTERM or Ctrl-C must not cut the cleanup short (systemd's
    SIGKILL after its timeout still ends a cleanup that hangs). Not restored after it: what follows is the
    exit (found by the repeated-signal test: a Ctrl-C between a restore and the exit ended the process 130)."""
    for sig in _CLEANUP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


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
    split = split_listen(value)
    if split is None:
        raise ConfigError(f"--listen {value!r} must be HOST:PORT with a port from 1 to 65535, e.g. 127.0.0.1:8765")
    return split


def listen_socket(host: str, port: int, backlog: int) -> socket.socket:
    """The HTTP listener's socket, bound and listening.

    Raises:
        Unavailable: the address is in use, not this machine's, or not allowed to this user.
    """
    try:
        return _bound(host, port, backlog)
    except OSError as exc:
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        raise Unavailable(f"cannot listen on {host}:{port}: {why}") from None


def _bound(host: str, port: int, backlog: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose proto says TCP,
    # and accepted sockets inherit the listener's. With proto 0 every small response waited ~40 ms for a
    # delayed ACK (a preview request: 44 ms instead of 2.5).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


LOOPBACK_ADDRESSES: Final = ("127.0.0.1", "::1")
"""What `localhost`, `127.0.0.1` and `[::1]` (one server for a loopback `public_url`) reach."""


def loopback_twins(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Listeners on the loopback addresses a loopback `host` does not bind itself, at the same port.

    A client may reach a loopback server as `localhost` or `[::1]` (the README says so), and only the
    address bound is the server's: any local user could bind the other (`[::1]:8765`, which `localhost`
    resolves to first on many hosts), pose as bastion's login page and take the password and bearer
    tokens. So the server holds them all. An address this machine does not have (no IPv6) is skipped:
    nobody can bind it either.

    Raises:
        Unavailable: another process holds one of them (named, with what to do).
    """
    if not is_loopback(host):
        return []
    taken = {"127.0.0.1" if host == "localhost" else host}  # `localhost` binds as IPv4 (`_bound`)
    twins: list[socket.socket] = []
    for address in LOOPBACK_ADDRESSES:
        if address in taken:
            continue
        try:
            twins.append(_bound(address, port, backlog))
        except OSError as exc:
            if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                continue
            for sock in twins:
                sock.close()
            shown = f"[{address}]" if ":" in address else address
            raise Unavailable(
                f"cannot listen on {shown}:{port} ({os.strerror(exc.errno or 0)}), which clients may use for this "
                f"server as localhost or {shown}: another process there could pose as it; stop that process "
                "or choose another port"
            ) from None
    return twins


def clean_stop_server(notifier: Notifier, status: str) -> type[uvicorn.Server]:
    import uvicorn

    from bastion.transports.http.connections import quiet_loop_errors

    class CleanStopServer(uvicorn.Server):
        """uvicorn re-raises a stop signal once it has shut down, so the signal's default action ends
        the process before `serve_http`'s `finally` closes the services: every sandbox disk, idmapped
        mount and tmpfs stayed mounted. This server forgets the signal instead; bastion then exits 0.
        It also tells systemd when it serves (the lifespan has run) and when it begins to stop."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn stops on SIGINT and SIGTERM only: SIGHUP (a closed terminal) and SIGQUIT stop it as they do.
            main = threading.current_thread() is threading.main_thread()
            extra = (signal.SIGHUP, signal.SIGQUIT)
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in extra} if main else {}
            try:
                with super().capture_signals():
                    try:
                        yield
                    finally:
                        self._captured_signals.clear()
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
                if main:
                    # uvicorn gave SIGINT back Python's handler: a Ctrl-C while asyncio.run cancels what is left
                    # (the lifespan) raised KeyboardInterrupt inside it, a traceback in the log (found by the
                    # repeated-signal test). What follows is the stop: the cleanup and the exit.
                    _ignore_stop_signals()

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
            await _cancelled_requests_finish(self)

    return CleanStopServer


CANCELLED_CLEANUP_S: Final = 10.0
"""How long the requests a graceful shutdown cancelled get to finish unwinding (a call's end record)."""


async def _cancelled_requests_finish(server: uvicorn.Server) -> None:
    """Wait, bounded, for the requests uvicorn's graceful shutdown cancelled: it returns without waiting
    for them, and once `serve` returns asyncio.run cancels what is left again, natively, through any
    anyio shield: a cancelled call writing its end record lost it (a start record without its end)."""
    running = [task for task in server.server_state.tasks if not task.done()]
    if running and server.force_exit:
        # A second Ctrl-C: uvicorn cancelled nothing, and this waited out the whole bound for requests still
        # running (found by attack: 10.3 s against 2 s for one Ctrl-C). They are cancelled, and unwind.
        for task in running:
            task.cancel()
    if running:
        await asyncio.wait(running, timeout=CANCELLED_CLEANUP_S)


def unsent_watch(http: HttpConfig) -> UnsentWatch:
    from bastion.transports.http import connections

    return connections.UnsentWatch(http.max_unsent_mib << 20, http.send_stall_timeout_s, connections.kept_limit())


def uvicorn_config(
    app: ASGIApp,
    http: HttpConfig,
    listen: str,
    limits: FdLimits,
    *,
    preview: bool,
    unsent: UnsentWatch | None = None,
) -> uvicorn.Config:
    """A listener's uvicorn settings: the connection guards, timeouts and TLS both listeners share. The
    main one runs the server's lifespan and no WebSockets; the preview one WebSockets (wsproto) only.
    `unsent`: the bound on unread answers the server's listeners share (one of this listener's own if None)."""
    import uvicorn

    from bastion.transports.http import connections
    from bastion.transports.http.bodies import MAX_MCP_BODY_BYTES

    host, port = parse_listen(listen)
    largest = http.preview_max_body_bytes if preview else MAX_MCP_BODY_BYTES
    unsent = unsent or unsent_watch(http)
    guarded = connections.guarded_protocol(
        limits.cap, http.request_head_timeout_s, http.request_body_timeout_s, largest, unsent
    )
    return uvicorn.Config(
        connections.HeadCap(app),
        host=host,
        port=port,
        http=guarded,
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


class _Listeners:
    """The bound sockets of the HTTP front: the main listener and, with `preview_listen`, the preview one."""

    def __init__(self, config: Config, config_path: str, listen: str | None) -> None:
        from bastion.transports.http import connections

        http = config.http
        self.listen = listen or http.listen
        self.host, self.port = parse_listen(self.listen)
        _check_http(config, config_path, listen)
        connections.raise_fd_limit()
        self.limits = connections.fd_limits(http.max_connections, listeners=1 if http.preview_listen is None else 2)
        # Bound before anything starts or prints: a port in use is one line and exit 1, not a banner then a trace.
        self.main = listen_socket(self.host, self.port, self.limits.backlog)
        self.twins: list[socket.socket] = []
        self.preview: socket.socket | None = None
        try:
            self.twins = loopback_twins(self.host, self.port, self.limits.backlog)
            if http.preview_listen is not None:
                self.preview = listen_socket(*parse_listen(http.preview_listen), self.limits.backlog)
        except Unavailable:
            self.close()
            raise

    @property
    def mains(self) -> list[socket.socket]:
        """The main listener and its loopback twins: one server."""
        return [self.main, *self.twins]

    def close(self) -> None:
        for sock in self.mains:
            sock.close()
        if self.preview is not None:
            self.preview.close()


def _check_http(config: Config, config_path: str, listen: str | None) -> None:
    """Refuse an HTTP front that cannot work or would be open to anyone.

    Raises:
        ConfigError: which setting to change, and how.
    """
    from bastion.transports.http.app import endpoints_for

    http = config.http
    host, _ = parse_listen(listen or http.listen)
    if not http.auth and not is_loopback(host):
        raise ConfigError("[http] auth = false is only allowed on a loopback listen address: turn auth on")
    plain = http.tls_cert is None and (http.public_url or "").startswith("http://")
    if plain and not is_loopback(host):
        # A plain-http public_url is loopback-only (the config refuses others), but any host reaching a
        # wildcard listen may send `Host: 127.0.0.1:PORT`: the password would cross the network in clear.
        raise ConfigError(
            f"listen address {listen or http.listen} would serve the password login in plain http beyond "
            "this machine: set [http] tls_cert and tls_key, or put a TLS reverse proxy in front and set "
            "[http] public_url to its https URL, or listen on 127.0.0.1"
        )
    endpoints_for(config, listen)  # a listen address its public_url cannot name is refused here
    if (http.tls_cert is None) != (http.tls_key is None):
        raise ConfigError("[http] tls_cert and tls_key go together: set both or neither")
    problem = None if http.tls_key is None else tls_key_problem(http.tls_key)
    if problem is None and http.tls_cert is not None:
        problem = tls_cert_problem(http.tls_cert)
    if problem is not None:
        raise ConfigError(problem)
    if http.auth and not config.admin_hash_path.exists():
        raise ConfigError(f"no admin password is set: run 'bastion admin set-password --config {config_path}' first")


def tls_key_problem(key: Path) -> str | None:
    """Why the server must not use `key` as its TLS private key, or None: anyone else who may read it can
    pose as this server, and anyone who may swap it can choose the key clients' secrets are sent under."""
    try:
        problem = secret_file_problem(str(key), (os.geteuid(), os.getegid()))
    except OSError as exc:
        return f"[http] tls_key {key} cannot be read: {exc.strerror or exc}"
    if problem is None:
        return None
    return (
        f"[http] tls_key {key} is not the server's alone ({problem}): chmod 600 it in a folder only root can "
        "write, or give bastion a copy of its own if other services share it"
    )


def tls_cert_problem(cert: Path) -> str | None:
    """Why the server must not present `cert`, or None. A certificate is public: who may read it does not
    matter. Who may replace it does: they would choose what the server shows clients as itself, and what it
    opens at start (a FIFO there hangs it; a certificate for another key stops TLS). It cannot make them the
    server: that takes the key, which `tls_key_problem` keeps the server's alone."""
    try:
        problem = file_replaceable_by(str(cert), (os.geteuid(), os.getegid()))
    except OSError as exc:
        return f"[http] tls_cert {cert} cannot be read: {exc.strerror or exc}"
    if problem is None:
        return None
    return (
        f"[http] tls_cert {cert} could be replaced by others ({problem}): make it root's (or the server's), "
        "chmod go-w it, in a folder only root can write"
    )


def check_boot_files(config: Config) -> None:
    """Refuse, at start, microVM boot files another user could change (each guest's start refuses them too).

    Raises:
        ConfigError: who could change them, and what to do.
    """
    if any(template.isolation == "microvm" for template in config.template):
        problem = boot_files_problem(config.sandboxes.microvm.image_dir)
        if problem is not None:
            raise ConfigError(problem)


class _Front:
    """The HTTP front's apps, built over `services`: uvicorn settings per listener and the auth store."""

    def __init__(self, services: Services, listeners: _Listeners, listen: str | None) -> None:
        from bastion.app import build_server
        from bastion.transports.http import connections
        from bastion.transports.http.app import build_http_app, build_preview_app
        from bastion.transports.http.preview import HideTokens

        http = services.config.http
        built = build_http_app(services, build_server(services, caller="http"), listen=listen)
        logging.getLogger("uvicorn.error").addFilter(connections.ShutdownCancels())
        logging.getLogger("uvicorn.error").addFilter(connections.QuietCuts())
        self.store = built.store
        self.endpoints = built.endpoints
        unsent = unsent_watch(http)
        self.main = uvicorn_config(built.app, http, listeners.listen, listeners.limits, preview=False, unsent=unsent)
        self.preview: uvicorn.Config | None = None
        self.preview_origin = ""
        if http.preview_listen is not None:
            preview_app, self.preview_origin = build_preview_app(services, built, http.preview_listen)
            logging.getLogger("uvicorn.error").addFilter(HideTokens())
            self.preview = uvicorn_config(
                preview_app, http, http.preview_listen, listeners.limits, preview=True, unsent=unsent
            )

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


def quiet_server() -> type[uvicorn.Server]:
    """A uvicorn server that leaves the signals alone (another server, or the stdio loop, owns them)."""
    import uvicorn

    class QuietServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            await super().shutdown(sockets)
            await _cancelled_requests_finish(self)

    return QuietServer


async def _serve_both(
    main: uvicorn.Server,
    listeners: list[socket.socket],
    preview_config: uvicorn.Config,
    preview_listener: socket.socket,
) -> None:
    """Both listeners in one event loop (the sandboxes are this process's); the main one owns the signals."""
    preview = quiet_server()(preview_config)
    serving = asyncio.ensure_future(preview.serve(sockets=[preview_listener]))
    try:
        await main.serve(sockets=listeners)
    finally:
        preview.should_exit = True
        await serving


async def _stdio_beside_http(serve_stdio: Callable[[], Awaitable[None]], front: _Front, listeners: _Listeners) -> None:
    """MCP over stdio while the HTTP front (login, admin pages, previews) serves in the same loop, so the
    preview listener reaches this process's sandboxes. The stdio loop owns the signals; when stdio ends
    (or a signal cancels it) the listeners stop too."""
    from bastion.transports.http.connections import quiet_loop_errors

    asyncio.get_running_loop().set_exception_handler(quiet_loop_errors())
    preview = [listeners.preview] if listeners.preview is not None else []
    pairs = [(front.main, listeners.mains), (front.preview, preview)]
    servers = [(quiet_server()(config), socks) for config, socks in pairs if config is not None and socks]
    serving = [asyncio.ensure_future(server.serve(sockets=socks)) for server, socks in servers]
    try:
        await serve_stdio()
    finally:
        for server, _ in servers:
            server.should_exit = True
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*serving, return_exceptions=True)


def serve_http(config: Config, config_path: str, listen: str | None = None) -> int:
    """Serve Streamable HTTP (and the authorization server) with uvicorn until interrupted."""
    check_boot_files(config)
    listeners = _Listeners(config, config_path, listen)
    configure_logging(config.log_level, log_format=config.log_format)
    notifier = Notifier.from_environment()  # before anything starts a process that would inherit it
    services = front = None
    # uvicorn handles SIGTERM once it serves (`clean_stop_server`); before that (recovery can take minutes) this
    # does. The cleanup switches the handler to "ignore" within this block, so no default action comes in between.
    with stop_signals():
        try:
            from bastion.app import build_services  # late: a refused start skips 0.7 s of imports

            services = build_services(config)
            front = _Front(services, listeners, listen)
            _serve_front(config, config_path, notifier, listeners, front)
        except (Stopped, KeyboardInterrupt):
            # A Ctrl-C once uvicorn has given SIGINT back its default handler (it stops on the first itself):
            # the stop is under way, and it ends as one (found by the repeated-signal test: exit 130).
            pass
        finally:
            # Found by attack: a second SIGTERM here ended the process on the spot, every sandbox still mounted.
            _ignore_stop_signals()
            notifier.stopping()  # sent once: uvicorn's shutdown sent it already unless the start failed
            listeners.close()
            if front is not None:
                front.close()
            if services is not None:
                services.close()
    return 0


def _serve_front(config: Config, config_path: str, notifier: Notifier, listeners: _Listeners, front: _Front) -> None:
    http = config.http
    where = f"{listeners.host}:{listeners.port}"
    announce(f"bastion: serving MCP over HTTP from {os.path.abspath(config_path)} on {where}")
    _warn_if_open(config)
    issuer = front.endpoints.issuer
    if http.public_url is not None and issuer != http.public_url:
        announce(f"bastion: public_url follows --listen: {issuer} (the config has {http.public_url})")
    announce(http_connect_help(front.endpoints.resource))
    if front.preview is not None:
        announce(f"bastion: serving preview URLs at {front.preview_origin}")
    main = clean_stop_server(notifier, f"serving MCP over HTTP on {where}")(front.main)
    heap.settle()
    if front.preview is None or listeners.preview is None:
        main.run(sockets=listeners.mains)
    else:
        asyncio.run(_serve_both(main, listeners.mains, front.preview, listeners.preview))
