"""What the key's `restrict,from=,command=` line and dispatch.py refuse, seen from real clients.

What this proves: against Debian's OpenSSH server (StrictModes on) with the exact line
`bastion gateway authorized-keys` prints, the gateway key cannot, through the raw `ssh`
client nor through asyncssh, get a pty, forward ports or an agent, open sftp or scp, log
in interactively, connect from an address outside `from=`, or pass environment variables
to the action (even ones sshd was told to accept); every refusal that reaches dispatch.py
is exit 126 with a record in its log. What it does not prove: anything about other sshd
versions or configs (e.g. `PermitUserEnvironment yes`).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import asyncssh
import pytest

from .lab import SSHD, GatewayLab


def _records_for(lab: GatewayLab, request: str) -> list[dict[str, object]]:
    return [r for r in lab.dispatch_records() if r.get("request") == request]


@contextmanager
def ssh_agent(folder: os.PathLike[str]) -> Iterator[str]:
    """A real ssh-agent on a socket in `folder`; yields the socket path."""
    sock = os.path.join(str(folder), "agent.sock")
    agent = subprocess.Popen(["ssh-agent", "-D", "-a", sock], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 5
        while not os.path.exists(sock):
            assert time.monotonic() < deadline, "ssh-agent did not start"
            time.sleep(0.02)
        yield sock
    finally:
        agent.terminate()
        agent.wait(timeout=5)


def test_sshd_checks_the_key_file_modes(lab: GatewayLab, tmp_path: Path) -> None:
    """The lab's sshd runs with StrictModes on, and the check is live: a world-writable copy of the line fails.

    (World, not group: Debian's sshd lets a file be writable by the user's own one-member group.)
    """
    effective = subprocess.run(
        [SSHD, "-T", "-f", str(lab.root / "sshd_config")], capture_output=True, text=True, timeout=30, check=True
    ).stdout.splitlines()
    assert "strictmodes yes" in effective
    assert f"authorizedkeysfile {lab.authorized_keys}" in effective
    assert lab.ssh("status biscuit").returncode == 0
    loose = lab.keys_dir / "authorized_keys.loose"
    loose.write_text(lab.authorized_keys.read_text())
    loose.chmod(0o602)
    try:
        with lab.second_sshd("loose", "", authorized=loose) as port:
            argv = lab.ssh_argv()
            argv[argv.index("-p") + 1] = str(port)
            known = tmp_path / "known_hosts"
            known.write_text(f"[127.0.0.1]:{port} {lab.host_key_line}\n")
            argv = [a.replace(str(lab.known_hosts), str(known)) for a in argv]
            done = subprocess.run([*argv, "status biscuit"], capture_output=True, text=True, timeout=30, check=False)
        assert done.returncode == 255
        assert "Permission denied" in done.stderr
        assert "bad ownership or modes" in (lab.root / "sshd.loose.log").read_text()
    finally:
        loose.unlink()


def test_allowed_action_runs_with_argv_and_is_recorded(lab: GatewayLab) -> None:
    done = lab.ssh("status biscuit")
    assert (done.returncode, done.stdout) == (0, "biscuit: running\n")
    events = [r["event"] for r in _records_for(lab, "status biscuit")]
    assert events[-2:] == ["start", "end"]


def test_interactive_login_is_refused(lab: GatewayLab) -> None:
    before = lab.settled_count()
    done = lab.ssh()
    assert done.returncode == 126
    assert "interactive logins are not allowed" in done.stderr
    new = lab.dispatch_records()[before:]
    assert [r["event"] for r in new] == ["refused"]
    assert new[0]["request"] is None


@pytest.mark.anyio
async def test_asyncssh_interactive_login_is_refused(lab: GatewayLab) -> None:
    before = lab.settled_count()
    async with asyncssh.connect("127.0.0.1", **lab.asyncssh_options()) as conn:
        shell = await conn.create_process(stdin=asyncssh.DEVNULL)  # a shell request: no command
        await shell.wait_closed()
        stderr = await shell.stderr.read()
    assert shell.exit_status == 126
    assert "interactive logins are not allowed" in str(stderr)
    assert [(r["event"], r["request"]) for r in lab.dispatch_records()[before:]] == [("refused", None)]


def test_pty_is_refused(lab: GatewayLab) -> None:
    runs = len(lab.action_runs())
    done = lab.ssh("status biscuit", options=("-tt",))
    assert "PTY allocation request failed" in done.stderr
    assert done.returncode != 0
    assert len(lab.action_runs()) == runs


def test_local_port_forwarding_is_refused(lab: GatewayLab) -> None:
    data, err = lab.probe_local_forward()
    assert data == b""
    assert "administratively prohibited" in err


def test_remote_port_forwarding_is_refused(lab: GatewayLab) -> None:
    done = lab.ssh("-N", options=("-o", "ExitOnForwardFailure=yes", "-R", "0:127.0.0.1:9"), timeout=15)
    assert done.returncode == 255
    assert "remote port forwarding failed" in done.stderr.lower()


@pytest.mark.anyio
async def test_asyncssh_forwarding_and_pty_are_refused(lab: GatewayLab) -> None:
    before, runs = lab.settled_count(), len(lab.action_runs())
    async with asyncssh.connect("127.0.0.1", **lab.asyncssh_options()) as conn:
        with pytest.raises(asyncssh.ChannelOpenError):
            await conn.open_connection("127.0.0.1", lab.port)
        with pytest.raises(asyncssh.ChannelListenError):
            await conn.forward_remote_port("127.0.0.1", 0, "127.0.0.1", 9)
        with pytest.raises(asyncssh.ChannelOpenError):
            await conn.create_process("status biscuit", term_type="xterm")
    # The pty was refused before the command was sent: nothing reached dispatch.py.
    assert lab.settled_count() == before
    assert len(lab.action_runs()) == runs


@pytest.mark.anyio
async def test_asyncssh_agent_forwarding_is_refused(lab: GatewayLab, tmp_path: Path) -> None:
    with ssh_agent(tmp_path) as sock:
        log_before = len(lab.sshd_log.read_text())
        options = {**lab.asyncssh_options(), "agent_path": sock}
        async with asyncssh.connect("127.0.0.1", agent_forwarding=True, **options) as conn:
            done = await conn.run("env", check=False)
    assert done.exit_status == 0
    assert "SSH_AUTH_SOCK" not in str(done.stdout)
    assert "session_auth_agent_req: agent forwarding disabled" in lab.sshd_log.read_text()[log_before:]


@pytest.mark.anyio
async def test_asyncssh_sftp_is_refused(lab: GatewayLab) -> None:
    before = lab.settled_count()
    async with asyncssh.connect("127.0.0.1", **lab.asyncssh_options()) as conn:
        with pytest.raises(asyncssh.SFTPError):
            async with conn.start_sftp_client() as sftp:
                await sftp.listdir("/")
    assert [(r["event"], r["request"]) for r in lab.dispatch_records()[before:]] == [("refused", "internal-sftp")]


@pytest.mark.anyio
async def test_asyncssh_scp_is_refused(lab: GatewayLab, tmp_path: Path) -> None:
    source = tmp_path / "payload"
    source.write_text("evil")
    destination = "/tmp/bastion-scp-asyncssh-test"
    before = lab.settled_count()
    async with asyncssh.connect("127.0.0.1", **lab.asyncssh_options()) as conn:
        with pytest.raises(asyncssh.SFTPError):
            await asyncssh.scp(str(source), (conn, destination))
    assert not os.path.exists(destination)
    records = [(r["event"], r["request"]) for r in lab.dispatch_records()[before:]]
    assert records == [("refused", f"scp -t {destination}")]


def test_agent_forwarding_is_refused(lab: GatewayLab, tmp_path: Path) -> None:
    with ssh_agent(tmp_path) as sock:
        log_before = len(lab.sshd_log.read_text())
        done = lab.ssh("env", options=("-A", "-v"), agent=sock)
    assert done.returncode == 0
    assert "SSH_AUTH_SOCK" not in done.stdout
    assert "Requesting authentication agent forwarding" in done.stderr
    # sshd itself turned the request down (restrict implies no-agent-forwarding), before dispatch.py ran.
    assert "session_auth_agent_req: agent forwarding disabled" in lab.sshd_log.read_text()[log_before:]


def test_sftp_is_refused(lab: GatewayLab, tmp_path: os.PathLike[str]) -> None:
    before = lab.settled_count()
    argv = lab.ssh_argv()
    sftp = ["sftp", "-b", "-", *argv[1:-1], argv[-1]]
    sftp = [a if a != "-p" else "-P" for a in sftp]
    done = subprocess.run(sftp, input="ls /\n", capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode != 0
    new = lab.dispatch_records()[before:]
    assert [(r["event"], r["request"]) for r in new] == [("refused", "internal-sftp")]


@pytest.mark.parametrize("legacy", [False, True], ids=["scp-sftp", "scp-legacy"])
def test_scp_is_refused(lab: GatewayLab, tmp_path: os.PathLike[str], legacy: bool) -> None:
    source = os.path.join(str(tmp_path), "payload")
    with open(source, "w") as handle:
        handle.write("evil")
    before = lab.settled_count()
    argv = lab.ssh_argv()
    options = [a if a != "-p" else "-P" for a in argv[1:-1]]
    scp = ["scp", *(["-O"] if legacy else []), *options, source, f"{argv[-1]}:/tmp/bastion-scp-test"]
    done = subprocess.run(scp, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode != 0
    assert not os.path.exists("/tmp/bastion-scp-test")
    new = lab.dispatch_records()[before:]
    expected = "scp -t /tmp/bastion-scp-test" if legacy else "internal-sftp"
    assert [(r["event"], r["request"]) for r in new] == [("refused", expected)]


def test_address_outside_from_is_refused(lab: GatewayLab) -> None:
    before = lab.settled_count()
    done = lab.ssh("status biscuit", options=("-b", "127.0.0.2"))
    assert done.returncode == 255
    assert "Permission denied" in done.stderr
    assert lab.dispatch_records()[before:] == []
    assert "127.0.0.2" in lab.sshd_log.read_text()


@pytest.mark.anyio
async def test_asyncssh_address_outside_from_is_refused(lab: GatewayLab) -> None:
    before = lab.settled_count()
    with pytest.raises(asyncssh.PermissionDenied):
        await asyncssh.connect("127.0.0.1", local_addr=("127.0.0.2", 0), **lab.asyncssh_options())
    assert lab.dispatch_records()[before:] == []


def test_client_environment_never_reaches_the_action(lab: GatewayLab) -> None:
    """sshd is configured to accept BASTION_LEAK_* and LANG; the action still sees only dispatch's env."""
    runs = len(lab.action_runs())
    options = ("-o", "SetEnv=BASTION_LEAK_X=1 LD_PRELOAD=/tmp/evil.so LANG=xx_XX.EVIL", "-o", "SendEnv=LC_ALL")
    done = lab.ssh("env", options=options)
    assert done.returncode == 0
    env = lab.action_runs()[runs]["env"]
    assert env == {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}


