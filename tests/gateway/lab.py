"""A production host in a temp folder: Debian's real OpenSSH server on a loopback port.

`GatewayLab.start(root)` generates a host key, writes a bastion config with a gateway
pointing at it, makes the gateway's key and the authorized_keys line with bastion's own
CLI (`bastion gateway keygen`, `authorized-keys`, `dispatch-script`), writes a target-side
dispatch.toml whose actions run a small test program, and starts `sshd -D` with that
authorized_keys file. sshd keeps its default `StrictModes yes`: the authorized_keys file
sits in a private folder whose every parent sshd accepts (not under the world-writable
/tmp), as on a real host. Keys exist only in temporary folders. Used by tests/gateway,
tests/attacks/test_gateway_attacks.py and bench/bench_gateway.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bastion.cli import main
from bastion.config import load_config
from tests.helpers import free_port, processes_with

SSHD = "/usr/sbin/sshd"
USER = pwd.getpwuid(os.geteuid()).pw_name

# The action program on the "production host": records every run, answers per verb.
ACTION_PROGRAM = """\
#!/usr/bin/python3 -I
import json, os, sys, time
verb = sys.argv[1]
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "actions.log"), "a") as log:
    log.write(json.dumps({"argv": sys.argv[1:], "env": dict(os.environ), "tty": os.isatty(0) or os.isatty(1)}) + "\\n")
if verb == "status":
    print(f"{sys.argv[2]}: running")
elif verb == "logs":
    for i in range(int(sys.argv[3])):
        print(f"{sys.argv[2]} log line {i}")
elif verb == "deploy":
    print(f"deployed {sys.argv[2]} {sys.argv[3]}")
elif verb == "env":
    print(json.dumps(dict(os.environ), sort_keys=True))
elif verb == "big":
    sys.stdout.write("x" * 300000)
elif verb == "leak":
    print("db password=hunter2-very-secret-value")
elif verb == "edge":
    # A token straddling bastion's 65536-character cap: cut first, its prefix would not look like one.
    sys.stdout.write("x" * (65536 - len(" ghp_a1B2c3D")) + " ghp_a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8\\n")
elif verb == "fail":
    print("about to fail", file=sys.stderr)
    sys.exit(3)
elif verb == "show":
    print(open(sys.argv[2]).read().strip())
elif verb == "forge":
    # It ran, then exits with dispatch's refusal or timeout status after a line that looks like dispatch's:
    # whole after output (plain), left open (nolf), ending in a PEM header that redaction swallows to the
    # end (pem), or straddling bastion's 64 KiB output cap (cap).
    status, mode = int(sys.argv[2]), sys.argv[3]
    line = "dispatch: refused: project biscuit is not allowed here" if status == 126 else "dispatch: timeout: 1 s"
    if mode == "plain":
        print("migrated schema to 42")
        sys.stderr.write(line + "\\n")
    elif mode == "nolf":
        sys.stderr.write("migrating...\\n" + line)
    elif mode == "pem":
        sys.stderr.write("migrating...\\n" + line + " -----BEGIN RSA PRIVATE KEY-----\\n")
    else:
        sys.stderr.write("migrating...\\n" * 100 + line + " " * 70000 + "\\n")
    sys.exit(status)
elif verb == "sleep":
    time.sleep(30)
elif verb == "noisy":
    # More stderr than bastion keeps, then past the host's time limit: dispatch's verdict comes after it all.
    sys.stderr.write("noise\\n" * 20000)
    sys.stderr.flush()
    time.sleep(30)
"""


def _bastion(*args: str) -> str:
    """The CLI's output, run in this process: each lab start ran three, about 1.5 s of interpreter start and
    imports each (`test_install.py` tests the commands themselves)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    if code != 0:
        raise RuntimeError(f"bastion {' '.join(args)} failed: {err.getvalue().strip()}")
    return out.getvalue()


