"""Host workspace output handling through the real tools: redaction, truncation, escapes."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from mcp import Client

from bastion.app import build_server, build_services, detect_cgroups
from bastion.config import load_config
from bastion.safety.errors import ConfigError, Unavailable
from bastion.safety.output import clean_output
from bastion.safety.redact import Redactor
from bastion.sandbox._idmap import idmapped_mount, is_mounted, unmount
from bastion.sandbox.identity import IdentityPool
from bastion.workbench import workspace as workspace_module
from bastion.workbench.workers import INLINE_CLEAN_CHARS
from bastion.workbench.workspace import IDMAP_DIR, IDMAP_MOUNT, HostWorkspace
from tests.helpers import Hold, Payload, bubblewrap, create, demo_config_at

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]

AWS_KEY = "AKIAIOSFODNN7EXAMPLE"


async def _run(client: Client, command: str) -> Payload:
    result = await client.call_tool("run_command", {"command": command})
    assert result.structured_content is not None
    return result.structured_content


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`, read from /proc (one may exit while we look)."""
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as handle:
                for child in handle.read().split():
                    found += [int(child), *_descendants(int(child))]
    except OSError:
        pass
    return found


async def test_secret_split_by_an_escape_sequence_is_still_redacted(client: Client) -> None:
    """Invariant: escapes are removed before redaction, so they cannot hide a secret from it."""
    payload = await _run(client, "printf 'AKIAIOSF\\033[0mODNN7EXAMPLE\\n'")
    stdout = payload["detail"]["stdout"]
    assert "\x1b" not in stdout
    assert AWS_KEY not in stdout
    assert "REDACTED" in stdout


async def test_truncation_never_leaves_half_a_secret(client: Client, workspace: object) -> None:
    """Invariant: a secret straddling the output cap leaves no prefix behind."""
    # 65,536 is the demo's max_output_bytes; the key starts 10 bytes before the cut.
    payload = await _run(client, f"printf '%065526d{AWS_KEY}tail' 0")
    detail = payload["detail"]
    assert payload["code"] == "OUTPUT_TRUNCATED"
    assert payload["ok"] is True
    stdout = detail["stdout"]
    assert "AKIA" not in stdout
    assert len(stdout) <= 65_536


async def test_cwd_inside_the_workspace(client: Client, workspace: object) -> None:
    await client.call_tool("run_command", {"command": "mkdir -p sub/dir"})
    result = await client.call_tool("run_command", {"command": "pwd", "cwd": "sub/dir"})
    assert result.structured_content is not None
    assert result.structured_content["detail"]["stdout"] == "/workspace/sub/dir\n"


@pytest.mark.parametrize(
    ("cwd", "code"),
    [("../..", "PATH_ESCAPE"), ("/etc", "PATH_ESCAPE"), ("missing", "NOT_FOUND"), ("README.md", "INVALID_REQUEST")],
)
async def test_cwd_outside_or_missing_is_refused(client: Client, cwd: str, code: str) -> None:
    result = await client.call_tool("run_command", {"command": "pwd", "cwd": cwd})
    assert result.structured_content is not None
    assert result.structured_content["code"] == code
    assert result.structured_content["detail"] == {}


async def test_memory_hog_is_resource_limit(demo_config_path: Path) -> None:
    """Invariant: a command past the workspace's memory limit is killed and reported RESOURCE_LIMIT."""
    text = demo_config_path.read_text()
    assert "memory_bytes = " in text
    # The workspace's limit (the first); the sandboxes' ceiling must stay above twice /tmp + /dev/shm.
    demo_config_path.write_text(text.replace("memory_bytes = 1073741824", "memory_bytes = 67108864", 1))
    services = build_services(load_config(demo_config_path))
    try:
        async with Client(build_server(services, caller="test")) as client:
            result = await client.call_tool("run_command", {"command": "sort /dev/zero", "timeout_s": 20})
    finally:
        services.close()
    assert result.structured_content is not None
    assert result.structured_content["code"] == "RESOURCE_LIMIT"
    assert result.is_error is True


