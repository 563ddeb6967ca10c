"""Templates that ask for a microVM: refused with one line where a guest cannot boot, else the same tools."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest
from mcp import Client

from bastion.app import build_server, build_services
from bastion.config import load_config
from bastion.safety.errors import ConfigError
from bastion.workbench.manager import SandboxManager
from tests.helpers import DATA_ENV, call, create, sh
from tests.sandbox.egress_helpers import HOSTS, OPEN_RANGES, Web
from tests.sandbox.microvm_helpers import microvm_settings, with_vm_template
from tests.workbench.test_terminals import FG_PRINTED, open_term, send, until

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap, pytest.mark.root]


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


def test_a_microvm_template_with_more_folders_than_the_guest_has_slots_for_is_a_config_error(
    demo_config_path: Path, tmp_path: Path
) -> None:
    """Each read-only folder is a 9p device of the guest (a PCI slot): at most 8, said in one line."""
    text = demo_config_path.read_text()
    binds = ", ".join(f'{{ source = "{tmp_path}", dest = "/data{n}" }}' for n in range(9))
    demo_config_path.write_text(text + f'\n[[template]]\nname = "vm"\nisolation = "microvm"\nread_only = [{binds}]\n')
    with pytest.raises(ConfigError, match="shows at most 8 read-only folders"):
        load_config(demo_config_path)


FETCH_COMMAND = "python3 -c 'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())' "
POOL_AND_NETWORK = """
[sandboxes.network]
allow = ["allowed.test:{port}"]
blocked_ranges = {blocked}
hosts = {hosts}
"""


async def until_pooled(manager: SandboxManager, count: int, limit_s: float) -> None:
    """Poll (a boot sends no event the test could wait on) until `count` guests wait in the pool."""
    async with asyncio.timeout(limit_s):
        while manager.booted_waiting("vm") < count:
            await asyncio.sleep(0.1)


@pytest.mark.microvm
async def test_a_pooled_microvm_is_handed_out_without_a_boot_and_its_egress_goes_through_the_proxy(
    demo_config_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """One boot proves both: the warm pool's guest is handed out (a TCG boot takes 10-40 s here; the
    bench measures the handout in ms), and network_allow works through the forwarder, the egress
    port and the proxy, with the same audit records as a namespace sandbox's."""
    settings = microvm_settings(tmp_path_factory)
    web = Web()
    threading.Thread(target=web.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    port = web.server_address[1]
    network = POOL_AND_NETWORK.format(
        port=port,
        blocked=json.dumps(list(OPEN_RANGES)),
        hosts="{ " + ", ".join(f'"{name}" = {json.dumps(a)}' for name, a in HOSTS.items()) + " }",
    )
    config = with_vm_template(demo_config_path, settings.image_dir, emulation=True, extra=network)
    config.write_text(config.read_text().replace("boot_timeout_s = 180", "boot_timeout_s = 180\nwarm_pool = 1"))
    services = build_services(load_config(config))
    try:
        async with Client(build_server(services, caller="test")) as client:
            services.sandboxes.refill_pool()
            await until_pooled(services.sandboxes, 1, 300)
            started = time.monotonic()
            box = await create(client, template="vm", network_allow=[f"allowed.test:{port}"])
            assert time.monotonic() - started < 5
            assert services.sandboxes.booted_waiting("vm") == 0  # the next one is booting
            allowed = await sh(client, box, FETCH_COMMAND + f"http://allowed.test:{port}/")
            assert allowed["detail"]["stdout"] == "hello from the host\n", allowed
            denied = await sh(client, box, FETCH_COMMAND + f"http://denied.test:{port}/")
            assert "HTTP Error 403" in denied["detail"]["stderr"], denied
            assert web.paths == ["/"]
    finally:
        services.close()
        web.shutdown()
        web.server_close()
    audit = demo_config_path.parent / "state" / "audit.jsonl"
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    egress = [(r["domain"], r["decision"]) for r in records if r.get("event") == "egress"]
    # An allowed connection is audited when it ends, which may be after the next refusal: compare sorted.
    assert sorted(egress) == [("allowed.test", "allow"), ("denied.test", "deny")]


@pytest.mark.microvm
async def test_a_microvm_snapshot_restores_into_a_new_microvm_with_the_files_as_they_were(
    demo_config_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The guest is frozen while its workspace is archived; the restore boots a guest of the same
    template on a copy of it, and what the source changed after the snapshot is not there."""
    settings = microvm_settings(tmp_path_factory)
    services = build_services(load_config(with_vm_template(demo_config_path, settings.image_dir, emulation=True)))
    try:
        async with Client(build_server(services, caller="test")) as client:
            source = await create(client, template="vm")
            await sh(client, source, "echo kept > file; mkdir -p sub; echo deep > sub/more")
            snapshot = await call(client, "snapshot_sandbox", sandbox_id=source)
            assert snapshot["ok"], snapshot
            assert snapshot["detail"]["files"] == 2
            changed = await sh(client, source, "echo changed > file; touch extra; cat file")
            assert changed["detail"]["stdout"] == "changed\n"  # the guest was thawed after the archive
            restored = await call(client, "restore_sandbox", snapshot_id=snapshot["detail"]["snapshot_id"])
            assert restored["ok"], restored
            assert restored["detail"]["isolation"] == "microvm"
            copy = restored["detail"]["sandbox_id"]
            seen = await sh(client, copy, "cat file sub/more; ls; uname -r")
            kept, deep, *listing, kernel, _ = seen["detail"]["stdout"].split("\n")
            assert (kept, deep, listing) == ("kept", "deep", ["file", "sub"])  # no "extra": made after
            assert kernel.endswith("-amd64")  # the guest's kernel: a microVM again
    finally:
        services.close()


@pytest.mark.microvm
async def test_a_microvm_terminal_has_its_size_a_resize_job_control_and_ctrl_c(
    demo_config_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Through the real tools, as tests/workbench/test_terminals.py proves it for namespaces: the guest's
    pty is carried to the terminal code, which renders it, resizes it (a frame to the guest) and sends
    keys that the guest's line discipline turns into job control."""
    settings = microvm_settings(tmp_path_factory)
    services = build_services(load_config(with_vm_template(demo_config_path, settings.image_dir, emulation=True)))
    try:
        async with Client(build_server(services, caller="test")) as client:
            box = await create(client, template="vm")
            term = await open_term(client, box, rows=24, cols=80)
            await vm_line(client, term, "tty; stty size", "24 80")
            resized = await call(client, "terminal_resize", terminal_id=term, rows=30, cols=100)
            assert resized["ok"], resized
            await vm_line(client, term, "stty size", "30 100")
            await send(client, term, 'sh -c \'echo ar""med; read x; echo g""ot; exec sleep 100\'', "Enter")
            await until(client, term, "(?m)^armed$", timeout_s=60)
            await send(client, term, "", "Ctrl-Z")
            await until(client, term, r"Stopped\s+sh -c", timeout_s=60)
            await send(client, term, "fg", "Enter")
            await until(client, term, FG_PRINTED, timeout_s=60)  # see test_terminals.py
            await send(client, term, "go", "Enter")
            await until(client, term, "(?m)^got$", timeout_s=60)
            await send(client, term, "", "Ctrl-C")
            await vm_line(client, term, "echo status=$?", "status=130")
            await vm_line(client, term, "sleep 100 & echo started-$((1 + 2))", "started-3")
            closed = await call(client, "close_terminal", terminal_id=term)
            assert closed["ok"], closed
            left = await sh(client, box, "ps -eo args | grep -c '[s]leep 100' || true")
            assert left["detail"]["stdout"].strip() == "0"
    finally:
        services.close()


async def vm_line(client: Client, terminal: str, command: str, marker: str) -> None:
    """Type a command line and wait (a guest under emulation: up to a minute) for a line that is `marker`."""
    await send(client, terminal, command, "Enter")
    await until(client, terminal, f"(?m)^{marker}$", timeout_s=60)


@pytest.mark.microvm
@pytest.mark.skipif(
    not (DATA_ENV / "pyvenv.cfg").is_file(), reason="the python-data environment is built by `make install`"
)
async def test_a_microvm_template_shows_its_folders_and_python_env_read_only(
    demo_config_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A template's read_only folder and python_env reach the guest over 9p where the namespace backend
    binds them (`python` is the env's, with its packages), read-only twice over: QEMU opens the export
    read-only and the guest mounts it so (a write fails with EROFS, and nothing reaches the host)."""
    settings = microvm_settings(tmp_path_factory)
    data = tmp_path_factory.mktemp("vm-data")
    (data / "table.csv").write_text("a,b\n1,2\n")
    data.chmod(0o755)
    extra = f'read_only = [{{ source = "{data}", dest = "/data" }}]\npython_env = "{DATA_ENV}"\n'
    config = with_vm_template(demo_config_path, settings.image_dir, emulation=True, extra=extra)
    services = build_services(load_config(config))
    try:
        async with Client(build_server(services, caller="test")) as client:
            box = await create(client, template="vm")
            script = "cat /data/table.csv; touch /data/new 2>&1; touch /opt/bastion/env/new 2>&1; "
            script += "python -c 'import sys, numpy; print(sys.prefix, numpy.__name__)'"
            seen = await sh(client, box, script, timeout_s=120)
            lines = seen["detail"]["stdout"].splitlines()
            assert lines[:2] == ["a,b", "1,2"], seen
            assert "Read-only file system" in lines[2]
            assert "Read-only file system" in lines[3]
            assert lines[4] == "/opt/bastion/env numpy", seen
            assert not (data / "new").exists()
    finally:
        services.close()
