"""Fail-closed audit: when the record cannot be written, nothing runs and the tool says AUDIT_UNAVAILABLE.

Real filesystems, no mocks: a full tmpfs (ENOSPC), an ext4 image shut down with
EXT4_IOC_SHUTDOWN (what errors=remount-ro does to a failing disk: every write EIO),
and a read-only mount at start-up. A read-only remount cannot happen under an
open writer (the kernel answers EBUSY), so that case is covered at start-up.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client

from bastion.app import build_server, build_services
from bastion.config import load_config
from bastion.demo import init_demo
from bastion.safety.audit import verify
from bastion.safety.errors import ConfigError
from tests.helpers import fill

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting filesystems needs root"),
]

EXT4_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32), fs/ext4/ext4.h
EXT4_GOING_FLAGS_NOLOGFLUSH = 2


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


@pytest.fixture
def state_mount(tmp_path: Path) -> Iterator[Path]:
    mountpoint = tmp_path / "state"
    mountpoint.mkdir()
    yield mountpoint
    subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True)


def _demo_with_state(tmp_path: Path, state: Path) -> Path:
    config_path = init_demo(tmp_path / "demo")
    text = config_path.read_text().replace('state_dir = "state"', f'state_dir = "{state}"')
    config_path.write_text(text)
    return config_path


async def test_full_filesystem_refuses_mutation_and_runs_nothing(tmp_path: Path, state_mount: Path) -> None:
    """Invariant: ENOSPC on the audit log means write_file and run_command do nothing and say AUDIT_UNAVAILABLE."""
    _mount("-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(state_mount))
    config = load_config(_demo_with_state(tmp_path, state_mount))
    services = build_services(config)
    try:
        async with Client(build_server(services, caller="test")) as client:
            ok = await client.call_tool("run_command", {"command": "true"})
            assert ok.structured_content is not None
            assert ok.structured_content["ok"] is True
            fill(state_mount)
            # The log's last page may still have room for a few records: use it up.
            for _ in range(100):
                probe = await client.call_tool("explain_command", {"command": "ls"})
                assert probe.structured_content is not None
                if probe.structured_content["code"] == "AUDIT_UNAVAILABLE":
                    break
            else:
                pytest.fail("the audit log never ran out of space")
            wrote = await client.call_tool("write_file", {"path": "should-not-exist.txt", "content": "x"})
            ran = await client.call_tool("run_command", {"command": "touch also-not.txt"})
            read = await client.call_tool("read_file", {"path": "README.md"})
        for result in (wrote, ran, read):
            assert result.is_error is True
            assert result.structured_content is not None
            assert result.structured_content["code"] == "AUDIT_UNAVAILABLE"
            assert "content" not in result.structured_content["detail"]
        workspace = config.workspace[0].path
        assert not (workspace / "should-not-exist.txt").exists()
        assert verify(config.audit_path).ok, "a failed append left a torn record"
        assert not (workspace / "also-not.txt").exists()
    finally:
        services.close()


@pytest.mark.skipif(shutil.which("mkfs.ext4") is None, reason="mkfs.ext4 (e2fsprogs) is not installed")
async def test_failed_filesystem_refuses_mutation(tmp_path: Path, state_mount: Path) -> None:
    """Invariant: when the disk under the audit log fails (EIO on every write), nothing runs."""
    image = tmp_path / "ext4.img"
    with open(image, "wb") as handle:
        handle.truncate(16 * 1024 * 1024)
    subprocess.run(["mkfs.ext4", "-q", str(image)], check=True, capture_output=True)
    _mount("-o", "loop", str(image), str(state_mount))
    config = load_config(_demo_with_state(tmp_path, state_mount))
    services = build_services(config)
    try:
        async with Client(build_server(services, caller="test")) as client:
            fd = os.open(state_mount, os.O_RDONLY | os.O_DIRECTORY)
            try:
                fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, struct.pack("I", EXT4_GOING_FLAGS_NOLOGFLUSH))
            finally:
                os.close(fd)
            wrote = await client.call_tool("write_file", {"path": "after-failure.txt", "content": "x"})
        assert wrote.structured_content is not None
        assert wrote.structured_content["code"] == "AUDIT_UNAVAILABLE"
        assert not (config.workspace[0].path / "after-failure.txt").exists()
    finally:
        services.close()


def test_read_only_filesystem_refuses_to_start(tmp_path: Path, state_mount: Path) -> None:
    """Invariant: an audit log that cannot be opened for append stops the server at start, with one line."""
    _mount("-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(state_mount))
    (state_mount / "audit.jsonl").touch(mode=0o600)
    _mount("-o", "remount,ro", str(state_mount))
    config = load_config(_demo_with_state(tmp_path, state_mount))
    with pytest.raises(ConfigError, match="audit log") as caught:
        build_services(config)
    assert "\n" not in str(caught.value)


# --- the live log moved under a running server (issue 13, finding 4) ------------------------


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


async def _refused_and_nothing_ran(client: Client, workspace: Path, name: str) -> None:
    """A mutating call and a read are AUDIT_UNAVAILABLE; the command never ran."""
    ran = await client.call_tool("run_command", {"command": f"touch {name}"})
    read = await client.call_tool("read_file", {"path": "README.md"})
    for result in (ran, read):
        assert result.is_error is True
        assert result.structured_content is not None
        assert result.structured_content["code"] == "AUDIT_UNAVAILABLE", result.structured_content
        assert "restart the server" in result.structured_content["reason"]
    assert not (workspace / name).exists()


def _logged_once(caplog: pytest.LogCaptureFixture, text: str) -> None:
    lines = [r.getMessage() for r in caplog.records if r.name == "bastion.audit" and r.levelno == logging.ERROR]
    assert len([line for line in lines if text in line]) == 1, lines


async def test_audit_file_unlinked_under_server_fails_closed(
    demo_config_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Invariant: once the live audit log is unlinked, every call is AUDIT_UNAVAILABLE and does
    nothing, one error line says so (and where the written records can still be read), and no
    record goes to the deleted file after the unlink: what it held still verifies. Does not
    prove anything about an unlink racing the write of one batch (the check is point-in-time)."""
    config = load_config(demo_config_path)
    services = build_services(config)
    workspace = config.workspace[0].path
    try:
        async with Client(build_server(services, caller="test")) as client:
            ok = await client.call_tool("run_command", {"command": "touch before"})
            assert ok.is_error is False
            fd = os.open(config.audit_path, os.O_RDONLY)  # what the server's deleted inode holds
            try:
                held = os.fstat(fd).st_size
                config.audit_path.unlink()
                with caplog.at_level(logging.ERROR, logger="bastion.audit"):
                    await _refused_and_nothing_ran(client, workspace, "after")
                    await _refused_and_nothing_ran(client, workspace, "after-again")
                assert os.fstat(fd).st_size == held, "a record went to the deleted file"
                kept = Path(os.fspath(config.state_dir)) / "kept.jsonl"
                kept.write_bytes(os.pread(fd, held, 0))
            finally:
                os.close(fd)
    finally:
        services.close()
    _logged_once(caplog, "was deleted or renamed while the server ran")
    assert f"/proc/{os.getpid()}/fd/" in caplog.text
    assert not config.audit_path.exists(), "the server made a new log behind the operator's back"
    assert (workspace / "before").exists()
    report = verify(kept)
    assert report.ok, report.first_error
    assert report.records == len(_records(kept))


