"""`[metrics] token_file` as the server trusts it: judged as the other secrets are (`secret_file_problem`).

It was opened with a plain open, following links and waiting on a FIFO, and refused only when others could
read it by its mode bits. So uid 65534, owning the folder it sits in (a Prometheus user's, say), made it a
FIFO and root's `serve --http` hung at start for good; or wrote it themselves (0600, theirs) and chose the
token every scraper must present. Now `serve --http` refuses such a file with one line before it serves,
and `bastion doctor` fails `metrics-token` with the same line, without opening the file.

What this does not prove: anything about a token file that root itself gave away after the start (it is read
once, at start), nor about Prometheus' own copy of the token.
"""

from __future__ import annotations

import grp
import json
import os
import secrets
import signal
import socket
import stat
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bastion.transports.http.observe import scrape_token_problem
from tests.helpers import passable_folder, write_cheap_hash

from .live import BASTION, PASSWORD, free_port, write_config

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root"),
]

NOBODY = 65534
AS_NOBODY = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups"]
DEADLINE_S = 60.0
TOKEN = "nobody-chose-this-token-" + "0123456789abcdef" * 2


@pytest.fixture
def root_folder() -> Iterator[Path]:
    """A root folder (0755, in /tmp) every user may pass: a file's readers there are told by its mode."""
    with passable_folder() as folder:
        yield folder


def _nobodys_folder(root_folder: Path) -> Path:
    folder = root_folder / "prometheus"
    folder.mkdir()
    os.chown(folder, NOBODY, NOBODY)
    return folder


def _a_fifo_in_nobodys_folder(root_folder: Path) -> Path:
    token = _nobodys_folder(root_folder) / "scrape.token"
    subprocess.run([*AS_NOBODY, "mkfifo", "-m", "600", str(token)], check=True, timeout=30)
    return token


def _nobodys_own_file_in_their_folder(root_folder: Path) -> Path:
    token = _nobodys_folder(root_folder) / "scrape.token"
    shell = [*AS_NOBODY, "sh", "-c", f"umask 077; echo {TOKEN} > {token}"]
    subprocess.run(shell, check=True, timeout=30)
    return token


def _a_file_given_to_nobody(root_folder: Path) -> Path:
    token = root_folder / "scrape.token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    os.chown(token, NOBODY, NOBODY)
    return token


def _readable_by_all(root_folder: Path) -> Path:
    token = root_folder / "scrape.token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o644)
    return token


# What uid 65534 is given (returning the token_file configured), and the words naming who in the refusal.
ATTACKS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "a-fifo-in-nobodys-folder": (_a_fifo_in_nobodys_folder, "uid 65534, who owns {folder}/prometheus, and so"),
    "nobodys-own-file": (_nobodys_own_file_in_their_folder, "uid 65534, who owns {folder}/prometheus, and so"),
    "a-file-given-to-nobody": (_a_file_given_to_nobody, "uid 65534, who owns {token}"),
    "readable-by-all": (_readable_by_all, "any user: they may read {token}"),
}


def _config(tmp_path: Path, token: Path, port: int) -> Path:
    config = write_config(tmp_path / "demo", port)
    config.write_text(config.read_text() + f'\n[metrics]\ntoken_file = "{token}"\n')
    # Nothing else stops the start. Never checked here: a cheap argon2id (8 MiB, one pass) instead of 64 MiB.
    hash_path = tmp_path / "demo" / "state" / "admin-password.argon2"
    write_cheap_hash(hash_path, PASSWORD)
    return config