def _host_uid(pid: int) -> int:
    """The real uid of a process, as the host sees it."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid line for {pid}")


def _mounts_under(folder: Path) -> list[str]:
    text = Path("/proc/self/mountinfo").read_text()
    return [line for line in text.splitlines() if f" {folder}/" in line or f" {folder} " in line]


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="idmapped mounts are a root server's")
def test_host_workspace_mount_is_gone_after_close_and_a_crashed_servers_is_dropped_at_start(
    demo_config_path: Path,
) -> None:
    """Invariant: a root server's idmapped mount of a host workspace lives only while the server
    does: closing removes it, and one a crashed server left (or one of a workspace no longer in the
    config, or one an older server mounted at idmap/<id> itself) is unmounted and removed at the next
    start, so mounts never pile up."""
    config = load_config(demo_config_path)
    services = build_services(config)
    mounts = config.state_dir / IDMAP_DIR
    try:
        assert [line.split()[4] for line in _mounts_under(mounts)] == [str(mounts / "default" / IDMAP_MOUNT)]
    finally:
        services.close()
    assert _mounts_under(mounts) == []
    # As killed servers leave them: the workspace's mount, one of a workspace since removed, an older layout's.
    stale = (mounts / "default" / IDMAP_MOUNT, mounts / "gone" / IDMAP_MOUNT, mounts / "older")
    for target in stale:
        target.mkdir(parents=True, exist_ok=True)
        idmapped_mount(config.workspace[0].path, target, owner=(0, 0), identity=(1879048192, 1879048192))
    try:
        services = build_services(config)
        services.close()
    finally:
        for target in stale:
            if is_mounted(target):
                unmount(target)
    assert _mounts_under(mounts) == []
    assert not (mounts / "gone").exists()
    assert not (mounts / "older").exists()


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="ids of their own are a root server's")
async def test_host_workspace_files_are_the_folder_owners_and_its_commands_are_not_root(tmp_path: Path) -> None:
    """Invariant: in a folder owned by an ordinary user, files made by a command and by write_file
    are that user's on the host, while the command itself runs as an id of the range, not as the
    owner and not as root (its processes are seen from the host)."""
    config_path = demo_config_at(tmp_path / "demo")
    workspace = load_config(config_path).workspace[0].path
    for entry in (workspace, *workspace.rglob("*")):
        os.chown(entry, 12345, 12346, follow_symlinks=False)
    services = build_services(load_config(config_path))
    try:
        async with Client(build_server(services, caller="test")) as client:
            made = await _run(client, "mkdir made")
            assert made["ok"], made
            written = await client.call_tool("write_file", {"path": "made/by-tool.txt", "content": "x"})
            assert not written.is_error, written
            ran = await _run(client, "cat /proc/self/status")
            # From the host: every process of the workspace's sandbox (bwrap, the agent) and their ids.
            bwrap = bubblewrap(services.registry.get(None).sandbox)._proc
            assert bwrap is not None
            host_uids = {_host_uid(pid) for pid in (bwrap.pid, *_descendants(bwrap.pid))}
        status = str(ran["detail"]["stdout"])
        assert "Uid:\t1000\t1000\t1000\t1000" in status  # inside: the sandbox user
        first, count = load_config(config_path).sandboxes.host_ids
        assert len(host_uids) == 1, host_uids
        assert first <= host_uids.pop() < first + count  # neither root nor the owner
    finally:
        services.close()
    for path in (workspace / "made", workspace / "made" / "by-tool.txt"):
        info = path.stat()
        assert (info.st_uid, info.st_gid) == (12345, 12346), path


@pytest.fixture
def ramfs_workspace(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """The demo config with its workspace on a ramfs (a filesystem without idmapped mounts)."""
    config_path = demo_config_at(tmp_path / "demo")
    workspace = load_config(config_path).workspace[0].path
    subprocess.run(["mount", "-t", "ramfs", "-o", "mode=0755", "bastion-test", str(workspace)], check=True)
    try:
        yield config_path, workspace
    finally:
        subprocess.run(["umount", "-l", str(workspace)], check=True)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="ids of their own are a root server's")
async def test_without_idmapped_mounts_a_users_folder_runs_as_that_user_and_a_roots_is_refused(
    ramfs_workspace: tuple[Path, Path],
) -> None:
    """Invariant: where the filesystem has no idmapped mounts, a root server never falls back to
    running a host workspace as root: a root-owned folder stops the start with one line, and a
    folder of an ordinary user is worked on as that user (its files are the user's)."""
    config_path, workspace = ramfs_workspace
    with pytest.raises(ConfigError, match=r"is root's and idmapped mounts are unavailable .*: chown it"):
        build_services(load_config(config_path))
    os.chown(workspace, 12345, 12346)
    services = build_services(load_config(config_path))
    try:
        async with Client(build_server(services, caller="test")) as client:
            made = await _run(client, "mkdir made")
            assert made["ok"], made
            bwrap = bubblewrap(services.registry.get(None).sandbox)._proc
            assert bwrap is not None
            assert {_host_uid(pid) for pid in (bwrap.pid, *_descendants(bwrap.pid))} == {12345}
    finally:
        services.close()
    info = (workspace / "made").stat()
    assert (info.st_uid, info.st_gid) == (12345, 12346)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="idmapped mounts are a root server's")
