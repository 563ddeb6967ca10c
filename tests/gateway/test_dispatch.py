"""dispatch.py on its own: the parser, the path pinning, the log, run as the forced command would be.

Also the attacks of issue 13, finding 7, each with a control that runs: a config the SSH user owns
(run as nobody), a config or its folder writable by group or others, a symlink or FIFO as the config,
a hard link, FIFO, socket or device as a path argument (directly, and through `biscuit_show`, the lab's
real sshd and dispatch.py), a FIFO at the log path (no hang), a log that cannot grow. What it does not
prove: a config whose content is changed after it was read (a point-in-time check; the folders being
trusted is what makes that impossible for the SSH user), or hosts where the SSH user is root.
"""

from __future__ import annotations

import ast
import glob
import json
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mcp import Client

from bastion.app import build_server, build_services
from bastion.config import load_config
from bastion.gateway import dispatch
from bastion.gateway.keys import dispatch_source
from tests.helpers import call, processes_with

from .lab import GatewayLab

# dispatch.py trusts a config only if root (or a script owner other than its caller) owns it and every
# folder above it: a target an unprivileged test user makes in its temp folder is refused by design.
pytestmark = pytest.mark.root

SOURCE = dispatch_source()


def test_script_is_python39_stdlib_only_one_file() -> None:
    tree = ast.parse(SOURCE, feature_version=(3, 9))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0
            imported.add((node.module or "").split(".")[0])
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}
    assert "bastion" not in imported
    assert "shell=True" not in SOURCE


@pytest.fixture
def target(tmp_path: Path) -> Path:
    srv = tmp_path / "srv"
    (srv / "app").mkdir(parents=True)
    (srv / "app" / "VERSION").write_text("v1\n")
    (tmp_path / "srv-secret").mkdir()
    (tmp_path / "srv-secret" / "key").write_text("SECRET\n")
    (srv / "app" / "link").symlink_to(tmp_path / "srv-secret")
    (srv / "app" / "filelink").symlink_to(tmp_path / "srv-secret" / "key")
    config = {
        "root": str(srv),
        "log": str(tmp_path / "dispatch.jsonl"),
        "projects": ["app"],
        "timeout_s": 5,
        "max_output_bytes": 1024,
        "actions": {
            "status": {"argv": ["/bin/echo", "status", "{project}"], "args": [{"name": "project", "kind": "project"}]},
            "show": {"argv": ["/bin/cat", "{path}"], "args": [{"name": "path", "kind": "path"}]},
            "env": {"argv": ["/usr/bin/env"]},
            "deploy": {
                "argv": ["/bin/echo", "deploy", "{version}"],
                "args": [{"name": "version", "pattern": "v[0-9]+"}],
            },
        },
    }
    (tmp_path / "dispatch.json").write_text(json.dumps(config))
    return tmp_path