def _run(args: list[str], token: Path) -> subprocess.CompletedProcess[str]:
    """`args` run to their end. Still running after the deadline (waiting on a FIFO at `token`, or serving):
    the FIFO is given a writer, the process is stopped, and the test fails."""
    with subprocess.Popen(
        args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        try:
            out, err = process.communicate(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            if stat.S_ISFIFO(os.lstat(token).st_mode):
                writer = os.open(token, os.O_WRONLY | os.O_NONBLOCK)
                os.write(writer, f"{TOKEN}\n".encode())
                os.close(writer)
            process.send_signal(signal.SIGINT)  # a clean stop, even mid-start: its mounts are undone
            process.communicate(timeout=30)
            pytest.fail(f"{' '.join(args[:2])} did not end within {DEADLINE_S} s (waiting on {token}?)")
    return subprocess.CompletedProcess(args, process.returncode, out, err)


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_serve_refuses_a_scrape_token_another_user_could_choose_or_read(
    tmp_path: Path, root_folder: Path, attack: str
) -> None:
    """Attack (/tmp/hS/metrics_token.py): uid 65534 can choose the token (each way in ATTACKS), or read it.
    Invariant: `serve --http` exits 78 with one line naming the file and who, and never serves (a FIFO no longer
    hangs it); the token appears nowhere in its output, and the planted file is left as it was."""
    setup, words = ATTACKS[attack]
    token = setup(root_folder)
    before = os.lstat(token)
    port = free_port()
    config = _config(tmp_path, token, port)

    result = _run([str(BASTION), "serve", "--config", str(config), "--http"], token)

    assert result.returncode == 78, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"bastion: [metrics] token_file {token} is not the server's to trust ("), lines[0]
    assert words.format(folder=root_folder, token=token) in lines[0], lines[0]
    assert lines[0].endswith("mode 0640 at most (the group may be Prometheus')")
    assert TOKEN not in result.stdout + result.stderr
    assert not _listening(port)
    after = os.lstat(token)
    assert (after.st_ino, after.st_mode, after.st_uid, after.st_size) == (
        before.st_ino,
        before.st_mode,
        before.st_uid,
        before.st_size,
    )


def test_doctor_names_a_scrape_token_fifo_another_user_planted_without_opening_it(
    tmp_path: Path, root_folder: Path
) -> None:
    """The doctor fails `metrics-token` with serve's line (it did not check the file at all), judging the path
    without opening it: the FIFO uid 65534 planted does not hang it, and is left as it was."""
    token = _a_fifo_in_nobodys_folder(root_folder)
    config = _config(tmp_path, token, free_port())

    doctor = _run([str(BASTION), "doctor", "--json", "--config", str(config)], token)

    rows = {row["check"]: row for row in json.loads(doctor.stdout)}
    assert doctor.returncode == 1
    assert rows["metrics-token"]["status"] == "FAIL"
    assert rows["metrics-token"]["detail"] == scrape_token_problem(token)
    assert rows["metrics-token"]["detail"].startswith(
        f"[metrics] token_file {token} is not the server's to trust (uid 65534, who owns {root_folder}/prometheus"
    )
    assert stat.S_ISFIFO(os.lstat(token).st_mode)


def test_a_token_file_prometheus_reads_through_its_group_is_accepted_as_documented(root_folder: Path) -> None:
    """Not a refusal: the documented setup, root's token at mode 0640 with the scraper's group (here the
    daemon group, which has a member), passes: Prometheus reads the same file. Any user reading it does not."""
    token = root_folder / "scrape.token"
    token.write_text(secrets.token_hex(32) + "\n")
    os.chown(token, 0, grp.getgrnam("daemon").gr_gid)
    token.chmod(0o640)
    assert scrape_token_problem(token) is None
    token.chmod(0o644)
    assert scrape_token_problem(token) == (
        f"[metrics] token_file {token} is not the server's to trust (any user: they may read {token}): keep it "
        "in a folder only root can write, mode 0640 at most (the group may be Prometheus')"
    )


def test_a_root_token_file_only_root_may_read_is_accepted_and_a_link_to_it_is_not(root_folder: Path) -> None:
    """Not a refusal: root's 0600 token in a root folder passes, as serve and the doctor see it
    (tests/transports/http/test_observe.py serves /metrics with one). A link to it is refused: the file is
    opened without following one, so the doctor says so too."""
    token = root_folder / "scrape.token"
    token.write_text(secrets.token_hex(32) + "\n")
    token.chmod(0o600)
    assert scrape_token_problem(token) is None
    link = root_folder / "link.token"
    link.symlink_to(token)
    assert scrape_token_problem(link) == (
        f"[metrics] token_file {link} is a symbolic link: point token_file at the real file"
    )
