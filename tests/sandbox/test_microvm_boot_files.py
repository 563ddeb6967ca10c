"""The microVM boot files as the server uses them: refused when another local user could change them.

Every guest boots the kernel and initramfs of `[sandboxes.microvm] image_dir`, with the sandbox's workspace
over 9p and its egress: whoever could replace the folder, a folder or link on its way, or either file would
choose what runs as every microVM sandbox. `vmimage.build` already refuses to write into another user's
folder; these tests are about using an image folder that exists. No guest boots: each is refused first
(the files are bytes of "bob's choosing", which no VMM is given). Not proven: a change by root or the
server's own user, and one made after the check by an administrator who loosens the folders.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from mcp import Client

from bastion.app import build_server, build_services
from bastion.cli import main
from bastion.config import load_config
from bastion.safety.errors import Unavailable
from bastion.sandbox._spawn import SandboxSpec
from bastion.sandbox.microvm import MicroVMSandbox, MicroVMSettings, boot_files_problem, missing_boot_files
from bastion.sandbox.vmimage import INITRAMFS_NAME, KERNEL_NAME
from tests.helpers import processes_with, refused_stdio_start
from tests.sandbox.microvm_helpers import with_vm_template

BOB = (4242, 4242)

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another uid needs root"),
]


def _image(folder: Path) -> Path:
    """An image folder as `vmimage.build` leaves it (0755, files 0644, root's), holding bytes of bob's choosing."""
    folder.mkdir(mode=0o755)
    for name in (KERNEL_NAME, INITRAMFS_NAME):
        (folder / name).write_bytes(f"{name} of bob's choosing".encode())
        (folder / name).chmod(0o644)
    return folder


def _files(image: Path) -> dict[str, tuple[bytes, int, int]]:
    """Each boot file's bytes, owner and mode."""
    found = {}
    for path in sorted(image.iterdir()):
        info = path.lstat()
        found[path.name] = (path.read_bytes(), info.st_uid, info.st_mode)
    return found


def _run_dirs() -> set[str]:
    """This process's VMM folders in the temp folder (`microvm._make_run_dir`)."""
    return set(glob.glob(os.path.join(tempfile.gettempdir(), f"bastion-vm-{os.getpid()}-*")))


def _owned_link(top: Path, image: Path) -> Path:
    """The image folder reached through a link in bob's folder: he repoints it at a folder of his."""
    bobs = top / "bob"
    bobs.mkdir()
    (bobs / "image").symlink_to(image)
    os.chown(bobs, *BOB)
    return bobs / "image"


# What bob is given (a link returns the image_dir to configure instead), and the words naming him in the refusal.
ATTACKS: dict[str, tuple[Callable[[Path, Path], Path | None], str]] = {
    "owns-the-image-folder": (lambda top, image: os.chown(image, *BOB), "uid 4242, who owns {image}"),
    "owns-a-folder-above": (lambda top, image: os.chown(top, *BOB), "uid 4242, who owns {top}"),
    "may-write-the-image-folder": (lambda top, image: image.chmod(0o777), "any user: they may write {image}"),
    "may-add-names-to-the-sticky-folder": (lambda top, image: image.chmod(0o1777), "any user: they may write {image}"),
    "may-write-the-kernel": (
        lambda top, image: (image / KERNEL_NAME).chmod(0o666),
        "any user: they may write {image}/vmlinuz",
    ),
    "owns-the-initramfs": (
        lambda top, image: os.chown(image / INITRAMFS_NAME, *BOB),
        "uid 4242, who owns {image}/initramfs.cpio",
    ),
    "controls-a-link-on-the-way": (_owned_link, "whoever may change the symbolic link {top}/bob/image"),
}


def _attacked(tmp_path: Path, attack: str) -> tuple[Path, Path, str]:
    """(the real image folder, the image_dir configured, the words the refusal must hold)."""
    top = tmp_path / "var-lib"
    top.mkdir(mode=0o755)
    image = _image(top / "microvm")
    setup, words = ATTACKS[attack]
    configured = setup(top, image) or image
    return image, configured, words.format(top=top, image=image)


@pytest.mark.parametrize("attack", sorted(ATTACKS))
async def test_a_guest_never_boots_files_another_user_could_change(tmp_path: Path, attack: str) -> None:
    """Attack: another local user can change the microVM's kernel or initramfs (each way in ATTACKS), which
    then runs as every microVM guest with its workspace and egress. Starting a guest is refused with one line
    naming who and through what, before any VMM or VMM folder is made; the files are left as they were."""
    image, configured, words = _attacked(tmp_path, attack)
    ws = tmp_path / "ws"
    ws.mkdir()
    before, dirs_before = _files(image), _run_dirs()
    settings = MicroVMSettings(configured, accel="tcg", boot_timeout_s=20)
    box = MicroVMSandbox(SandboxSpec(workspace=str(ws)), settings, cgroups=None, limits=None)
    try:
        with pytest.raises(Unavailable) as refused:
            await box.start()
    finally:
        await box.aclose(final=True)
    line = refused.value.reason
    assert line.startswith(f"the microVM boot files in {configured} could be changed by "), line
    assert words in line
    assert "\n" not in line
    assert processes_with(str(configured)) == []
    assert _run_dirs() == dirs_before
    assert _files(image) == before
    assert list(ws.iterdir()) == []


@pytest.mark.bwrap
@pytest.mark.parametrize("emulation", [False, True])
async def test_create_sandbox_refuses_a_microvm_whose_boot_files_another_user_could_change(
    demo_config_path: Path, tmp_path: Path, emulation: bool
) -> None:
    """Attack, through the real MCP client: bob may write the image folder. create_sandbox(template="vm")
    is a one-line UNAVAILABLE naming him, with or without software emulation allowed (the refusal is not a
    KVM failure, so emulating the same files is no way around it); no sandbox, VMM or VMM folder is left."""
    image, configured, words = _attacked(tmp_path, "may-write-the-image-folder")
    config = load_config(with_vm_template(demo_config_path, configured, emulation=emulation))
    dirs_before = _run_dirs()
    services = build_services(config)
    try:
        async with Client(build_server(services, caller="test")) as client:
            created = await client.call_tool("create_sandbox", {"template": "vm"})
            result = created.structured_content
            assert result is not None
            assert not result["ok"], result
            assert result["code"] == "UNAVAILABLE"
            assert words in result["reason"]
            assert "could be changed by" in result["reason"]
            assert "\n" not in result["reason"]
            listed = await client.call_tool("list_sandboxes", {})
            assert listed.structured_content is not None
            assert listed.structured_content["detail"]["sandboxes"] == []
    finally:
        services.close()
    assert processes_with(str(configured)) == []
    assert _run_dirs() == dirs_before
    assert sorted(os.listdir(image)) == [INITRAMFS_NAME, KERNEL_NAME]


def test_serve_refuses_boot_files_another_user_could_change_at_start(demo_config_path: Path, tmp_path: Path) -> None:
    """`serve` with a microvm template exits 78 with the one line before it makes its state or starts any
    sandbox (not only at the first microVM's start)."""
    _, configured, words = _attacked(tmp_path, "owns-a-folder-above")
    config = with_vm_template(demo_config_path, configured, emulation=True)
    lines = [refused_stdio_start(config)]
    assert lines[0].startswith(f"bastion: the microVM boot files in {configured} could be changed by {words}")
    assert list((demo_config_path.parent / "state").iterdir()) == []


def test_doctor_fails_boot_files_another_user_could_change_without_booting_them(
    capsys: pytest.CaptureFixture[str], demo_config_path: Path, tmp_path: Path
) -> None:
    """The doctor names what `serve` refuses, and never boots its probe guest from those files."""
    _, configured, words = _attacked(tmp_path, "may-write-the-kernel")
    text = demo_config_path.read_text().replace("[sandboxes]\nenabled = true", "[sandboxes]\nenabled = false")
    demo_config_path.write_text(text)
    config = with_vm_template(demo_config_path, configured, emulation=True)
    code = main(["doctor", "--json", "--config", str(config)])
    rows = {row["check"]: row for row in json.loads(capsys.readouterr().out)}
    assert code == 1
    assert rows["microvm"]["status"] == "FAIL"
    assert rows["microvm"]["detail"].startswith("templates vm are refused: the microVM boot files in ")
    assert words in rows["microvm"]["detail"]
    assert processes_with(str(configured)) == []


def test_boot_files_only_root_can_change_are_used(tmp_path: Path) -> None:
    """Not a refusal: what `vmimage.build` leaves (root's 0755 folder, 0644 files) passes, as does a folder
    not built yet (`missing_boot_files` says what to do)."""
    image = _image(tmp_path / "image")
    assert boot_files_problem(image) is None
    assert boot_files_problem(tmp_path / "not-built") is None
    assert missing_boot_files(MicroVMSettings(tmp_path / "not-built")) is not None
