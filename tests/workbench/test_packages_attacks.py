"""The private index's credentials in ``pip_index_url``: never on a command line, never in output or audit.

Every local user reads every process's /proc/<pid>/cmdline; /proc/<pid>/environ only the process's
own uid and root. The installs here use an index the egress proxy refuses (no registry rule for
it): pip runs, retries and fails, and nothing leaves the machine.
"""

from __future__ import annotations

import base64
import functools
import http.server
import json
import netrc
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar

import anyio
import pytest
from mcp import Client

from bastion.app import build_server, build_services
from bastion.config import load_config
from bastion.safety.errors import ConfigError
from bastion.workbench.packages import NpmRegistry, npm_registry, pip_index
from tests.helpers import call, create, sh

SECRET = "s3cr3tIndexToken"
INDEX = f"https://deploy:{SECRET}@registry.test/simple"


def with_index(demo_config_path: Path, url: str) -> Path:
    text = demo_config_path.read_text()
    demo_config_path.write_text(text.replace("[sandboxes.limits]", f"pip_index_url = {url!r}\n\n[sandboxes.limits]"))
    return demo_config_path


class ProcScan:
    """What a watcher with root's view of /proc saw while it ran: command lines, and the uids of the
    processes whose environment held the secret."""

    def __init__(self, needles: tuple[bytes, ...]) -> None:
        self.needles = needles
        self.cmdlines: list[str] = []
        self.environ_uids: set[int] = set()
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                    environ = Path(f"/proc/{pid}/environ").read_bytes()
                    uid = os.stat(f"/proc/{pid}").st_uid
                except OSError:
                    continue  # gone meanwhile
                if any(needle in cmdline for needle in self.needles):
                    self.cmdlines.append(cmdline.replace(b"\0", b" ").decode(errors="replace"))
                if any(needle in environ for needle in self.needles):
                    self.environ_uids.add(uid)


@contextmanager
def watching_proc(*needles: bytes) -> Iterator[ProcScan]:
    scan = ProcScan(needles or (SECRET.encode(),))
    thread = threading.Thread(target=scan.run, name="proc-scan", daemon=True)
    thread.start()
    try:
        yield scan
    finally:
        scan.stop.set()
        thread.join(timeout=30)
        assert not thread.is_alive()


@pytest.mark.anyio
@pytest.mark.bwrap
async def test_a_local_user_reads_the_private_index_password_from_pips_command_line(demo_config_path: Path) -> None:
    """Attack (pipcreds.py): while install_package runs with a credentialed pip_index_url, a neighbour
    polls every /proc/<pid>/cmdline for the password. Invariant: no process's command line holds it for
    the whole install; it is only in the environment of the sandbox's own processes (seen there, so
    the watch covered the install), and neither the result nor the audit log shows it.
    Does not prove pip uses the credentials (test_pip_reads_the_index_credentials_from_a_netrc_file)."""
    config = load_config(with_index(demo_config_path, INDEX))
    services = build_services(config)
    try:
        async with Client(build_server(services, caller="test")) as client:
            sandbox = await create(client)
            with watching_proc() as scan:
                result = await call(client, "install_package", name="tomli-w", sandbox_id=sandbox)
            closed = await call(client, "close_sandbox", sandbox_id=sandbox)
            assert closed["ok"], closed
    finally:
        services.close()
    assert result["code"] == "OPERATION_FAILED", result
    assert "registry.test" in result["detail"]["stdout"] + result["detail"]["stderr"], result
    assert scan.cmdlines == []
    assert scan.environ_uids, "the watch never saw the install's environment"
    first, count = config.sandboxes.host_ids
    if os.geteuid() == 0:  # a root server's sandboxes run as ids of their own: not root's, not a neighbour's
        assert all(first <= uid < first + count for uid in scan.environ_uids), scan.environ_uids
    assert SECRET not in json.dumps(result)
    assert SECRET not in (config.state_dir / "audit.jsonl").read_text()


# Stands in for the venv's python: records what pip would be given (its argv, the netrc NETRC names).
RECORDER = """#!/bin/sh
exec /usr/bin/python3 -I -c '
import json, netrc, os, sys
entry = netrc.netrc(os.environ["NETRC"]).authenticators("registry.test")
left = sorted(name for name, value in os.environ.items() if "tok" in value)
json.dump({"argv": sys.argv[1:], "netrc": entry, "env": left}, open("/workspace/seen.json", "w"))
' "$@"
"""