@dataclass
class GatewayLab:
    root: Path
    port: int
    host_key_line: str
    config_path: Path
    key_path: Path
    authorized_line: str
    keys_dir: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def dispatch_log(self) -> Path:
        return self.root / "target" / "dispatch.jsonl"

    @property
    def actions_log(self) -> Path:
        return self.root / "target" / "actions.log"

    @property
    def sshd_log(self) -> Path:
        return self.root / "sshd.log"

    @property
    def known_hosts(self) -> Path:
        return self.root / "known_hosts"

    def settled_count(self, timeout_s: float = 30.0) -> int:
        """How many dispatch records there are once no dispatch.py of this lab still runs.

        An earlier test may leave one running (a caller that gave up before the action's own
        timeout); its late record must not be counted as the next test's.
        """
        marker = str(self.root)
        deadline = time.monotonic() + timeout_s
        while processes_with(marker + "/target/dispatch.py") and time.monotonic() < deadline:
            time.sleep(0.05)
        return len(self.dispatch_records())

    def dispatch_records(self) -> list[dict[str, Any]]:
        if not self.dispatch_log.exists():
            return []
        return [json.loads(line) for line in self.dispatch_log.read_text().splitlines()]

    def action_runs(self) -> list[dict[str, Any]]:
        if not self.actions_log.exists():
            return []
        return [json.loads(line) for line in self.actions_log.read_text().splitlines()]

    def ssh_argv(self, *extra: str, agent: str = "none") -> list[str]:
        """The raw OpenSSH client with the gateway key and the pinned host key, no user config."""
        return [
            "ssh",
            "-F",
            "/dev/null",
            "-i",
            str(self.key_path),
            "-p",
            str(self.port),
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            f"IdentityAgent={agent}",
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            f"UserKnownHostsFile={self.known_hosts}",
            "-o",
            "GlobalKnownHostsFile=/dev/null",
            "-o",
            "ConnectTimeout=10",
            *extra,
            f"{USER}@127.0.0.1",
        ]

    def ssh(
        self, *command: str, options: tuple[str, ...] = (), timeout: float = 30, agent: str = "none"
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.ssh_argv(*options, agent=agent), *command],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def probe_local_forward(self) -> tuple[bytes, str]:
        """Run `ssh -N -L` to the sshd itself, connect through it; return what came back and ssh's stderr."""
        local = free_port()
        forward = subprocess.Popen(
            self.ssh_argv("-N", "-L", f"{local}:127.0.0.1:{self.port}"), stderr=subprocess.PIPE, text=True
        )
        try:
            deadline = time.monotonic() + 15
            while True:
                try:
                    conn = socket.create_connection(("127.0.0.1", local), timeout=1)
                    break
                except OSError:
                    if time.monotonic() > deadline or forward.poll() is not None:
                        raise RuntimeError("ssh -L never listened") from None
                    time.sleep(0.05)
            with conn:
                conn.settimeout(10)
                # Through a working forward this would be sshd's banner.
                data = conn.recv(100)
        finally:
            forward.terminate()
            try:
                _, err = forward.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                forward.kill()
                _, err = forward.communicate()
        return data, err

    def asyncssh_options(self) -> dict[str, Any]:
        import asyncssh

        return {
            "port": self.port,
            "username": USER,
            "known_hosts": ([asyncssh.import_public_key(self.host_key_line)], [], []),
            "client_keys": [asyncssh.read_private_key(str(self.key_path))],
            "config": None,
            "agent_path": None,
        }

    @property
    def authorized_keys(self) -> Path:
        return self.keys_dir / "authorized_keys"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.keys_dir, ignore_errors=True)

    def restart_sshd(self) -> None:
        """Start the lab's sshd again after a test ended it (same config, port, keys and log)."""
        self.process = _start_sshd(self.root / "sshd_config", self.sshd_log, self.port)

    @classmethod
    def start(cls, root: Path) -> GatewayLab:
        if not os.path.exists(SSHD):
            raise RuntimeError("openssh-server is not installed: run 'make install'")
        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o755)
        target = root / "target"
        (target / "bin").mkdir(parents=True)
        (target / "srv" / "biscuit").mkdir(parents=True)
        (target / "srv" / "biscuit" / "VERSION").write_text("v1.0.0\n")
        (root / "workspace").mkdir()
        (root / "state").mkdir(mode=0o700)
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "host_ed25519")], check=True, timeout=30
        )
        host_key_line = " ".join((root / "host_ed25519.pub").read_text().split()[:2])
        port = free_port()

        program = target / "bin" / "action"
        program.write_text(ACTION_PROGRAM)
        program.chmod(0o755)
        dispatch = target / "dispatch.py"
        _bastion("gateway", "dispatch-script", "--output", str(dispatch))
        (target / "dispatch.toml").write_text(_dispatch_toml(target, program))

        config_path = root / "bastion.toml"
        config_path.write_text(_bastion_toml(port, host_key_line, target))
        _bastion("gateway", "keygen", "--config", str(config_path), "biscuit")
        printed = _bastion("gateway", "authorized-keys", "--config", str(config_path), "biscuit")
        line = printed.rstrip("\n")
        if printed != line + "\n" or "\n" in line:
            raise RuntimeError(f"authorized-keys printed more than one line: {printed!r}")
        keys_dir = _strict_modes_folder()
        authorized = keys_dir / "authorized_keys"
        authorized.write_text(printed)  # exactly what the command printed
        authorized.chmod(0o600)
        (root / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_key_line}\n")
        (root / "sshd_config").write_text(_sshd_config(root, port, authorized))
        if os.geteuid() == 0:
            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation folder

        lab = cls(
            root=root,
            port=port,
            host_key_line=host_key_line,
            config_path=config_path,
            key_path=root / "state" / "biscuit_ed25519",
            authorized_line=line,
            keys_dir=keys_dir,
        )
        try:
            for attempt in range(PORT_ATTEMPTS):
                try:
                    lab.process = _start_sshd(root / "sshd_config", root / "sshd.log", lab.port)
                    break
                except PortTaken:
                    if attempt == PORT_ATTEMPTS - 1:
                        raise
                    lab.port = free_port()  # and every file that names it
                    config_path.write_text(_bastion_toml(lab.port, host_key_line, target))
                    (root / "known_hosts").write_text(f"[127.0.0.1]:{lab.port} {host_key_line}\n")
                    (root / "sshd_config").write_text(_sshd_config(root, lab.port, authorized))
        except BaseException:
            lab.stop()
            raise
        return lab

    @contextmanager
    def second_sshd(
        self,
        name: str,
        extra_config: str,
        *,
        host_keys: tuple[Path, ...] | None = None,
        authorized: Path | None = None,
    ) -> Iterator[int]:
        """Another sshd like the lab's plus `extra_config`; yields its port.

        `host_keys` replaces the lab's host key; `authorized` replaces its authorized_keys file.
        """
        port = free_port()
        config = self.root / f"sshd_config.{name}"
        text = (self.root / "sshd_config").read_text()
        text = text.replace(f"Port {self.port}\n", f"Port {port}\n").replace(
            f"PidFile {self.root / 'sshd.pid'}", f"PidFile {self.root / f'sshd.{name}.pid'}"
        )
        if host_keys is not None:
            lines = "\n".join(f"HostKey {key}" for key in host_keys)
            text = text.replace(f"HostKey {self.root / 'host_ed25519'}", lines)
        if authorized is not None:
            text = text.replace(f"AuthorizedKeysFile {self.authorized_keys}", f"AuthorizedKeysFile {authorized}")
        config.write_text(text + extra_config + "\n")
        process = _start_sshd(config, self.root / f"sshd.{name}.log", port)
        try:
            yield port
        finally:
            process.terminate()
            process.wait(timeout=5)


