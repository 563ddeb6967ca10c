"""`[http] tls_cert` as the server trusts it: refused when another local user could replace it.

A certificate is public, so who may read it does not matter. Whoever may replace it chooses what the server
presents and what it opens at start, as root: a FIFO there hung `serve --http` (and `bastion doctor`) for
good, and a certificate for another key stopped TLS. It never lets them pose as the server: that needs the
key, which `tls_key_problem` already keeps the server's alone (tests/transports/http/test_serve.py).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bastion.serve import tls_cert_problem
from bastion.transports.http.password import write_hash
from tests.helpers import passable_folder

from .live import BASTION, PASSWORD, free_port, refused_start, write_config
from .tls import self_signed

BOB = (4242, 4242)

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another uid needs root"),
]


@pytest.fixture
def keys() -> Iterator[Path]:
    """A root folder (0755, in /tmp) holding a fresh certificate and its 0600 key: what the server may use."""
    with passable_folder() as folder:
        self_signed(folder)
        yield folder


def _in_bobs_folder(keys: Path) -> Path:
    bobs = keys / "bob"
    bobs.mkdir()
    (keys / "cert.pem").rename(bobs / "cert.pem")
    os.chown(bobs, *BOB)
    return bobs / "cert.pem"


def _writable_by_all(keys: Path) -> Path:
    (keys / "cert.pem").chmod(0o666)
    return keys / "cert.pem"


def _a_link_in_bobs_folder(keys: Path) -> Path:
    bobs = keys / "bob"
    bobs.mkdir()
    (bobs / "cert.pem").symlink_to(keys / "cert.pem")  # his to repoint
    os.chown(bobs, *BOB)
    return bobs / "cert.pem"


def _a_fifo_in_bobs_folder(keys: Path) -> Path:
    bobs = keys / "bob"
    bobs.mkdir()
    os.mkfifo(bobs / "cert.pem")  # opened as root at start: blocks until someone writes it
    os.chown(bobs, *BOB)
    return bobs / "cert.pem"


# What bob is given (returning the tls_cert configured), and the words naming him in the refusal.
ATTACKS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "in-a-folder-bob-owns": (_in_bobs_folder, "uid 4242, who owns {keys}/bob, and so could replace {cert}"),
    "writable-by-all": (_writable_by_all, "any user: they may write {cert}"),
    "a-link-in-bobs-folder": (_a_link_in_bobs_folder, "uid 4242, who owns {keys}/bob, and so could replace {cert}"),
    "a-fifo-in-bobs-folder": (_a_fifo_in_bobs_folder, "uid 4242, who owns {keys}/bob, and so could replace {cert}"),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_serve_refuses_a_tls_cert_another_user_could_replace(tmp_path: Path, keys: Path, attack: str) -> None:
    """Attack: another local user can replace the certificate (each way in ATTACKS). `serve --http` exits 78
    with one line naming who, before it listens (a FIFO no longer hangs it); the certificate and the key are
    left as they were, and the key's contents appear nowhere in the output."""
    setup, words = ATTACKS[attack]
    cert = setup(keys)
    key = keys / "key.pem"
    key_text = key.read_text()
    config = write_config(tmp_path / "demo", free_port(), http_extra=f'tls_cert = "{cert}"\ntls_key = "{key}"')
    write_hash(tmp_path / "demo" / "state" / "admin-password.argon2", PASSWORD)  # nothing else stops the start
    result = refused_start(config)
    assert result.returncode == 78, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"bastion: [http] tls_cert {cert} could be replaced by others ("), lines[0]
    assert words.format(keys=keys, cert=cert) in lines[0]
    assert key_text not in result.stdout + result.stderr
    assert key.read_text() == key_text
    assert os.path.lexists(cert)


def test_doctor_names_a_tls_cert_another_user_could_replace_without_opening_it(tmp_path: Path, keys: Path) -> None:
    """The doctor fails http-tls with serve's line, and judges the path before it opens anything there: a
    FIFO bob planted at it no longer hangs the doctor."""
    cert = _a_fifo_in_bobs_folder(keys)
    config = write_config(tmp_path / "demo", free_port(), http_extra=f'tls_cert = "{cert}"\ntls_key = "{keys}/key.pem"')
    doctor = subprocess.run(
        [str(BASTION), "doctor", "--json", "--config", str(config)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    rows = {row["check"]: row for row in json.loads(doctor.stdout)}
    assert doctor.returncode == 1
    assert rows["http-tls"]["status"] == "FAIL"
    assert rows["http-tls"]["detail"].startswith(f"[http] tls_cert {cert} could be replaced by others (uid 4242")


def test_a_root_certificate_anyone_may_read_is_served(tmp_path: Path, keys: Path) -> None:
    """Not a refusal: a certificate is public, so a root-owned 0644 one in a root folder passes the check
    (`test_builtin_tls` serves https with such a pair)."""
    (keys / "cert.pem").chmod(0o644)
    assert tls_cert_problem(keys / "cert.pem") is None