def run_dispatch(target: Path, command: str | None, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {"PATH": "/usr/bin:/bin", **env}
    if command is not None:
        environ["SSH_ORIGINAL_COMMAND"] = command
    script = target / "dispatch.py"
    if not script.exists():
        script.write_text(SOURCE)
    return subprocess.run(
        ["/usr/bin/python3", "-I", str(script), "--config", str(target / "dispatch.json")],
        env=environ,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def records(target: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (target / "dispatch.jsonl").read_text().splitlines()]


def test_allowed_action_runs_and_is_logged(target: Path) -> None:
    done = run_dispatch(target, "status app")
    assert (done.returncode, done.stdout) == (0, "status app\n")
    assert [r["event"] for r in records(target)] == ["start", "end"]
    assert (target / "dispatch.jsonl").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    "command",
    [
        "",
        "status",
        "status app extra",
        "status  app",
        " status app",
        "status app ",
        "status other",
        "status -app",
        "status app\nid",
        "status app\tid",
        "status app\x1b[2J",
        "status ａpp",
        "deploy v1;id",
        "deploy 1",
        "deploy v1 --force",
        "unknown",
        "show ../srv-secret/key",
        "show app/../../srv-secret/key",
        "show /etc/passwd",
        "show app/link/key",
        "show app/filelink",
        "show app//VERSION",
        "show app/./VERSION",
        "x" * 257,
    ],
)
def test_refusals_exit_126_with_one_line_and_a_record(target: Path, command: str) -> None:
    done = run_dispatch(target, command)
    assert done.returncode == 126, done.stderr
    assert done.stderr.startswith("dispatch: refused: ")
    assert done.stderr.count("\n") == 1
    assert "SECRET" not in done.stdout
    assert [r["event"] for r in records(target)] == ["refused"]


def test_missing_command_is_an_interactive_login(target: Path) -> None:
    done = run_dispatch(target, None)
    assert done.returncode == 126
    assert "interactive" in done.stderr
    assert records(target)[0]["request"] is None


def test_path_argument_is_pinned_beneath_root(target: Path) -> None:
    done = run_dispatch(target, "show app/VERSION")
    assert (done.returncode, done.stdout) == (0, "v1\n")


def test_environment_is_clean(target: Path) -> None:
    done = run_dispatch(target, "env", LD_PRELOAD="/nonexistent.so", BASTION_LEAK="1")
    assert done.returncode == 0
    names = {line.split("=", 1)[0] for line in done.stdout.splitlines()}
    assert names == {"PATH", "LANG"}


def test_output_is_capped(target: Path) -> None:
    config = json.loads((target / "dispatch.json").read_text())
    config["actions"]["big"] = {"argv": ["/usr/bin/head", "-c", "100000", "/dev/zero"]}
    (target / "dispatch.json").write_text(json.dumps(config))
    done = subprocess.run(
        ["/usr/bin/python3", "-I", "-c", SOURCE, "--config", str(target / "dispatch.json")],
        env={"SSH_ORIGINAL_COMMAND": "big"},
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0
    assert len(done.stdout) == 1024
    assert records(target)[-1]["truncated"] is True


def test_symlinked_log_is_refused_and_nothing_runs(target: Path) -> None:
    victim = target / "victim"
    victim.write_text("")
    (target / "dispatch.jsonl").symlink_to(victim)
    done = run_dispatch(target, "status app")
    assert done.returncode == 126
    assert "log cannot be written" in done.stderr
    assert done.stdout == ""
    assert victim.read_text() == ""


def test_bad_config_refuses_everything(target: Path) -> None:
    config = json.loads((target / "dispatch.json").read_text())
    config["actions"]["status"]["argv"][0] = "echo"  # not absolute: PATH lookups are refused
    (target / "dispatch.json").write_text(json.dumps(config))
    done = run_dispatch(target, "status app")
    assert done.returncode == 126
    assert "config is not valid" in done.stderr


def test_wrong_invocation_is_refused(target: Path) -> None:
    done = subprocess.run(
        ["/usr/bin/python3", "-I", "-c", SOURCE],
        env={"SSH_ORIGINAL_COMMAND": "status app"},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 126


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_parser_accepts_only_the_allowlist(command: str) -> None:
    config = dispatch.Config(
        {
            "root": "/srv",
            "log": "/var/log/x",
            "projects": ["app"],
            "actions": {
                "status": {"argv": ["/bin/true", "{project}"], "args": [{"name": "project", "kind": "project"}]},
                "deploy": {"argv": ["/bin/true", "{v}"], "args": [{"name": "v", "pattern": "v[0-9]+"}]},
            },
        }
    )
    try:
        action, values = dispatch.parse(command, config)
    except dispatch.Refused:
        return
    assert command in ("status app",) or (action.name == "deploy" and len(values) == 1 and values[0][0] == "v")
    assert " ".join([action.name, *values]) == command


def test_unknown_placeholder_is_a_config_error(target: Path) -> None:
    config = json.loads((target / "dispatch.json").read_text())
    config["actions"]["status"]["argv"].append("{typo}")
    (target / "dispatch.json").write_text(json.dumps(config))
    done = run_dispatch(target, "status app")
    assert done.returncode == 126
    assert "config is not valid" in done.stderr


def test_pattern_also_binds_project_and_path_arguments(target: Path) -> None:
    config = json.loads((target / "dispatch.json").read_text())
    config["projects"] = ["app", "app2"]
    config["actions"]["status"]["args"][0]["pattern"] = "app"
    config["actions"]["show"]["args"][0]["pattern"] = "app/[A-Z]+"
    (target / "dispatch.json").write_text(json.dumps(config))
    assert run_dispatch(target, "status app").returncode == 0
    assert run_dispatch(target, "show app/VERSION").returncode == 0
    for command in ("status app2", "show app/link"):
        done = run_dispatch(target, command)
        assert done.returncode == 126, command
        assert "does not match its pattern" in done.stderr
    assert [r["event"] for r in records(target)][-2:] == ["refused", "refused"]


def test_missing_root_is_a_refusal_with_a_record(target: Path) -> None:
    (target / "srv" / "app" / "VERSION").unlink()
    os.rename(target / "srv", target / "srv-moved")
    done = run_dispatch(target, "show app/VERSION")
    assert done.returncode == 126
    assert done.stderr.startswith("dispatch: refused: the gateway's root cannot be opened")
    assert done.stderr.count("\n") == 1
    assert [r["event"] for r in records(target)] == ["refused"]


def test_unwritable_log_means_nothing_runs(target: Path) -> None:
    config = json.loads((target / "dispatch.json").read_text())
    config["log"] = "/dev/full"  # a device, not a file: refused at open (a failing write: test_log_write_failure_...)
    config["actions"]["touch"] = {"argv": ["/usr/bin/touch", str(target / "ran")]}
    (target / "dispatch.json").write_text(json.dumps(config))
    for command in ("touch", "unknown"):
        done = run_dispatch(target, command)
        assert done.returncode == 126, command
        assert done.stderr.count("\n") == 1, done.stderr
    assert not (target / "ran").exists()


def test_client_going_away_does_not_escape_the_timeout(target: Path) -> None:
    """The SSH client closes its end mid-output: the action runs on, drained, until the timeout kills it."""
    marker = f"bastion-spew-{target.name}"
    config = json.loads((target / "dispatch.json").read_text())
    config["timeout_s"] = 2
    config["max_output_bytes"] = 16 * 1024 * 1024  # below the cap, so dispatch still writes when the client goes
    config["actions"]["spew"] = {"argv": ["/usr/bin/yes", marker]}
    (target / "dispatch.json").write_text(json.dumps(config))
    (target / "dispatch.py").write_text(SOURCE)
    process = subprocess.Popen(
        ["/usr/bin/python3", "-I", str(target / "dispatch.py"), "--config", str(target / "dispatch.json")],
        env={"SSH_ORIGINAL_COMMAND": "spew"},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert process.stdout is not None
    assert process.stdout.read(1000).startswith(marker.encode())
    process.stdout.close()  # the client is gone: dispatch's next write fails
    assert process.wait(timeout=30) == 124
    assert processes_with(marker) == []
    end = records(target)[-1]
    assert (end["event"], end["timed_out"], end["client_gone"], end["exit_status"]) == ("end", True, True, 137)


def _python39() -> str | None:
    """A real Python 3.9 interpreter, if this machine has one (pyenv, deadsnakes, or BASTION_TEST_PYTHON39)."""
    candidates = [os.environ.get("BASTION_TEST_PYTHON39", ""), "/usr/bin/python3.9", "/usr/local/bin/python3.9"]
    candidates += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.9*/bin/python3.9")))
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            version = subprocess.run(
                [candidate, "-I", "-c", "import sys; print(sys.version_info[:2] == (3, 9))"],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            if version.stdout.strip() == "True":
                return candidate
    return None


def test_runs_under_a_real_python39(target: Path) -> None:
    """The floor the issue names, run for real: JSON config (no tomllib before 3.11), an action, a path, refusals."""
    python = _python39()
    if python is None:
        pytest.skip("no Python 3.9 interpreter on this machine (set BASTION_TEST_PYTHON39)")
    (target / "dispatch.py").write_text(SOURCE)

    def run39(command: str, config: str = "dispatch.json") -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [python, "-I", str(target / "dispatch.py"), "--config", str(target / config)],
            env={"PATH": "/usr/bin:/bin", "SSH_ORIGINAL_COMMAND": command},
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )

    allowed = run39("status app")
    assert (allowed.returncode, allowed.stdout) == (0, "status app\n")
    assert run39("show app/VERSION").stdout == "v1\n"
    for command in ("show app/link/key", "status app;id", "x" * 257):
        refused = run39(command)
        assert refused.returncode == 126, (command, refused.stderr)
        assert refused.stderr.startswith("dispatch: refused: ")
    # A TOML file needs tomllib (3.11+); on 3.9 it is read as JSON, so TOML text is refused as a bad config.
    (target / "dispatch.toml").write_text('root = "/srv"\n')
    bad = run39("status app", "dispatch.toml")
    assert bad.returncode == 126
    assert "config is not valid" in bad.stderr
    events = [r["event"] for r in records(target)]
    assert events.count("end") == 2
    assert events.count("refused") == 3


@pytest.mark.root
def test_every_request_is_also_a_syslog_line(target: Path) -> None:
    """dispatch.py's syslog(3) lines, caught on a private /dev/log (a mount namespace; needs root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: /dev/log is replaced in a private mount namespace")
    sock_path = target / "log.sock"
    (target / "realdev").mkdir()
    (target / "dispatch.py").write_text(SOURCE)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(str(sock_path))
        listener.settimeout(10)
        # A tmpfs over /dev in the child's own namespace, with /dev/null back and /dev/log our socket.
        script = (
            "set -e\n"
            f"mount --bind /dev {target / 'realdev'}\n"
            "mount -t tmpfs -o mode=0755 none /dev\n"
            "touch /dev/null /dev/log\n"
            f"mount --bind {target / 'realdev' / 'null'} /dev/null\n"
            f"mount --bind {sock_path} /dev/log\n"
            f"exec /usr/bin/python3 -I {target / 'dispatch.py'} --config {target / 'dispatch.json'}\n"
        )
        for command in ("status app", "rm -rf /"):
            done = subprocess.run(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                env={"PATH": "/usr/bin:/bin", "SSH_ORIGINAL_COMMAND": command},
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            assert done.returncode == (0 if command == "status app" else 126), done.stderr
        lines = [listener.recv(65536).decode() for _ in records(target)]
    # <37>: facility auth (4 * 8) + notice (5); one line per JSONL record, the same JSON.
    assert all(line.startswith("<37>") and "bastion-dispatch[" in line for line in lines), lines
    assert [json.loads(line.split(": ", 1)[1]) for line in lines] == records(target)
    assert [r["event"] for r in records(target)] == ["start", "end", "refused"]


# Issue 13, finding 7: what an SSH user (or an action running as it) could plant to stall or fool dispatch.

NOBODY = 65534  # Debian's nobody: an SSH user that is not root
OTHER_UID = 4242  # a uid with no account: the script's owner when it is neither root nor the SSH user


def edit_config(target: Path, **changes: object) -> None:
    """The fixture's config with `changes`, a `touch` action (proof that something ran) and a `list` of a path."""
    config = json.loads((target / "dispatch.json").read_text())
    config.update(changes)
    config["actions"]["touch"] = {"argv": ["/usr/bin/touch", str(target / "logs" / "ran")]}
    config["actions"]["list"] = {"argv": ["/bin/ls", "{path}"], "args": [{"name": "path", "kind": "path"}]}
    (target / "dispatch.json").write_text(json.dumps(config))


@pytest.fixture
def user_target(target: Path) -> Path:
    """The target as the README installs it for a dedicated SSH user: the log folder is the user's (nobody's)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: dispatch.py runs as another user")
    logs = target / "logs"
    logs.mkdir(mode=0o700)
    os.chown(logs, NOBODY, NOBODY)
    edit_config(target, log=str(logs / "dispatch.jsonl"))
    (target / "dispatch.py").write_text(SOURCE)
    return target


def run_as(target: Path, command: str, uid: int = 0, config: Path | None = None) -> subprocess.CompletedProcess[str]:
    """dispatch.py as sshd runs it for an SSH user with uid `uid` (no supplementary groups)."""
    return subprocess.run(
        ["/usr/bin/python3", "-I", str(target / "dispatch.py"), "--config", str(config or target / "dispatch.json")],
        env={"PATH": "/usr/bin:/bin", "SSH_ORIGINAL_COMMAND": command},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        user=uid,
        group=uid if uid else 0,
        extra_groups=[],
    )


def user_records(target: Path) -> list[str]:
    log = target / "logs" / "dispatch.jsonl"
    return [json.loads(line)["event"] for line in log.read_text().splitlines()] if log.exists() else []


def assert_refused_and_nothing_ran(done: subprocess.CompletedProcess[str], target: Path, reason: str) -> None:
    assert done.returncode == 126, done.stderr
    assert done.stderr.startswith("dispatch: refused: ")
    assert done.stderr.count("\n") == 1, done.stderr
    assert reason in done.stderr, done.stderr
    assert done.stdout == ""
    assert not (target / "logs" / "ran").exists()


@pytest.mark.root
def test_dispatch_config_owned_by_ssh_user_refused(user_target: Path) -> None:
    """The SSH user owning its own dispatch.json could rewrite the policy (from an action, say): nothing runs.

    The same request with the config root's runs, so the refusal is the owner's alone. Does not prove
    what happens when the SSH user is root (root is trusted whatever it owns).
    """
    config = user_target / "dispatch.json"
    allowed = run_as(user_target, "touch", NOBODY)
    assert allowed.returncode == 0, allowed.stderr
    (user_target / "logs" / "ran").unlink()
    before = (config.read_bytes(), user_records(user_target))
    os.chown(config, NOBODY, NOBODY)
    done = run_as(user_target, "touch", NOBODY)
    assert_refused_and_nothing_ran(done, user_target, f"config is not safe (owned by uid {NOBODY}, not by root)")
    assert (config.read_bytes(), user_records(user_target)) == before


@pytest.mark.parametrize("mode", [0o664, 0o646, 0o666])
def test_dispatch_config_group_writable_refused(target: Path, mode: int) -> None:
    """A config any group member or other user could write is not the administrator's policy: nothing runs."""
    edit_config(target)
    (target / "logs").mkdir()
    config = target / "dispatch.json"
    assert run_dispatch(target, "touch").returncode == 0
    (target / "logs" / "ran").unlink()
    before = records(target)
    config.chmod(mode)
    done = run_dispatch(target, "touch")
    assert_refused_and_nothing_ran(done, target, "config is not safe (writable by group or others)")
    assert records(target) == before


@pytest.mark.root
def test_dispatch_config_folder_writable_by_ssh_user_refused(user_target: Path) -> None:
    """A root-owned config in a folder the SSH user owns could be replaced (rename over it): nothing runs."""
    folder = user_target / "conf"
    folder.mkdir()
    config = folder / "dispatch.json"
    config.write_bytes((user_target / "dispatch.json").read_bytes())
    assert run_as(user_target, "status app", NOBODY, config).returncode == 0
    before = user_records(user_target)
    os.chown(folder, NOBODY, NOBODY)
    done = run_as(user_target, "touch", NOBODY, config)
    assert_refused_and_nothing_ran(done, user_target, f"owned by uid {NOBODY}")
    os.chown(folder, 0, 0)
    folder.chmod(0o775)
    done = run_as(user_target, "touch", NOBODY, config)
    assert_refused_and_nothing_ran(done, user_target, "writable by group or others")
    assert user_records(user_target) == before


@pytest.mark.root
def test_dispatch_config_in_a_sticky_folder_is_accepted(user_target: Path) -> None:
    """A sticky world-writable folder (as /tmp) is no hole: others cannot rename or remove root's file there."""
    folder = user_target / "sticky"
    folder.mkdir()
    folder.chmod(0o1777)
    config = folder / "dispatch.json"
    config.write_bytes((user_target / "dispatch.json").read_bytes())
    rename = subprocess.run(
        ["/bin/mv", str(config), str(folder / "moved")],
        capture_output=True,
        timeout=30,
        check=False,
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
    )
    assert rename.returncode != 0  # the SSH user cannot replace root's file in a sticky folder
    assert config.is_file()
    done = run_as(user_target, "touch", NOBODY, config)
    assert done.returncode == 0, done.stderr
    assert user_records(user_target) == ["start", "end"]


def test_dispatch_config_symlink_refused(target: Path) -> None:
    """A symlink anywhere on the config path is refused: its folder would need checking too, so no link is followed."""
    edit_config(target)
    (target / "logs").mkdir()
    (target / "conf").mkdir()
    os.rename(target / "dispatch.json", target / "conf" / "dispatch.json")
    (target / "dispatch.json").symlink_to(target / "conf" / "dispatch.json")
    done = run_dispatch(target, "touch")
    assert_refused_and_nothing_ran(done, target, "config is not safe (a symlink)")
    (target / "via").symlink_to(target / "conf")
    done = run_as(target, "touch", config=target / "via" / "dispatch.json")
    assert_refused_and_nothing_ran(done, target, "config is not safe (a symlink or not a folder)")
    assert not (target / "dispatch.jsonl").exists()


def test_dispatch_config_fifo_refused_without_blocking(target: Path) -> None:
    """A FIFO at the config path is refused at once (before: open() waited for a writer, with no timeout)."""
    (target / "dispatch.py").write_text(SOURCE)
    (target / "logs").mkdir()
    os.unlink(target / "dispatch.json")
    os.mkfifo(target / "dispatch.json")
    done = run_as(target, "status app")  # subprocess's timeout (30 s) fails the test if it blocks
    assert_refused_and_nothing_ran(done, target, "config is not safe (not a regular file)")
    assert not (target / "dispatch.jsonl").exists()


@pytest.mark.root
def test_dispatch_config_owned_by_the_script_owner_is_accepted_unless_ssh_user(user_target: Path) -> None:
    """The user who installed dispatch.py may own its config; not when that user is the SSH user itself."""
    config = user_target / "dispatch.json"
    os.chown(config, OTHER_UID, OTHER_UID)
    done = run_as(user_target, "touch", NOBODY)
    assert_refused_and_nothing_ran(done, user_target, f"owned by uid {OTHER_UID}")  # script is root's
    os.chown(user_target / "dispatch.py", OTHER_UID, OTHER_UID)
    done = run_as(user_target, "touch", NOBODY)
    assert done.returncode == 0, done.stderr
    (user_target / "logs" / "ran").unlink()
    os.chown(user_target / "dispatch.py", NOBODY, NOBODY)
    os.chown(config, NOBODY, NOBODY)
    done = run_as(user_target, "touch", NOBODY)
    assert_refused_and_nothing_ran(done, user_target, f"owned by uid {NOBODY}")
    assert user_records(user_target) == ["start", "end"]


def test_hardlinked_path_argument_outside_root_refused(target: Path) -> None:
    """A file from outside root, hard-linked into it, is refused: its one name inside root proves nothing."""
    secret = target / "srv-secret" / "key"
    os.link(secret, target / "srv" / "app" / "hardlink")
    done = run_dispatch(target, "show app/hardlink")
    assert done.returncode == 126, done.stderr
    assert done.stderr == "dispatch: refused: path argument is a file with more than one link (a hard link)\n"
    assert "SECRET" not in done.stdout
    assert [r["event"] for r in records(target)] == ["refused"]
    assert secret.read_text() == "SECRET\n"
    assert secret.stat().st_nlink == 2


def test_fifo_path_argument_refused_without_blocking(target: Path) -> None:
    """A FIFO path argument is refused before anything runs (before: the action blocked on it until its timeout)."""
    os.mkfifo(target / "srv" / "app" / "fifo")
    done = run_dispatch(target, "show app/fifo")
    assert done.returncode == 126, done.stderr
    assert done.stderr == "dispatch: refused: path argument is not a plain file or folder (a FIFO, socket or device)\n"
    assert [r["event"] for r in records(target)] == ["refused"]
    assert processes_with(str(target / "srv")) == []


def test_socket_path_argument_refused(target: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(target / "srv" / "app" / "sock"))
        done = run_dispatch(target, "show app/sock")
    assert done.returncode == 126, done.stderr
    assert "not a plain file or folder" in done.stderr
    assert [r["event"] for r in records(target)] == ["refused"]


@pytest.mark.root
def test_device_path_argument_refused(target: Path) -> None:
    """A device node beneath root (here a copy of /dev/null's) is never handed to an action."""
    if os.geteuid() != 0:
        pytest.skip("needs root: mknod")
    os.mknod(target / "srv" / "app" / "null", 0o600 | 0o020000, os.makedev(1, 3))
    done = run_dispatch(target, "show app/null")
    assert done.returncode == 126, done.stderr
    assert "not a plain file or folder" in done.stderr
    assert [r["event"] for r in records(target)] == ["refused"]


def test_folder_path_argument_still_runs(target: Path) -> None:
    """The control: a folder (st_nlink > 1 by nature) is a valid path argument."""
    edit_config(target)
    done = run_dispatch(target, "list app")
    assert (done.returncode, done.stdout.split()) == (0, ["VERSION", "filelink", "link"])


def test_fifo_at_log_path_does_not_hang(target: Path) -> None:
    """A FIFO with no reader at the log path: refused at once (before: open() blocked forever, no timeout)."""
    edit_config(target)
    (target / "logs").mkdir()
    os.mkfifo(target / "dispatch.jsonl")
    done = run_dispatch(target, "touch")  # subprocess's timeout (30 s) fails the test if it hangs
    assert_refused_and_nothing_ran(done, target, "log cannot be written, so nothing runs")


def test_fifo_at_log_path_with_a_reader_is_refused(target: Path) -> None:
    """A FIFO someone reads at the log path opens at once, but is not a file: no record goes to it, nothing runs."""
    edit_config(target)
    (target / "logs").mkdir()
    os.mkfifo(target / "dispatch.jsonl")
    reader = os.open(target / "dispatch.jsonl", os.O_RDONLY | os.O_NONBLOCK)
    try:
        done = run_dispatch(target, "touch")
        assert_refused_and_nothing_ran(done, target, "log cannot be written, so nothing runs")
        assert os.read(reader, 65536) == b""  # the writer came and went without writing a byte
    finally:
        os.close(reader)


def test_log_write_failure_means_nothing_runs(target: Path) -> None:
    """A log that opens as a regular file but cannot grow (RLIMIT_FSIZE 0: EFBIG): no record, so nothing runs."""
    edit_config(target)
    (target / "logs").mkdir()
    (target / "dispatch.py").write_text(SOURCE)
    argv = ["prlimit", "--fsize=0", "--", "/usr/bin/python3", "-I", str(target / "dispatch.py")]
    argv += ["--config", str(target / "dispatch.json")]
    for command in ("touch", "unknown"):
        done = subprocess.run(
            argv,
            env={"PATH": "/usr/bin:/bin", "SSH_ORIGINAL_COMMAND": command},
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        # A refusal whose record cannot be written still says why it was refused.
        reason = "log cannot be written, so nothing runs" if command == "touch" else "unknown action"
        assert_refused_and_nothing_ran(done, target, reason)
    assert (target / "dispatch.jsonl").read_bytes() == b""


# The same attacks end to end: bastion's gateway tool, the real OpenSSH server of the lab, dispatch.py behind it.

SHOW_ACTION = """
[[gateway.action]]
name = "show"
approval = false
args = [{ name = "path", pattern = "biscuit/[A-Za-z-]+" }]
"""


@asynccontextmanager
async def gateway_client(lab: GatewayLab) -> AsyncIterator[Client]:
    """The lab's bastion config plus a `biscuit_show` tool for the host's `show` action (a path argument)."""
    path = lab.config_path.with_name("bastion-show.toml")
    path.write_text(lab.config_path.read_text() + SHOW_ACTION)
    services = build_services(load_config(path))
    try:
        async with Client(build_server(services, caller="dispatch-test")) as client:
            yield client
    finally:
        services.close()


def show_runs(lab: GatewayLab) -> list[list[str]]:
    return [run["argv"] for run in lab.action_runs() if run["argv"][0] == "show"]


@pytest.mark.anyio
async def test_hardlinked_path_argument_outside_root_refused_through_the_gateway(lab: GatewayLab) -> None:
    """`biscuit_show` of a hard link to a file outside the host's root: POLICY_DENIED, the file's text never leaves.

    The control call shows a plain file through the same tool first, so the refusal is the link's.
    """
    biscuit = lab.root / "target" / "srv" / "biscuit"
    secret = lab.root / "target" / "outside-secret"
    secret.write_text("SECRET-outside-root\n")
    os.link(secret, biscuit / "hardlink")
    try:
        before, runs = lab.settled_count(), show_runs(lab)
        async with gateway_client(lab) as client:
            plain = await call(client, "biscuit_show", path="biscuit/VERSION")
            assert plain["ok"], plain
            assert plain["detail"]["stdout"] == "v1.0.0\n"
            linked = await call(client, "biscuit_show", path="biscuit/hardlink")
        assert linked["code"] == "POLICY_DENIED", linked
        assert "more than one link" in str(linked["reason"])
        assert "SECRET" not in json.dumps(linked)
        new = lab.dispatch_records()[before:]
        assert [r["event"] for r in new] == ["start", "end", "refused"]
        assert new[-1]["request"] == "show biscuit/hardlink"
        assert show_runs(lab)[len(runs) :] == [["show", new[0]["argv"][2]]]  # the control's run, only
        assert secret.read_text() == "SECRET-outside-root\n"
    finally:
        (biscuit / "hardlink").unlink()
        secret.unlink()


@pytest.mark.anyio
async def test_fifo_path_argument_refused_without_blocking_through_the_gateway(lab: GatewayLab) -> None:
    """A FIFO beneath the host's root: refused at once (before: the action blocked on it until the 5 s timeout).

    Through bastion's tool (POLICY_DENIED, not TIMEOUT) and through the plain OpenSSH client (exit 126).
    """
    fifo = lab.root / "target" / "srv" / "biscuit" / "fifo"
    os.mkfifo(fifo)
    try:
        before, runs = lab.settled_count(), show_runs(lab)
        async with gateway_client(lab) as client:
            result = await call(client, "biscuit_show", path="biscuit/fifo")
        assert result["code"] == "POLICY_DENIED", result
        assert "not a plain file or folder" in str(result["reason"])
        done = lab.ssh("show biscuit/fifo")
        assert done.returncode == 126, done.stderr
        assert "dispatch: refused: path argument is not a plain file or folder" in done.stderr
        assert [r["event"] for r in lab.dispatch_records()[before:]] == ["refused", "refused"]
        assert show_runs(lab)[len(runs) :] == []
        assert processes_with(str(fifo)) == []
    finally:
        fifo.unlink()
