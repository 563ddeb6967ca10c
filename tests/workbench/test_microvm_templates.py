"""Templates that ask for a microVM: refused with one line where a guest cannot boot, else the same tools."""

from __future__ import annotations

from pathlib import Path

import pytest
from mcp import Client

from bastion.app import build_server, build_services
from bastion.config import load_config
from bastion.safety.errors import ConfigError
from tests.sandbox.microvm_helpers import microvm_settings

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap, pytest.mark.root]

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


def with_vm_template(config: Path, image_dir: Path, *, emulation: bool) -> Path:
    text = config.read_text()
    # [sandboxes.microvm] must come after the demo's own [sandboxes] keys: put it at the end of them.
    config.write_text(text + TEMPLATE.format(image_dir=image_dir, emulation=str(emulation).lower()))
    return config


async def test_a_microvm_template_without_kvm_is_refused_in_one_line(
    demo_config_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Here a KVM guest hangs after its kernel decompresses: the probe's timeout calls it, and
    create_sandbox says so in one line (where KVM works, the same call starts a microVM)."""
    settings = microvm_settings(tmp_path_factory)
    services = build_services(load_config(with_vm_template(demo_config_path, settings.image_dir, emulation=False)))
    try:
        async with Client(build_server(services, caller="test")) as client:
            created = await client.call_tool("create_sandbox", {"template": "vm"})
            result = created.structured_content
            assert result is not None
            if result["ok"]:
                assert result["detail"]["isolation"] == "microvm"
                return
            assert result["code"] == "UNAVAILABLE"
            assert "needs a microVM and a kvm guest does not boot here" in result["reason"]
            assert "allow_emulation" in result["reason"]
            assert "\n" not in result["reason"]
            listed = await client.call_tool("list_sandboxes", {})
            assert listed.structured_content is not None
            assert listed.structured_content["detail"]["sandboxes"] == []
    finally:
        services.close()


@pytest.mark.microvm
async def test_a_microvm_template_runs_commands_and_says_its_isolation(
    demo_config_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    settings = microvm_settings(tmp_path_factory)
    services = build_services(load_config(with_vm_template(demo_config_path, settings.image_dir, emulation=True)))
    try:
        async with Client(build_server(services, caller="test")) as client:
            created = await client.call_tool("create_sandbox", {"template": "vm"})
            assert created.structured_content is not None
            detail = created.structured_content["detail"]
            assert detail["isolation"] == "microvm"
            box = detail["sandbox_id"]
            out = await client.call_tool("run_command", {"command": "uname -r; id -u", "sandbox_id": box})
            assert out.structured_content is not None
            kernel, uid = out.structured_content["detail"]["stdout"].split()
            assert kernel.endswith("-amd64")
            assert uid != "0"  # the sandbox's own host id (the workspace's owner), not the guest's root
            status = await client.call_tool("get_sandbox_status", {"sandbox_id": box})
            assert status.structured_content is not None
            assert status.structured_content["detail"]["isolation"] == "microvm"
            other = await client.call_tool("create_sandbox", {})
            assert other.structured_content is not None
            assert other.structured_content["detail"]["isolation"] == "namespaces"
    finally:
        services.close()


def test_a_microvm_template_with_binds_is_a_config_error(demo_config_path: Path, tmp_path: Path) -> None:
    text = demo_config_path.read_text()
    bind = f'read_only = [{{ source = "{tmp_path}", dest = "/data" }}]\n'
    demo_config_path.write_text(text + '\n[[template]]\nname = "vm"\nisolation = "microvm"\n' + bind)
    with pytest.raises(ConfigError, match="not available for microvm yet"):
        load_config(demo_config_path)