@pytest.mark.anyio
async def test_asyncssh_environment_never_reaches_the_action(lab: GatewayLab) -> None:
    runs = len(lab.action_runs())
    async with asyncssh.connect("127.0.0.1", **lab.asyncssh_options()) as conn:
        done = await conn.run("env", env={"BASTION_LEAK_Y": "1", "LD_PRELOAD": "/tmp/evil.so"}, check=False)
    assert done.exit_status == 0
    assert set(lab.action_runs()[runs]["env"]) == {"PATH", "LANG"}


def test_path_argument_resolves_beneath_root(lab: GatewayLab) -> None:
    srv = lab.root / "target" / "srv"
    outside = lab.root / "target" / "srv-secret"
    outside.mkdir(exist_ok=True)
    (outside / "key").write_text("SECRET\n")
    link = srv / "biscuit" / "escape"
    if not link.is_symlink():
        link.symlink_to(outside)
    assert lab.ssh("show biscuit/VERSION").stdout == "v1.0.0\n"
    for attempt in ("show biscuit/escape/key", "show biscuit/../../srv-secret/key", "show /etc/passwd"):
        done = lab.ssh(attempt)
        assert done.returncode == 126, attempt
        assert "SECRET" not in done.stdout


def test_output_is_capped_on_the_host(lab: GatewayLab) -> None:
    done = lab.ssh("big")
    assert done.returncode == 0
    assert len(done.stdout) == 131072
    assert "output truncated" in done.stderr


@pytest.mark.anyio
async def test_action_timeout_kills_it(lab: GatewayLab) -> None:
    started = time.monotonic()
    async with asyncssh.connect("127.0.0.1", **lab.asyncssh_options()) as conn:
        with anyio.fail_after(20):
            done = await conn.run("sleep", check=False)
    assert done.exit_status == 124
    assert time.monotonic() - started < 15