def _strict_modes_folder() -> Path:
    """A new private folder for authorized_keys that passes sshd's StrictModes.

    sshd checks the file and each parent up to the user's home (or /): owned by root or the
    user, not group- or world-writable. pytest's folders sit under /tmp (mode 1777), which
    fails that, so the key file goes to the first candidate whose whole chain passes.
    """
    uid = os.geteuid()
    home = Path(pwd.getpwuid(uid).pw_dir).resolve()
    for base in (Path(f"/run/user/{uid}"), Path("/run"), home):
        if base.is_dir() and os.access(base, os.W_OK) and _sshd_accepts_parents(base.resolve(), home, uid):
            return Path(tempfile.mkdtemp(prefix="bastion-gateway-lab-", dir=base))
    raise RuntimeError("no folder for authorized_keys passes sshd's StrictModes (tried /run/user/UID, /run, ~)")


def _sshd_accepts_parents(folder: Path, home: Path, uid: int) -> bool:
    for parent in (folder, *folder.parents):
        info = parent.stat()
        if info.st_uid not in (0, uid) or info.st_mode & 0o022:
            return False
        if parent == home:
            return True
    return True


PORT_ATTEMPTS = 3


class PortTaken(RuntimeError):
    """sshd could not bind its port: another test's socket took it after `free_port` found it free."""