def test_a_mount_of_another_folder_than_the_jail_holds_is_refused_and_nothing_is_left(
    demo_config_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack: the idmapped mount is made from the configured path, whose last component alone is not
    followed; a user owning a middle component swaps it for a link between the file tools' open and the
    mount's, so commands would write another folder as its owner. Simulated by mounting another folder:
    the start is refused, the mount is removed, and the workspace's identity is free again."""
    config = load_config(demo_config_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def swapped(source: object, target: Path, **ids: tuple[int, int]) -> None:
        idmapped_mount(elsewhere, target, **ids)

    monkeypatch.setattr("bastion.workbench.workspace.idmapped_mount", swapped)
    pool = IdentityPool(*config.sandboxes.host_ids)
    opened: dict[str, HostWorkspace] = {}
    try:
        with pytest.raises(Unavailable, match="are not the same"):
            opened.update(workspace_module.open_host_workspaces(config, Redactor(), detect_cgroups(config), pool))
    finally:
        for host in opened.values():  # without the check, the workspace served the other folder
            host.close()
    mounts = config.state_dir / IDMAP_DIR
    assert _mounts_under(mounts) == []
    assert pool.in_use() == 0  # the workspace's identity was released


def test_a_workspace_folder_replaced_by_a_link_to_itself_is_refused_not_followed(demo_config_path: Path) -> None:
    """Attack: the configured folder is moved and a symlink to it put at its path. Followed, the check saw the
    same folder and served on; the server's checks never follow a link at the configured path."""
    config = load_config(demo_config_path)
    services = build_services(config)
    try:
        folder = config.workspace[0].path
        moved = folder.with_name(folder.name + "-moved")
        folder.rename(moved)
        folder.symlink_to(moved)
        try:
            with pytest.raises(Unavailable, match="replaced by a link"):
                services.registry.get(None).check_folder()
        finally:
            folder.unlink()
            moved.rename(folder)
        services.registry.get(None).check_folder()  # put back: served again
    finally:
        services.close()


def test_a_config_whose_workspace_goes_through_a_symlink_is_refused(demo_config_path: Path) -> None:
    """Attack: a user who owns a component of a configured folder turns it into a link to /etc before a restart;
    the config naming that path is refused with the real path to configure."""
    config = load_config(demo_config_path)
    folder = config.workspace[0].path
    real = folder.with_name(folder.name + "-real")
    folder.rename(real)
    folder.symlink_to(real)
    with pytest.raises(ConfigError, match="goes through a symbolic link"):
        load_config(demo_config_path)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="idmapped mounts are a root server's")
def test_a_host_workspace_that_fails_to_open_after_its_mount_leaves_no_mount(demo_config_path: Path) -> None:
    """A workspace whose opening fails once its idmapped mount is made (here: limits configured, no cgroups
    given) took the mount with it only at the next start; now at once, with its identity."""
    config = load_config(demo_config_path)
    pool = IdentityPool(*config.sandboxes.host_ids)
    with pytest.raises(Unavailable, match="cgroups"):
        workspace_module.open_host_workspaces(config, Redactor(), None, pool)
    assert _mounts_under(config.state_dir / IDMAP_DIR) == []
    assert pool.in_use() == 0


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="acting as the folder's owner is a root server's")
@pytest.mark.parametrize("owner", ["a-user", "root"])
async def test_file_tools_in_a_shared_folder_are_refused_what_its_commands_are_refused(
    tmp_path: Path, owner: str
) -> None:
    """Attack: another user's 0600 file (and 0700 folder) in a host workspace: `cat` in the workspace is
    refused, and read_file, run by the root server, returned it. Both are refused now, and nothing of the
    file reaches the client. Found again 2026-12-06 for a folder of root's (the demo's): the file tools kept
    root's file capabilities there, read and wrote the file, and made a file in the other user's folder."""
    config_path = demo_config_at(tmp_path / "demo")
    workspace = load_config(config_path).workspace[0].path
    if owner == "a-user":
        for entry in (workspace, *workspace.rglob("*")):
            os.chown(entry, 12345, 12346, follow_symlinks=False)
    private = workspace / "bob-private.txt"
    private.write_text("BOB-PRIVATE-NOTES")
    os.chown(private, 4242, 4242)
    private.chmod(0o600)
    theirs = workspace / "bob-dir"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 4242, 4242)
    services = build_services(load_config(config_path))
    try:
        async with Client(build_server(services, caller="test")) as client:
            ran = await _run(client, "cat bob-private.txt")
            read = await client.call_tool("read_file", {"path": "bob-private.txt"})
            written = await client.call_tool("write_file", {"path": "bob-private.txt", "content": "gone"})
            planted = await client.call_tool("write_file", {"path": "bob-dir/planted.txt", "content": "x"})
    finally:
        services.close()
    assert ran["detail"]["exit_status"] != 0, ran
    assert "Permission denied" in str(ran["detail"]["stderr"])
    for refused in (read, written, planted):
        assert refused.structured_content is not None
        assert refused.structured_content["code"] == "OPERATION_FAILED", refused.structured_content
        assert "BOB-PRIVATE-NOTES" not in str(refused.structured_content)
    assert private.read_text() == "BOB-PRIVATE-NOTES"
    assert os.listdir(theirs) == []


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="a root server's")
def test_a_workspace_another_user_could_replace_is_refused_at_start(demo_config_path: Path) -> None:
    """Attack (found by review): a user owning the workspace's parent renames a root-owned folder of theirs
    (say a container's data) into the configured name; only links were refused, so the root server served
    it as its owner, root, and the file tools and commands wrote root's files. A workspace that a user other
    than root and its owner could replace is refused at start, naming who."""
    # The state folder stays in a folder of root's: in the other user's it is refused first (test_neighbour_attacks).
    state = demo_config_path.parent.parent / "state"
    demo_config_path.write_text(demo_config_path.read_text().replace('state_dir = "state"', f'state_dir = "{state}"'))
    config = load_config(demo_config_path)
    folder = config.workspace[0].path
    os.chown(folder.parent, 12345, 12345)
    for inbox in config.inbox:  # the demo's inbox beside it is theirs: only the workspace is in question
        for entry in (inbox.path, *inbox.path.rglob("*")):
            os.chown(entry, 12345, 12345, follow_symlinks=False)
    with pytest.raises(ConfigError, match=r"workspace 'default': .* could be replaced by another folder by uid 12345"):
        build_services(config).close()  # closed if served anyway, so a failure leaves no mount
    assert _mounts_under(config.state_dir / IDMAP_DIR) == []
    for entry in (folder, *folder.rglob("*")):
        os.chown(entry, 12345, 12345, follow_symlinks=False)
    build_services(config).close()  # the folder is the parent's owner's now: served


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="a root server's")
@pytest.mark.parametrize("mode", [0o777, 0o1777])
def test_a_host_workspace_other_users_may_write_is_refused_at_start(demo_config_path: Path, mode: int) -> None:
    """Attack (p5_world_writable_root.py): a root-owned workspace made 0777 (by a command, before its filter
    refused that, or by hand) let any local user rename root's files in it, and plant a setuid file that
    then kept the server from starting. Invariant: a host workspace folder that users besides root and its
    owner may write (sticky or not) is refused at start, in one line naming who and what to do, before the
    setuid scan, leaving no mount; once chmod go-w it is served. Does not look at the folders inside it."""
    config = load_config(demo_config_path)
    folder = config.workspace[0].path
    planted = folder / "tool"
    planted.write_bytes(b"")
    os.chown(planted, 65534, 65534)
    planted.chmod(0o4755)
    folder.chmod(mode)
    with pytest.raises(ConfigError) as refused:
        build_services(config).close()  # closed if served anyway, so a failure leaves no mount
    assert str(refused.value) == (
        f"workspace 'default': {folder} may be written by any user, who could rename or plant files in it: "
        "chmod go-w it (and remove ACL entries that grant write)"
    )
    assert _mounts_under(config.state_dir / IDMAP_DIR) == []
    assert folder.stat().st_mode & 0o7777 == mode
    folder.chmod(0o755)
    planted.unlink()
    build_services(config).close()