async def test_audit_file_renamed_under_server_fails_closed(
    demo_config_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Invariant: a live audit log renamed away (logrotate without copytruncate, or an attacker
    with the state folder) stops every call with AUDIT_UNAVAILABLE and one error line; the
    renamed file gets no new record and still verifies; once it is put back, calls run again
    and the chain continues unbroken."""
    config = load_config(demo_config_path)
    services = build_services(config)
    workspace = config.workspace[0].path
    aside = config.audit_path.with_name("audit-renamed.jsonl")
    try:
        async with Client(build_server(services, caller="test")) as client:
            assert (await client.call_tool("run_command", {"command": "touch before"})).is_error is False
            config.audit_path.rename(aside)
            held = aside.read_bytes()
            with caplog.at_level(logging.ERROR, logger="bastion.audit"):
                await _refused_and_nothing_ran(client, workspace, "after")
                await _refused_and_nothing_ran(client, workspace, "after-again")
            assert aside.read_bytes() == held, "a record went to the renamed file"
            assert not config.audit_path.exists()
            assert verify(aside).ok
            aside.rename(config.audit_path)
            back = await client.call_tool("run_command", {"command": "touch back"})
            assert back.is_error is False, back.structured_content
    finally:
        services.close()
    _logged_once(caplog, "was deleted or renamed while the server ran")
    assert (workspace / "back").exists()
    report = verify(config.audit_path)
    assert report.ok, report.first_error
    assert len(_records(config.audit_path)) == report.records


async def test_audit_symlink_swapped_in_under_server_fails_closed(
    demo_config_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Invariant: the live log renamed aside and a symlink put at its path (pointing at a file
    the attacker wants records in, or wants to grow) is seen at the next call, not at rotation:
    AUDIT_UNAVAILABLE, nothing runs, nothing is written through the link, the original keeps
    verifying, and one error line names the symlink."""
    config = load_config(demo_config_path)
    services = build_services(config)
    workspace = config.workspace[0].path
    aside = config.audit_path.with_name("audit-aside.jsonl")
    target = tmp_path / "attacker.jsonl"
    target.write_bytes(b"")
    try:
        async with Client(build_server(services, caller="test")) as client:
            assert (await client.call_tool("run_command", {"command": "touch before"})).is_error is False
            config.audit_path.rename(aside)
            config.audit_path.symlink_to(target)
            held = aside.read_bytes()
            with caplog.at_level(logging.ERROR, logger="bastion.audit"):
                await _refused_and_nothing_ran(client, workspace, "after")
            assert target.read_bytes() == b"", "a record was written through the symlink"
            assert aside.read_bytes() == held
    finally:
        services.close()
    _logged_once(caplog, "was replaced by a symlink while the server ran")
    assert verify(aside).ok


async def test_audit_file_replaced_by_another_file_under_server_fails_closed(
    demo_config_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Invariant: a plain file of the right owner and mode put in the log's place (after the
    original was renamed away) is not appended to: AUDIT_UNAVAILABLE until the original is back."""
    config = load_config(demo_config_path)
    services = build_services(config)
    workspace = config.workspace[0].path
    aside = config.audit_path.with_name("audit-aside.jsonl")
    try:
        async with Client(build_server(services, caller="test")) as client:
            assert (await client.call_tool("run_command", {"command": "touch before"})).is_error is False
            config.audit_path.rename(aside)
            fd = os.open(config.audit_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.close(fd)
            held = aside.read_bytes()
            with caplog.at_level(logging.ERROR, logger="bastion.audit"):
                await _refused_and_nothing_ran(client, workspace, "after")
            assert config.audit_path.read_bytes() == b""
            assert aside.read_bytes() == held
    finally:
        services.close()
    _logged_once(caplog, "was replaced by another file while the server ran")
    assert verify(aside).ok


async def test_audit_end_record_lost_after_the_command_ran_says_so(demo_config_path: Path) -> None:
    """Invariant: when the end record cannot be written after a mutating call ran, the answer is
    AUDIT_UNAVAILABLE and says exactly that: the operation ran, its end record is missing, and the
    log is unavailable until fixed; never "nothing was done". The command here blocks on a FIFO
    until the log has been renamed away, so its start record is on disk and its end record cannot be."""
    config = load_config(demo_config_path)
    services = build_services(config)
    workspace = config.workspace[0].path
    os.mkfifo(workspace / "gate", 0o666)
    aside = config.audit_path.with_name("audit-aside.jsonl")
    try:
        async with Client(build_server(services, caller="test")) as client:
            answer: dict[str, object] = {}

            async def copy_through_the_gate() -> None:
                result = await client.call_tool("run_command", {"command": "cp gate copied.txt"})
                assert result.structured_content is not None
                answer.update(result.structured_content)

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(copy_through_the_gate)
                writer = await _open_when_read(workspace / "gate")  # cp has the FIFO open: it started
                try:
                    config.audit_path.rename(aside)
                    os.write(writer, b"ran\n")
                finally:
                    os.close(writer)
    finally:
        services.close()
    assert (workspace / "copied.txt").read_text() == "ran\n"  # the operation did run
    assert answer["code"] == "AUDIT_UNAVAILABLE", answer
    reason = str(answer["reason"])
    assert reason.startswith("the operation ran, but its end record could not be written ("), reason
    assert "was deleted or renamed while the server ran" in reason
    assert reason.endswith("the audit log is unavailable until that is fixed"), reason
    assert "nothing was done" not in reason
    assert "\n" not in reason
    records = _records(aside)
    assert records[-1]["event"] == "start"
    assert records[-1]["args"]["command"] == "cp gate copied.txt"
    assert verify(aside).ok


async def _open_when_read(fifo: Path) -> int:
    """Open `fifo` for writing once a reader has it open (ENXIO until then), within a deadline."""
    with anyio.fail_after(30):
        while True:
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno != errno.ENXIO:
                    raise
                await anyio.sleep(0.01)
            else:
                os.set_blocking(fd, True)
                return fd
