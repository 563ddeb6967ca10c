"""`bastion admin set-password` while someone holding the old password logs in (found by attack, 2026-12-07).

A new password is how the administrator stops a leaked one: `set-password` revokes every grant, token and admin
session. The server checks a password in a worker thread (argon2) and only then acts on the login. A change that
landed during that check was taken for the login's own: the admin session was inserted after the CLI had emptied
the session table (6 rounds of 6: the whole dashboard, for the session's lifetime), and an OAuth login read the
password's version again after its check, got the new one, and its consent minted a grant nobody revoked (4 of 5).
Another attack: root's `set-password` on a state folder of the server's user left a hash file the server could
not read, and every login answered 500 with a traceback until a `chown` by hand.

What this proves, against a live `bastion serve --http` and the real CLI: a login checked against the old
password while the CLI replaced it is refused, and leaves no admin session and no live grant; the new password
then logs in. The order is made sure of, not timed: the old password's hash is made slow, the CLI runs once the
server is seen spending CPU on the check, and the check must still be running when the CLI has returned.
What it does not prove: the narrower window after a consent's check (the grant is asked about again once made;
by reading).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import httpx2
import pytest
from argon2 import PasswordHasher

from bastion.config import load_config
from bastion.transports.http.password import AdminCredential, write_hash
from tests.helpers import INITIALIZE_REQUEST, MCP_HEADERS

from .live import BASTION, PASSWORD, Browser, LiveServer, pkce, serve_config
from .test_negative import public_client

NEW_PASSWORD = "a brand new password after a leak"
CHECK_S = 2.0
"""About how long the old password's check takes: the CLI (an interpreter's start, its own argon2) runs within."""
WAIT_S = 60.0
"""The bound on any one wait (a failure, never a pace)."""


def slow_hash(path: Path, seconds: float) -> None:
    """Replace the admin hash with one of `PASSWORD` whose check takes about `seconds` (one lane, more passes)."""
    one = PasswordHasher(time_cost=1, memory_cost=65536, parallelism=1)
    encoded = one.hash(PASSWORD)
    started = time.perf_counter()
    one.verify(encoded, PASSWORD)
    passes = max(1, min(400, round(seconds / max(time.perf_counter() - started, 1e-3))))
    owner = path.stat()
    temp = path.with_name(path.name + ".slow")
    temp.write_text(PasswordHasher(time_cost=passes, memory_cost=65536, parallelism=1).hash(PASSWORD) + "\n")
    os.chown(temp, owner.st_uid, owner.st_gid)
    temp.chmod(0o600)
    temp.replace(path)


def cpu_s(pid: int) -> float:
    """The CPU time process `pid` has used (user and system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def set_password(server: LiveServer) -> None:
    done = subprocess.run(
        [str(BASTION), "admin", "set-password", "--config", str(server.config_path)],
        input=NEW_PASSWORD + "\n",
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr


class InBackground:
    """`work` run in a thread of its own; its answer once it has one."""

    def __init__(self, work: Callable[[], httpx2.Response]) -> None:
        self._answers: list[httpx2.Response] = []
        self._thread = threading.Thread(target=lambda: self._answers.append(work()), daemon=True)
        self._thread.start()

    def answered(self) -> bool:
        return bool(self._answers)

    def answer(self) -> httpx2.Response:
        self._thread.join(WAIT_S)
        assert self._answers, "the login never answered"
        return self._answers[0]


def login_during_set_password(server: LiveServer, login: Callable[[], httpx2.Response]) -> httpx2.Response:
    """`login` (with the old password) answered, having been checked while the CLI changed the password."""
    hash_path = load_config(server.config_path).admin_hash_path
    seconds = CHECK_S
    for _ in range(3):
        slow_hash(hash_path, seconds)
        before = cpu_s(server.process.pid)
        background = InBackground(login)
        deadline = time.monotonic() + WAIT_S
        while cpu_s(server.process.pid) - before < 0.2 and not background.answered():  # polled, not timed
            assert time.monotonic() < deadline, "the server never began the check"
            time.sleep(0.01)
        if background.answered():  # refused before its check (a busy server), or checked already: again
            answer = background.answer()
            assert answer.status_code in (429, 503), (answer.status_code, answer.text[:300])
            seconds *= 2
            continue
        set_password(server)
        within = not background.answered()
        answer = background.answer()
        if within:
            return answer
        write_hash(hash_path, PASSWORD)  # the check ended before the CLI did: a slower one, again
        seconds *= 2
    pytest.fail("the CLI never ran within the old password's check")


def live_admin_sessions(server: LiveServer) -> int:
    with server.db() as db:
        return int(db.execute("SELECT count(*) FROM admin_sessions WHERE expires_at > ?", (time.time(),)).fetchone()[0])


def live_grants(server: LiveServer) -> int:
    with server.db() as db:
        return int(db.execute("SELECT count(*) FROM oauth_grants WHERE revoked_at IS NULL").fetchone()[0])


def test_an_admin_login_checked_against_the_old_password_during_set_password_is_refused(
    start_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    with start_server() as server:
        attacker = Browser(server)
        try:
            # The page is opened with each try: its form is signed for the password it was shown under.
            answered = login_during_set_password(
                server, lambda: attacker.login(attacker.open("/admin/login"), PASSWORD)
            )
            assert answered.status_code == 403, answered.status_code
            assert "password changed" in answered.text
            assert live_admin_sessions(server) == 0
            assert attacker.open("/admin").url.path == "/admin/login"  # no session cookie that works
        finally:
            attacker.close()
        admin = Browser(server)
        try:
            assert admin.login(admin.open("/admin/login"), NEW_PASSWORD).status_code == 303
            assert live_admin_sessions(server) == 1
        finally:
            admin.close()


def test_an_oauth_login_checked_against_the_old_password_during_set_password_mints_no_grant(
    start_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    with start_server() as server:
        client_id = public_client(server)
        _, challenge = pkce()
        attacker = Browser(server)
        try:
            answered = login_during_set_password(
                server, lambda: attacker.login(attacker.open(attacker.authorize_url(client_id, challenge)), PASSWORD)
            )
            assert answered.status_code == 403, answered.status_code
            assert "password has changed" in answered.text
            assert "code=" not in answered.headers.get("location", "")
        finally:
            attacker.close()
        assert live_grants(server) == 0


@pytest.mark.skipif(shutil.which("strace") is None, reason="kills the CLI at a system call (make test-deps)")
def test_set_password_killed_between_its_hash_and_its_revocation_is_finished_before_any_token_is_served(
    start_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    """Found by attack (crash points): `set-password` wrote the new hash, then revoked every grant; killed in
    between (here by strace at its revocation's first write to the database), the new password was in force and
    a token issued before it still opened /mcp after a restart, listed by `admin tokens`. Invariant: the change
    is marked before its hash is written, and the next start (or `bastion admin` command) revokes every grant."""
    with start_server(cheap_hash=True) as server:
        token = server.admin("token", "--client", "ops", "--scope", "workbench").stdout.strip()
        cut = subprocess.run(
            [
                *("strace", "-f", "-qq", "-o", "/dev/null", "-P", f"{server.db_path}-wal"),
                *("-e", "trace=pwrite64", "-e", "inject=pwrite64:signal=KILL:when=1"),
                *(str(BASTION), "admin", "set-password", "--config", str(server.config_path)),
            ],
            input=NEW_PASSWORD + "\n",
            capture_output=True,
            text=True,
            timeout=WAIT_S,
            check=False,
        )
        assert cut.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL), cut
        config = load_config(server.config_path)
        assert AdminCredential(config.admin_hash_path).verify(NEW_PASSWORD) is not None  # the new one is in force
        assert live_grants(server) == 1  # not revoked: the CLI died first
    with serve_config(server.root, server.config_path, server.port) as again, again.http() as raw:
        bearer = {**MCP_HEADERS, "Authorization": f"Bearer {token}"}
        answered = raw.post("/mcp", json=INITIALIZE_REQUEST, headers=bearer)
        assert answered.status_code == 401, answered.status_code
        assert live_grants(again) == 0
        assert "password change was cut short before its revocation: 1 grant(s) revoked now" in again.log()


@pytest.mark.skipif(shutil.which("strace") is None, reason="pauses and kills the CLI at system calls (make test-deps)")
def test_an_admin_command_during_set_password_leaves_its_mark_to_it(
    start_server: Callable[..., AbstractContextManager[LiveServer]],
) -> None:
    """Found by review of the mark above: any `bastion admin` command (or a server's start) run while
    `set-password` was between its mark and its hash took the mark for a change cut short, revoked early and
    removed it; `set-password` killed after its hash then left no mark, and a token made meanwhile outlived the
    change. Invariant: a change under way holds its mark (flock); others leave it; a second `set-password` is
    refused in one line; the change cut short is finished at the next start, the meanwhile token revoked too."""
    with start_server(cheap_hash=True) as server:
        config = load_config(server.config_path)
        mark = config.admin_hash_path.with_name(config.admin_hash_path.name + ".changing")
        temp = config.admin_hash_path.with_name(config.admin_hash_path.name + ".tmp")
        # Paused 5 s at the rename of its new hash, then killed at its revocation's first write.
        cut = subprocess.Popen(
            [
                *("strace", "-f", "-qq", "-o", "/dev/null", "-P", str(temp), "-P", f"{server.db_path}-wal"),
                *("-e", "trace=rename,renameat,renameat2,pwrite64"),
                *("-e", "inject=rename,renameat,renameat2:delay_enter=5000000"),
                *("-e", "inject=pwrite64:signal=KILL:when=1"),
                *(str(BASTION), "admin", "set-password", "--config", str(server.config_path)),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            assert cut.stdin is not None
            cut.stdin.write(NEW_PASSWORD + "\n")
            cut.stdin.close()
            deadline = time.monotonic() + WAIT_S
            while not (mark.exists() and temp.exists()):  # polling, not timing: the CLI is at its rename
                assert time.monotonic() < deadline, "set-password never reached its hash's rename"
                time.sleep(0.02)
            token = server.admin("token", "--client", "ops", "--scope", "workbench").stdout.strip()
            second = subprocess.run(
                [str(BASTION), "admin", "set-password", "--config", str(server.config_path)],
                input="yet another password for the test\n",
                capture_output=True,
                text=True,
                timeout=WAIT_S,
                check=False,
            )
            assert second.returncode == 1, second.stderr
            assert second.stderr == "bastion: another 'bastion admin set-password' is under way: let it finish\n"
            assert mark.exists()
            cut.wait(timeout=WAIT_S)
        finally:
            if cut.poll() is None:
                cut.kill()
                cut.wait()
        assert cut.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)
        assert AdminCredential(config.admin_hash_path).verify(NEW_PASSWORD) is not None
    with serve_config(server.root, server.config_path, server.port) as again, again.http() as raw:
        bearer = {**MCP_HEADERS, "Authorization": f"Bearer {token}"}
        assert raw.post("/mcp", json=INITIALIZE_REQUEST, headers=bearer).status_code == 401
        assert live_grants(again) == 0
        assert not mark.exists()


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="root's CLI over another user's state folder")
def test_root_set_password_on_a_service_users_state_leaves_a_file_the_server_reads(tmp_path: Path) -> None:
    """Attack (or a plain mistake): root runs `set-password` on the state folder of a server running as its own
    user. Invariant: the new hash file is that user's, 0600, and the server's check reads it."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.chown(state, 65534, 65534)
    path = state / "admin-password.argon2"
    write_hash(path, PASSWORD)
    info = path.stat()
    assert (info.st_uid, info.st_gid, info.st_mode & 0o777) == (65534, 65534, 0o600)


def test_an_unreadable_hash_file_refuses_every_login_with_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The server's side of the attack above: a hash file it cannot read (here a folder: EISDIR even for root)
    was an uncaught error, a 500 and a traceback at every login. Invariant: no password passes, and the log
    says why once, not at each attempt."""
    path = tmp_path / "admin-password.argon2"
    path.mkdir()
    credential = AdminCredential(path)
    with caplog.at_level("ERROR", logger="bastion.http.password"):
        assert credential.verify(PASSWORD) is None
        assert credential.verify(PASSWORD) is None
        assert credential.version() == ""
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 1, lines
    assert "cannot be read" in lines[0]