async def _explained(client: Client, command: str) -> Payload:
    result = await client.call_tool("explain_command", {"command": command})
    assert result.structured_content is not None
    return result.structured_content


async def test_git_global_option_valued_as_an_allowed_subcommand_runs_nothing(client: Client, workspace: Path) -> None:
    """Invariant: `git --namespace status clean` (and -C, --git-dir with a separate value) is refused, as
    `git clean` is: the option's value never passes for the subcommand. Runs the attacker's three commands
    in the real host workspace and checks that no file was deleted, no program ran and no alias was made.
    Does not cover what a .git/config the agent wrote makes git do (see the policy's docstring)."""
    assert (await _run(client, "git init -q"))["ok"]
    assert (await _run(client, "touch precious.txt"))["ok"]
    assert (await _run(client, "mkdir status"))["ok"]
    before = sorted(p.name for p in workspace.iterdir())
    git_status = (await _run(client, "git --no-pager status --short"))["detail"]["stdout"]
    assert "?? precious.txt\n" in git_status
    attacks = [
        "git --namespace status clean -fdx",
        "git --namespace status clone -q -u 'touch /workspace/UPLOAD_PACK_RAN; false' /workspace/.git cloned",
        "git -C status --git-dir=/workspace/.git config alias.x '!touch /workspace/ALIAS_RAN'",
        "git --namespace status x",
    ]
    for command in attacks:
        refused = await _run(client, command)
        assert refused["code"] == "POLICY_DENIED", (command, refused)
        explained = await _explained(client, command)
        assert explained["detail"]["allowed"] is False
        assert explained["detail"]["reason"] == refused["reason"]
    assert (workspace / "precious.txt").exists()
    assert sorted(p.name for p in workspace.iterdir()) == before
    assert "alias" not in (workspace / ".git" / "config").read_text()
    assert (await _run(client, "git --no-pager status --short"))["detail"]["stdout"] == git_status


