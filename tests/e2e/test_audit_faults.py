"""Fail-closed audit: when the record cannot be written, nothing runs and the tool says AUDIT_UNAVAILABLE.

Real filesystems, no mocks: a full tmpfs (ENOSPC), an ext4 image shut down with
EXT4_IOC_SHUTDOWN (what errors=remount-ro does to a failing disk: every write EIO),
and a read-only mount at start-up. A read-only remount cannot happen under an
open writer (the kernel answers EBUSY), so that case is covered at start-up.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from mcp import Client

from bastion.app import build_server, build_services
from bastion.config import load_config
from bastion.demo import init_demo
from bastion.safety.audit import verify
from bastion.safety.errors import ConfigError

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


def _fill(folder: Path) -> None:
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)


async def test_full_filesystem_refuses_mutation_and_runs_nothing(tmp_path: Path, state_mount: Path) -> None:
    """Invariant: ENOSPC on the audit log means write_file and run_command do nothing and say AUDIT_UNAVAILABLE."""
    _mount("-t", "tmpfs", "-o", "size=256k", "tmpfs", str(state_mount))
    config = load_config(_demo_with_state(tmp_path, state_mount))
    services = build_services(config)
    try:
        async with Client(build_server(services, caller="test")) as client:
            ok = await client.call_tool("run_command", {"command": "true"})
            assert ok.structured_content is not None
            assert ok.structured_content["ok"] is True
            _fill(state_mount)
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
    _mount("-t", "tmpfs", "-o", "size=256k", "tmpfs", str(state_mount))
    (state_mount / "audit.jsonl").touch(mode=0o600)
    _mount("-o", "remount,ro", str(state_mount))
    config = load_config(_demo_with_state(tmp_path, state_mount))
    with pytest.raises(ConfigError, match="audit log") as caught:
        build_services(config)
    assert "\n" not in str(caught.value)