def _start_sshd(config: Path, log: Path, port: int) -> subprocess.Popen[bytes]:
    """Start sshd in the foreground and wait until it answers on `port` with its banner.

    The banner, not a connection: a full run once saw another test's server take the port first; sshd
    exited on its bind, the connection reached the other server, and every later test of the lab failed.

    Raises:
        PortTaken: the port was taken (the caller tries another).
    """
    # -E, not -e: with -e a DEBUG sshd writes its session child's log lines into the client's stderr.
    process = subprocess.Popen([SSHD, "-D", "-E", str(log), "-f", str(config)])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if process.poll() is not None:
            text = log.read_text()[-2000:]
            if "Address already in use" in text:
                raise PortTaken(f"sshd could not bind port {port}: {text}")
            raise RuntimeError(f"sshd exited: {text}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as probe:
                probe.settimeout(2)
                if probe.recv(8).startswith(b"SSH-") and process.poll() is None:
                    return process
        except OSError:
            pass
        time.sleep(0.05)
    process.kill()
    process.wait()
    raise RuntimeError("sshd did not start answering within 10 s")


def _sshd_config(root: Path, port: int, authorized: Path) -> str:
    return textwrap.dedent(f"""\
        Port {port}
        ListenAddress 127.0.0.1
        HostKey {root / "host_ed25519"}
        PidFile {root / "sshd.pid"}
        AuthorizedKeysFile {authorized}
        # sshd's default, stated: the key file's folder chain must not be writable by others.
        StrictModes yes
        PubkeyAuthentication yes
        PasswordAuthentication no
        KbdInteractiveAuthentication no
        UsePAM no
        PermitRootLogin prohibit-password
        AllowUsers {USER}
        # Deliberately accept client variables, to prove dispatch.py never passes them on.
        AcceptEnv LANG LC_* BASTION_LEAK_*
        Subsystem sftp internal-sftp
        # sshd runs the forced command with the user's shell; bash then reads ~/.bashrc unless SHLVL
        # says it is nested. The lab logs in as the test user (root), whose rc files are not the point.
        SetEnv SHLVL=1
        LogLevel DEBUG1
        """)


def _dispatch_toml(target: Path, program: Path) -> str:
    project = '{ name = "project", kind = "project" }'
    return textwrap.dedent(f"""\
        root = "{target / "srv"}"
        log = "{target / "dispatch.jsonl"}"
        projects = ["biscuit"]
        timeout_s = 5
        max_output_bytes = 131072

        [actions.status]
        argv = ["{program}", "status", "{{project}}"]
        args = [{project}]

        [actions.logs]
        argv = ["{program}", "logs", "{{project}}", "{{lines}}"]
        args = [{project}, {{ name = "lines", pattern = "[0-9]{{1,4}}" }}]

        [actions.deploy]
        argv = ["{program}", "deploy", "{{project}}", "{{version}}"]
        args = [{project}, {{ name = "version", pattern = "v[0-9]+[.][0-9]+[.][0-9]+" }}]

        [actions.env]
        argv = ["{program}", "env"]

        [actions.big]
        argv = ["{program}", "big"]

        [actions.leak]
        argv = ["{program}", "leak"]

        [actions.fail]
        argv = ["{program}", "fail"]

        [actions.edge]
        argv = ["{program}", "edge"]

        [actions.sleep]
        argv = ["{program}", "sleep"]

        [actions.noisy]
        argv = ["{program}", "noisy"]

        [actions.forge]
        argv = ["{program}", "forge", "{{status}}", "{{mode}}"]
        args = [{{ name = "status", pattern = "12[46]" }}, {{ name = "mode", pattern = "plain|nolf|pem|cap" }}]

        [actions.show]
        argv = ["{program}", "show", "{{path}}"]
        args = [{{ name = "path", kind = "path" }}]
        """)


def _bastion_toml(port: int, host_key_line: str, target: Path) -> str:
    project = '{ name = "project", pattern = "[a-z][a-z0-9-]{0,31}" }'
    return textwrap.dedent(f"""\
        state_dir = "state"
        default_workspace = "default"

        [[workspace]]
        id = "default"
        path = "workspace"
        use_cgroups = false
        [workspace.policy]
        allow = ["ls"]

        [sandboxes]
        enabled = false

        [approvals]
        wait_s = 0
        ttl_s = 600

        [[gateway]]
        name = "biscuit"
        host = "127.0.0.1"
        port = {port}
        user = "{USER}"
        key_path = "state/biscuit_ed25519"
        host_key = "{host_key_line}"
        from_addresses = ["127.0.0.1"]
        remote_python = "/usr/bin/python3"
        dispatch_path = "{target / "dispatch.py"}"
        dispatch_config = "{target / "dispatch.toml"}"
        connect_timeout_s = 10
        call_timeout_s = 20
        max_output_bytes = 65536

        [[gateway.action]]
        name = "status"
        description = "Is the service up?"
        approval = false
        args = [{project}]

        [[gateway.action]]
        name = "logs"
        approval = false
        args = [{project}, {{ name = "lines", pattern = "[0-9]{{1,4}}" }}]

        [[gateway.action]]
        name = "deploy"
        args = [{project}, {{ name = "version", pattern = "v[0-9]+[.][0-9]+[.][0-9]+" }}]

        [[gateway.action]]
        name = "big"
        approval = false

        [[gateway.action]]
        name = "leak"
        approval = false

        [[gateway.action]]
        name = "fail"
        approval = false

        [[gateway.action]]
        name = "edge"
        approval = false

        [[gateway.action]]
        name = "sleep"
        approval = false

        [[gateway.action]]
        name = "noisy"
        approval = false

        [[gateway.action]]
        name = "forge"
        approval = false
        args = [{{ name = "status", pattern = "12[46]" }}, {{ name = "mode", pattern = "plain|nolf|pem|cap" }}]
        """)


DEADLINE_S = 30.0


class HeldLab:
    """A lab of its own whose `sleep` action runs until the test releases it (no timing involved)."""

    def __init__(self, lab: GatewayLab) -> None:
        self.lab = lab
        self.release = lab.root / "release"
        self.marker = f"{lab.root}/release"
        toml = lab.root / "target" / "dispatch.toml"
        text = toml.read_text().replace("timeout_s = 5", "timeout_s = 120")
        held = f'argv = ["/bin/sh", "-c", "while [ ! -e {self.release} ]; do sleep 0.02; done"]'
        text = text.replace(f'argv = ["{lab.root / "target" / "bin" / "action"}", "sleep"]', held)
        assert held in text
        toml.write_text(text)

    def running(self) -> int:
        """Held actions on the host: their shells, not counting a shell's child forked to run `sleep`, which
        has its parent's command line until it execs (a full run saw 5 for 4, and a test cancelled a call
        it took for started)."""
        pids = set(processes_with(self.marker))
        return sum(1 for pid in pids if _parent(pid) not in pids)

    def settle(self) -> None:
        """Release every held action and wait until none runs."""
        self.release.touch()
        deadline = time.monotonic() + DEADLINE_S
        while self.running():
            assert time.monotonic() < deadline, "the held actions did not end"
            time.sleep(0.02)


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[1])  # after the command's name, which may hold spaces