async def test_wildcard_policy_runs_no_versioned_or_hard_linked_name_of_a_denied_interpreter(
    demo_config_path: Path,
) -> None:
    """Invariant: with allow = ["*"] and the demo's deny list, python3.11 (the file behind the denied
    python3), perl5.36.0 (a hard link of perl), pydoc3.11 and tclsh8.6 are refused, and none of them ran.
    Does not prove the deny list names every interpreter a system has."""
    text = demo_config_path.read_text()
    start = text.index("allow = [", text.index("[workspace.policy]"))
    demo_config_path.write_text(text[:start] + 'allow = ["*"]' + text[text.index("\n", start) :])
    config = load_config(demo_config_path)
    workspace = config.workspace[0].path
    attacks = [
        'python3.11 -c \'open("/workspace/PY_RAN", "w")\'',
        "perl5.36.0 -e 'open(F, \">/workspace/PERL_RAN\")'",
        "/usr/bin/perl5.36.0 -e 'open(F, \">/workspace/PERL_RAN\")'",
        "pydoc3.11 -w json",
        "tclsh8.6 /dev/null",
    ]
    before = sorted(p.name for p in workspace.iterdir())
    services = build_services(config)
    try:
        async with Client(build_server(services, caller="test")) as client:
            for command in attacks:
                refused = await _run(client, command)
                assert refused["code"] == "POLICY_DENIED", (command, refused)
                explained = await _explained(client, command)
                assert explained["detail"]["allowed"] is False
                assert explained["detail"]["reason"] == refused["reason"]
    finally:
        services.close()
    assert sorted(p.name for p in workspace.iterdir()) == before


async def test_a_command_with_long_output_is_cleaned_off_the_event_loop(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by attack: run_command cleaned and redacted its output on the event loop, about 1 us a character on
    lines of `key=`: 64 KiB of them (the default cap; `max_output_bytes` goes to 16 MiB) took 40 to 70 ms of every
    agent's calls. Here the cleaning of the long output is held in its worker until the test releases it.
    Invariant: another call is answered meanwhile, and the output comes back whole and redacted."""
    box = await create(client)
    hold = Hold()
    real = clean_output

    def held(redactor: Redactor, raw: bytes, *, cut: bool) -> str:
        if len(raw) > INLINE_CLEAN_CHARS:
            hold.wait()
        return real(redactor, raw, cut=cut)

    monkeypatch.setattr(workspace_module, "clean_output", held)
    command = "for i in $(seq 2000); do echo key=$i; done; echo password=hunter2hunter2"
    ran = await hold.call(client, "run_command", sandbox_id=box, command=command)
    out = ran["detail"]["stdout"]
    assert ran["ok"], ran
    assert out.count("\n") == 2001
    assert "hunter2hunter2" not in out
    assert "[REDACTED:" in out