@pytest.mark.anyio
@pytest.mark.bwrap
async def test_pip_reads_the_index_credentials_from_a_netrc_file(demo_config_path: Path) -> None:
    """Invariant: pip is given the index URL without its credentials, and a netrc file (named by
    NETRC) holding them, percent-decoded, for the index's host alone; the variable that carried them
    is gone from pip's environment. Seen by a recorder at the venv's python, which pip runs from.
    The agent can do the same: the credentials are not a secret from the sandbox (SECURITY.md)."""
    config = load_config(with_index(demo_config_path, "https://deploy:tok%40en%23%22x@registry.test:8443/simple"))
    services = build_services(config)
    try:
        async with Client(build_server(services, caller="test")) as client:
            sandbox = await create(client)
            written = await call(client, "write_file", path=".venv/bin/python", content=RECORDER, sandbox_id=sandbox)
            assert written["ok"], written
            assert (await sh(client, sandbox, "chmod +x .venv/bin/python"))["ok"]
            result = await call(client, "install_package", name="tomli-w", sandbox_id=sandbox)
            assert result["ok"], result
            seen = json.loads((await sh(client, sandbox, "cat seen.json"))["detail"]["stdout"])
            left = (await sh(client, sandbox, "ls -A /tmp"))["detail"]["stdout"]
    finally:
        services.close()
    assert seen["netrc"] == ["deploy", "", 'tok@en#"x'], seen
    assert seen["env"] == [], seen
    argv = seen["argv"]
    assert argv[argv.index("--index-url") + 1] == "https://registry.test:8443/simple", argv
    assert "tok" not in " ".join(argv), argv
    assert left == "", "the netrc file was left in the sandbox's /tmp"


@pytest.mark.parametrize(
    ("url", "public", "entry"),
    [
        ("https://pypi.org/simple", "https://pypi.org/simple", None),
        ("https://u:p@h.example/simple", "https://h.example/simple", ("u", "", "p")),
        ("https://tok@h.example:444/x/simple/", "https://h.example:444/x/simple/", ("tok", "", "")),
        ("https://a%20b:c%5Cd%22e%23@h.example/s?x=1", "https://h.example/s?x=1", ("a b", "", 'c\\d"e#')),
        ("https://u:p@ss@h.example/simple", "https://h.example/simple", ("u", "", "p@ss")),
    ],
)
def test_index_credentials_split_into_a_netrc_entry(
    url: str, public: str, entry: tuple[str, str, str] | None, tmp_path: Path
) -> None:
    """As pip reads them (user and password percent-decoded, the last @ ends them); Python's own netrc
    parser gives them back for the host, quoted or not."""
    index = pip_index(url)
    assert index.url == public
    if entry is None:
        assert index.netrc is None
        return
    assert index.netrc is not None
    (tmp_path / "netrc").write_text(index.netrc + "\n")
    assert netrc.netrc(str(tmp_path / "netrc")).authenticators("h.example") == entry


@pytest.mark.parametrize("userinfo", ["u:a%0Ab", "u%00:p", "u:p%7F"])
def test_index_credentials_with_a_control_character_are_refused_at_load(demo_config_path: Path, userinfo: str) -> None:
    """A NUL cannot be in an environment variable, nor a line break in a netrc entry kept on one line."""
    with pytest.raises(ConfigError, match="percent-encodes a control character"):
        load_config(with_index(demo_config_path, f"https://{userinfo}@registry.test/simple"))


def with_registry(demo_config_path: Path, url: str) -> Path:
    text = demo_config_path.read_text()
    demo_config_path.write_text(text.replace("[sandboxes.limits]", f"npm_registry_url = {url!r}\n\n[sandboxes.limits]"))
    return demo_config_path


@pytest.mark.anyio
@pytest.mark.bwrap
async def test_a_local_user_reads_the_npm_registry_token_from_npms_command_line(demo_config_path: Path) -> None:
    """Attack (found by attack): with a credentialed npm_registry_url, npm ran with `--registry
    https://deploy:TOKEN@...` on its command line, which every local user reads (70 command lines seen, by
    uid 65534 too). The token is now only in the environment of the sandbox's own npm."""
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed on this machine (make test installs it)")
    config = load_config(with_registry(demo_config_path, f"https://deploy:{SECRET}@registry.test/"))
    services = build_services(config)
    try:
        async with Client(build_server(services, caller="test")) as client:
            sandbox = await create(client)
            as_basic_auth = base64.b64encode(f"deploy:{SECRET}".encode())
            with watching_proc(SECRET.encode(), as_basic_auth) as scan:
                result = await call(client, "install_package", name="left-pad", manager="npm", sandbox_id=sandbox)
            assert (await call(client, "close_sandbox", sandbox_id=sandbox))["ok"]
    finally:
        services.close()
    assert result["code"] == "OPERATION_FAILED", result
    assert scan.cmdlines == []
    assert scan.environ_uids, "the watch never saw the install's environment"
    first, count = config.sandboxes.host_ids
    if os.geteuid() == 0:
        assert all(first <= uid < first + count for uid in scan.environ_uids), scan.environ_uids
    assert SECRET not in json.dumps(result)
    assert SECRET not in (config.state_dir / "audit.jsonl").read_text()


