"""`bastion template build` against a package index that needs credentials, on loopback (found 2026-12-06).

The attack: `[sandboxes] pip_index_url` may carry a user and token (``https://user:token@host/simple``).
The build ran pip on the host, as root, with that URL on its command line, which every local user can
read in /proc/<pid>/cmdline while pip runs. The index here is a real HTTPS server needing basic auth, and
pip is the real one of the venv the build makes: while pip fetches, the server reads every running pip's
command line and the netrc file its environment names.

What this proves: pip gets the credentials (the build installs the package) from a netrc file held in
memory (a memfd only pip's own fds reach), never from its command line, and never from a file on disk (one
in /tmp outlived a build killed by SIGTERM).
What it does not prove: sandboxes' installs (tests/workbench/test_packages_attacks.py).
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import os
import ssl
import subprocess
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bastion.cli import EXIT_FAILED, main
from tests.helpers import demo_config_at
from tests.transports.http.tls import self_signed

pytestmark = pytest.mark.root  # the netrc file is root's, as the build's is on a server

USER, TOKEN = "deploy", "s3cret-token-9f2c"
WHEEL_NAME = "tinyx-1.0-py3-none-any.whl"


def _wheel() -> bytes:
    """A one-module wheel, made here: the index serves nothing downloaded."""
    files = {
        "tinyx/__init__.py": b"X = 'from the private index'\n",
        "tinyx-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinyx\nVersion: 1.0\n",
        "tinyx-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }

    def digest(data: bytes) -> str:
        return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    record = "".join(f"{name},{digest(data)},{len(data)}\n" for name, data in files.items())
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
        wheel.writestr("tinyx-1.0.dist-info/RECORD", record + "tinyx-1.0.dist-info/RECORD,,\n")
    return buffer.getvalue()


@dataclass
class Seen:
    """What the index saw while pip fetched: each request's Authorization, the command line of each pip
    running from `python` (the build's venv; other tests run pips of their own) and the netrc files (what
    the fd named /dev/fd/N in their environment is, and its text) they read."""

    python: str
    authorizations: list[str | None] = field(default_factory=list)
    cmdlines: list[str] = field(default_factory=list)
    netrcs: list[tuple[str, str]] = field(default_factory=list)


def _running_pips(seen: Seen) -> None:
    """Note the build's running pips, as any local user could (the netrc file only as root)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        if argv[0].decode(errors="replace") != seen.python:
            continue
        seen.cmdlines.append(b" ".join(argv).decode(errors="replace"))
        for entry in environ:
            if entry.startswith(b"NETRC="):
                # /dev/fd/N is pip's own fd N: seen from here through /proc (as root only).
                path = entry.removeprefix(b"NETRC=").decode().replace("/dev/fd/", f"/proc/{pid}/fd/", 1)
                seen.netrcs.append((os.readlink(path), Path(path).read_text()))


@dataclass
class Index:
    url: str
    """With the credentials in it, as an administrator writes it in the config."""
    cert: Path
    lock: str
    seen: Seen


@pytest.fixture
def index(tmp_path: Path) -> Iterator[Index]:
    wheel = _wheel()
    seen = Seen(str(tmp_path / "demo" / "envs" / "private" / "bin" / "python"))
    expected = "Basic " + base64.b64encode(f"{USER}:{TOKEN}".encode()).decode()
    pages = {
        "/simple/tinyx/": (b"text/html", f'<a href="/files/{WHEEL_NAME}">{WHEEL_NAME}</a>'.encode()),
        f"/files/{WHEEL_NAME}": (b"application/octet-stream", wheel),
    }

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.authorizations.append(self.headers.get("Authorization"))
            _running_pips(seen)
            if self.headers.get("Authorization") != expected:
                self._answer(401, b"text/plain", b"", [("WWW-Authenticate", 'Basic realm="private"')])
            elif self.path in pages:
                self._answer(200, *pages[self.path], [])
            else:
                self._answer(404, b"text/plain", b"", [])

        def _answer(self, status: int, kind: bytes, body: bytes, headers: list[tuple[str, str]]) -> None:
            self.send_response(status)
            for name, value in [("Content-Type", kind.decode()), ("Content-Length", str(len(body))), *headers]:
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    cert, key = self_signed(tmp_path)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"https://{USER}:{TOKEN}@127.0.0.1:{server.server_address[1]}/simple"
        yield Index(url, cert, f"tinyx==1.0 --hash=sha256:{hashlib.sha256(wheel).hexdigest()}\n", seen)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _build(tmp_path: Path, index: Index, lock_text: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    lock = tmp_path / "private.lock"
    lock.write_text(lock_text)
    config = demo_config_at(tmp_path / "demo")
    text = config.read_text().replace("[sandboxes]\n", f'[sandboxes]\npip_index_url = "{index.url}"\n', 1)
    config.write_text(text + f'\n[[template]]\nname = "private"\npython_env = "envs/private"\npython_lock = "{lock}"\n')
    code = main(["template", "build", "private", "--config", str(config)])
    out, err = capsys.readouterr()
    return code, out + err


def test_template_build_keeps_index_credentials_off_pips_command_line(
    tmp_path: Path, index: Index, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack: another local user reads /proc/<pid>/cmdline of the root pip a template build runs, and
    takes the index's token. Now pip's command line names the index without it, and pip reads it from a
    netrc file only root can read, gone after the build."""
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(index.cert))  # pip trusts the test's certificate
    code, output = _build(tmp_path, index, index.lock, capsys)
    assert code == 0, output
    env = tmp_path / "demo" / "envs" / "private"
    imported = subprocess.run([env / "bin" / "python", "-c", "import tinyx; print(tinyx.X)"], capture_output=True)
    assert imported.stdout == b"from the private index\n"  # pip had the credentials

    seen = index.seen
    assert seen.cmdlines, "the index saw no pip running"
    assert all(TOKEN not in line and USER not in line for line in seen.cmdlines), seen.cmdlines
    assert all("--index-url https://127.0.0.1:" in line for line in seen.cmdlines), seen.cmdlines
    assert {target for target, _ in seen.netrcs} == {"/memfd:bastion-netrc (deleted)"}  # on no disk
    assert {text for _, text in seen.netrcs} == {f"machine 127.0.0.1 login {USER} password {TOKEN}\n"}
    assert TOKEN not in output


def test_a_failed_template_build_still_reads_its_netrc_from_memory(
    tmp_path: Path, index: Index, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """pip fails (a lock whose digest no file has): the build says so; the credentials were never on disk."""
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(index.cert))
    code, output = _build(tmp_path, index, "tinyx==1.0 --hash=sha256:" + "0" * 64 + "\n", capsys)
    assert code == EXIT_FAILED
    assert "pip could not install" in output
    assert index.seen.netrcs, "pip did not run with a netrc file"
    assert {target for target, _ in index.seen.netrcs} == {"/memfd:bastion-netrc (deleted)"}
    assert TOKEN not in output