# -- what the gateway tests ask of a lab ---------------------------------------------------------


def variant(lab: GatewayLab, name: str, old: str, new: str) -> Path:
    """A copy of the lab's bastion.toml (same folder, so relative paths hold) with one change."""
    text = lab.config_path.read_text()
    assert old in text
    path = lab.config_path.with_name(name)
    path.write_text(text.replace(old, new, 1))
    return path


def audit_records(config: Path) -> list[dict[str, Any]]:
    """The records of `config`'s audit log (its current file)."""
    return [json.loads(line) for line in load_config(config).audit_path.read_text().splitlines()]


def host_saw(lab: GatewayLab, literal: str) -> bool:
    runs = any(" ".join(run["argv"]) == literal for run in lab.action_runs())
    return runs or any(record.get("request") == literal for record in lab.dispatch_records())


def approvals_cli(lab: GatewayLab, config: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "bastion", "approvals", *args, "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def point_demo_at_lab(config: Path, lab: GatewayLab) -> None:
    """The demo's `biscuit` gateway, aimed at the lab's sshd, key and dispatch.py."""
    target = lab.root / "target"
    text = config.read_text()
    for old, new in (
        ("port = 22\n", f"port = {lab.port}\n"),
        ('user = "bastion-gw"', f'user = "{USER}"'),
        ('key_path = "state/gateway/biscuit_ed25519"', f'key_path = "{lab.key_path}"'),
        ('# host_key = "ssh-ed25519 AAAA..."', f'host_key = "{lab.host_key_line}"'),
        ('dispatch_path = "/opt/bastion-gateway/dispatch.py"', f'dispatch_path = "{target / "dispatch.py"}"'),
        (
            'dispatch_config = "/etc/bastion-gateway/dispatch.toml"',
            f'dispatch_config = "{target / "dispatch.toml"}"',
        ),
        ("wait_s = 60", "wait_s = 0"),
    ):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    config.write_text(text)