class _Registry(http.server.BaseHTTPRequestHandler):
    seen: ClassVar[list[tuple[str, str | None]]] = []

    def do_GET(self) -> None:
        self.seen.append((self.path, self.headers.get("authorization")))
        self.send_response(404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.mark.parametrize("path", ["/npm/", "/a/./b/../npm/", "/npm"])
def test_npm_sends_the_registry_credentials_it_reads_from_its_environment(tmp_path: Path, path: str) -> None:
    """Invariant: the real npm, given the URL without credentials and `npm_registry`'s environment, sends
    them to the registry as it did from the URL (basic auth, percent-decoded), here to a loopback registry,
    also for a path npm normalises (found by review: a key written as the URL was spelt was not found)."""
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed on this machine (make test installs it)")
    _Registry.seen.clear()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Registry)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        registry = npm_registry(f"http://u%40x:p%3Ass@127.0.0.1:{port}{path}")
        assert registry.url == f"http://127.0.0.1:{port}{path}"
        env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "npm_config_cache": str(tmp_path / "cache")}
        argv = ["npm", "view", "left-pad", "--registry", registry.url, "--json"]
        subprocess.run(argv, env={**env, **registry.env}, capture_output=True, timeout=120, check=False)
    finally:
        server.shutdown()
        thread.join()
        server.server_close()
    expected = "Basic " + base64.b64encode(b"u@x:p:ss").decode()
    assert _Registry.seen, "npm asked the registry nothing"
    assert all(auth == expected for _, auth in _Registry.seen), _Registry.seen
    assert npm_registry("https://registry.npmjs.org/") == NpmRegistry("https://registry.npmjs.org/", {})


NERF_DART_JS = """
const fs = require("fs"), path = require("path");
const cli = path.dirname(fs.realpathSync(process.argv[1]));
const nerfDart = require(require.resolve("@npmcli/config/lib/nerf-dart.js", { paths: [cli] }));
console.log(JSON.stringify(JSON.parse(process.argv[2]).map(nerfDart)));
"""


def test_the_credentials_key_is_the_one_npm_derives_from_the_url() -> None:
    """Found by review: npm keys a registry's credentials by its `nerfDart` of the URL (host lower-cased,
    default port dropped, dot segments resolved); `npm_registry` must name the same key, or npm sends none.
    Checked against npm's own function, run by node."""
    npm, node = shutil.which("npm"), shutil.which("node")
    if npm is None or node is None:
        pytest.skip("npm is not installed on this machine (make test installs it)")
    urls = [
        "https://registry.corp:443/",
        "https://Registry.Corp/npm/registry",
        "http://h:80/a/./b/../npm/",
        "https://h:8443/a/b/..",
        "https://h/%7e/x/",
        "https://[::1]:8443/x",
        "https://h",
    ]
    ours = [npm_registry(url.replace("://", "://u:p@", 1)).env for url in urls]
    run = subprocess.run(
        [node, "-e", NERF_DART_JS, npm, json.dumps(urls)], capture_output=True, text=True, timeout=60, check=False
    )
    if "Cannot find module" in run.stderr:
        pytest.skip("this npm keeps @npmcli/config elsewhere")
    assert run.returncode == 0, run.stderr
    theirs = json.loads(run.stdout)
    assert [list(env) for env in ours] == [[f"npm_config_{key}:_auth"] for key in theirs]


@pytest.mark.anyio
@pytest.mark.bwrap
async def test_install_racing_close_leaves_no_egress_proxy_of_the_closed_sandbox(demo_config_path: Path) -> None:
    """Found by attack: install_package started, then close_sandbox at the next turn of the loop. The close
    found no proxy running yet and returned; the install then started one for the closed sandbox, which
    nothing stopped: a listener and its task for the server's life, 4 in 20 tries, repeatable at will.
    Invariant: once every such pair has answered, no proxy runs for a closed sandbox."""
    services = build_services(load_config(with_index(demo_config_path, INDEX)))
    try:
        async with Client(build_server(services, caller="test")) as client:
            closed: list[str] = []
            for _ in range(12):
                sandbox = await create(client)
                async with anyio.create_task_group() as tasks:
                    install = functools.partial(call, client, "install_package", name="tomli-w", sandbox_id=sandbox)
                    tasks.start_soon(install)
                    await anyio.sleep(0)
                    assert (await call(client, "close_sandbox", sandbox_id=sandbox))["ok"]
                closed.append(sandbox)
            assert not set(services.sandboxes.egress_proxies()) & set(closed)
    finally:
        services.close()
