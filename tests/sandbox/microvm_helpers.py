"""What the microVM tests share: boot files built once per session, and a look inside a guest."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import pytest

from bastion.sandbox._spawn import SANDBOX_PATH, SandboxSpec
from bastion.sandbox.cgroups import CgroupLayout, Limits
from bastion.sandbox.identity import DEFAULT_HOST_ID_COUNT, DEFAULT_HOST_ID_FIRST, IdentityPool
from bastion.sandbox.microvm import MicroVMBackend, MicroVMSandbox, MicroVMSettings, missing_boot_files
from bastion.sandbox.vmimage import ImageError, build

# Software emulation on a loaded 2-core machine: a cold boot takes 10-40 s here.
BOOT_TIMEOUT_S = 180.0
_built: dict[str, Path] = {}


def microvm_settings(factory: pytest.TempPathFactory, memory_mib: int = 256) -> MicroVMSettings:
    """Settings over boot files built from this machine's packages (once per session); skips if it cannot."""
    if "dir" not in _built:
        try:
            _built["dir"] = build(factory.mktemp("microvm-image"))
        except (ImageError, OSError) as exc:
            pytest.skip(f"microVM boot files cannot be built here: {exc}")
    settings = MicroVMSettings(_built["dir"], memory_mib=memory_mib, accel="tcg", boot_timeout_s=BOOT_TIMEOUT_S)
    missing = missing_boot_files(settings)
    if missing is not None:
        pytest.skip(missing)
    return settings


@contextlib.asynccontextmanager
async def own_guest(
    top: Path, base: Path, settings: MicroVMSettings, layout: CgroupLayout, files: Mapping[str, str] | None = None
) -> AsyncIterator[MicroVMSandbox]:
    """A guest (not started) whose VMM runs as an identity of its own, as the manager starts them, with its
    workspace `top`/ws holding `files`; closed for good after. `base`: pytest's base temp folder."""
    ws = top / "ws"
    ws.mkdir()
    for name, text in (files or {}).items():
        (ws / name).write_text(text)
    pool = IdentityPool(DEFAULT_HOST_ID_FIRST, DEFAULT_HOST_ID_COUNT, lock_dir=top / "ids")
    try:
        identity = pool.acquire()
        os.chown(ws, identity.uid, identity.gid)
        for folder in (ws, settings.image_dir):
            let_through(folder, base)
        spec = SandboxSpec(workspace=str(ws), identity=(identity.uid, identity.gid))
        box = MicroVMBackend(settings, layout).sandbox(spec, limits=Limits(None, None, 1.0))
        try:
            yield box
        finally:
            await box.aclose(final=True)
    finally:
        pool.close()


def let_through(path: Path, top: Path) -> None:
    """Let other uids traverse (not list) `path`'s folders up to `top`, pytest's 0700 base folder."""
    for folder in (path, *path.parents):
        os.chmod(folder, os.stat(folder).st_mode | 0o011)
        if folder == top:
            return


async def guest_processes_with(box: MicroVMSandbox, marker: str) -> list[int]:
    """Guest pids whose command line holds `marker`, seen by a command in that guest (its /proc is the
    guest's whole PID namespace). The marker is split so the looking shell does not match itself."""
    head, tail = marker[: len(marker) // 2], marker[len(marker) // 2 :]
    # One grep over every command line (a process per /proc entry costs seconds under emulation); the
    # pattern comes on stdin, so grep's own command line does not hold it.
    script = f'm="{head}"; printf "%s\\n" "${{m}}{tail}" | grep -l -a -F -f - /proc/[0-9]*/cmdline 2>/dev/null'
    env = {"PATH": SANDBOX_PATH}
    outcome = await box.run("/bin/sh", ["sh", "-c", script], cwd="/", env=env, timeout_s=30, max_output_bytes=65536)
    return [int(line.split("/")[2]) for line in outcome.stdout.decode().split()]


TEMPLATE = """
[sandboxes.microvm]
image_dir = "{image_dir}"
allow_emulation = {emulation}
probe_timeout_s = 3
boot_timeout_s = 180

[[template]]
name = "vm"
isolation = "microvm"
vm_memory_mib = 256
"""


def with_vm_template(config: Path, image_dir: Path, *, emulation: bool, extra: str = "") -> Path:
    text = config.read_text()
    # [sandboxes.microvm] must come after the demo's own [sandboxes] keys: put it at the end of them.
    config.write_text(text + TEMPLATE.format(image_dir=image_dir, emulation=str(emulation).lower()) + extra)
    return config
