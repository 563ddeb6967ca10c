"""Attacks on search_files, edit_file and read_file(as_image), as a hostile caller and as a hostile
program inside a sandbox, through the SDK's real client.

What this proves: each attack named below is refused with a typed error or bounded with truncated,
nothing of the host leaks, nothing in the workspace is lost, a secret cannot be probed through
edit_file and stays real on disk, and names a sandbox chose never reach a reason unescaped. What it
does not prove: every interleaving of the races (each proves none of those that ran went wrong).
"""

from __future__ import annotations

import json
import os
import re
import stat
import threading
import zlib
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client

from bastion.config import Config
from bastion.organizer.inbox import Organizer
from bastion.safety.errors import InvalidRequest
from bastion.safety.paths import MAX_WALK_ENTRIES, MAX_WRITE_BYTES, Jail
from bastion.safety.redact import Redactor
from bastion.tools.threads import MAX_THREADS_PER_PLACE
from bastion.tools.workbench import MAX_PARALLEL_SEARCHES
from bastion.workbench.edit import edit_text
from bastion.workbench.media import MAX_IMAGE_BYTES
from bastion.workbench.workspace import HostWorkspace
from tests.helpers import call, create, least_cpu_s, sh

BURST = 60
"""More calls at once than a place's share, and than anyio's 40 threads less the few others need."""
HELD_FOR_S = 60.0
"""The most a held call waits for its release: a failed test must not hang."""
READ_DEADLINE_S = 15.0
"""A failure bound only: the read takes milliseconds while it has a thread, and it must end while every
call of the burst is still held."""

pytestmark = pytest.mark.anyio

TOKEN = "ghp_" + "Z9y8X7w6V5u4T3s2R1q0P9o8N7m6L5k4J3i2"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# -- edit_file, hostile caller -----------------------------------------------------------------------


async def test_edit_replace_all_growing_past_the_cap_is_refused_before_it_is_built(
    client: Client, workspace: Path
) -> None:
    """Attack: 100,000 one-character matches each replaced by 1 MB would ask for 100 GB of memory; the
    result's size is computed first, so it is RESOURCE_LIMIT and the file is untouched."""
    target = workspace / "many.txt"
    target.write_text("a" * 100_000)
    refused = await call(client, "edit_file", path="many.txt", old="a", new="b" * 1_000_000, replace_all=True)
    assert refused["code"] == "RESOURCE_LIMIT", refused
    assert str(MAX_WRITE_BYTES) in refused["reason"]
    assert target.read_text() == "a" * 100_000


async def test_edit_cannot_probe_a_secret_character_by_character(client: Client, workspace: Path) -> None:
    """Attack: dry-run edits guessing a token's prefix must answer the same for a right guess and a wrong
    one; text inside a secret never matches, the redaction marker is not the file's text either."""
    target = workspace / "config.py"
    content = f"TOKEN = '{TOKEN}'\nname = 'x'\n"
    target.write_text(content)
    answers = []
    for guess in (TOKEN[:8], "ghp_QQQQ", TOKEN, "[REDACTED:github_token]", f"'{TOKEN}'\nname"):
        probed = await call(client, "edit_file", path="config.py", old=guess, new="", dry_run=True)
        answers.append((probed["code"], probed["reason"]))
    assert {code for code, _ in answers} == {"NOT_FOUND"}, answers
    assert len({reason for _, reason in answers}) == 1, answers
    # A character that occurs both inside the token and outside it: only the outside one counts.
    counted = await call(client, "edit_file", path="config.py", old="Z9", new="", replace_all=True, dry_run=True)
    assert counted["code"] == "NOT_FOUND", counted
    once = await call(client, "edit_file", path="config.py", old="x", new="y", replace_all=True)
    assert once["ok"], once
    assert once["detail"]["replacements"] == 1
    assert target.read_text() == content.replace("'x'", "'y'")


async def test_edit_writes_the_real_secret_back_never_the_redaction_marker(client: Client, workspace: Path) -> None:
    """Attack on integrity: an edit next to a secret shows the diff redacted, and the file on disk keeps the
    real token (an edit made from redacted text would destroy it)."""
    target = workspace / "settings.ini"
    target.write_text(f"[api]\ntoken = {TOKEN}\nretries = 3\n")
    done = await call(client, "edit_file", path="settings.ini", old="retries = 3", new="retries = 5")
    assert done["ok"], done
    assert TOKEN not in str(done)
    assert target.read_text() == f"[api]\ntoken = {TOKEN}\nretries = 5\n"
    assert "REDACTED" not in target.read_text()


async def test_edit_of_a_setuid_file_drops_the_bit(client: Client, workspace: Path) -> None:
    """Attack: a setuid file edited by a root server must not keep the bit with new content."""
    target = workspace / "tool.sh"
    target.write_text("#!/bin/sh\necho old\n")
    target.chmod(0o4755)
    done = await call(client, "edit_file", path="tool.sh", old="old", new="new")
    assert done["ok"], done
    mode = target.stat().st_mode
    assert not mode & (stat.S_ISUID | stat.S_ISGID)
    assert stat.S_IMODE(mode) == 0o755


async def test_edit_of_a_hard_link_to_a_file_outside_is_refused(
    client: Client, workspace: Path, tmp_path: Path
) -> None:
    """Attack: a hard link in the workspace to a host file; editing it must not change the host file."""
    outside = tmp_path / "host.conf"
    outside.write_text("secure = yes\n")
    os.link(outside, workspace / "linked.conf")
    refused = await call(client, "edit_file", path="linked.conf", old="yes", new="no")
    assert refused["code"] == "POLICY_DENIED", refused
    assert outside.read_text() == "secure = yes\n"


@pytest.mark.parametrize("path", ["a\x00b", "a\nb", "note\u202etxt.py", "a\u200bb", "a\\b"])
async def test_odd_characters_in_paths_are_refused_by_every_new_tool(
    client: Client, workspace: Path, path: str
) -> None:
    """Attack: NUL, a line break, an RTL override, a zero-width space, a backslash: INVALID_REQUEST."""
    for tool, args in (
        ("search_files", {"pattern": "x", "path": path}),
        ("edit_file", {"path": path, "old": "x", "new": "y"}),
        ("read_file", {"path": path, "as_image": True}),
    ):
        refused = await call(client, tool, **args)
        assert refused["code"] == "INVALID_REQUEST", (tool, refused)


async def test_workspace_paths_on_a_host_workspace_are_refused_and_a_real_folder_named_workspace_works(
    client: Client, workspace: Path
) -> None:
    """Decision: /workspace/... means the sandbox's view; on a host workspace it is an absolute path outside
    the folder (PATH_ESCAPE), while workspace/... is a real folder of that name, as the descriptions say."""
    (workspace / "workspace").mkdir()
    (workspace / "workspace" / "x.txt").write_text("inner\n")
    for tool, args in (
        ("read_file", {"path": "/workspace/x.txt"}),
        ("search_files", {"pattern": "inner", "path": "/workspace"}),
        ("edit_file", {"path": "/workspace/x.txt", "old": "inner", "new": "outer"}),
    ):
        refused = await call(client, tool, **args)
        assert refused["code"] == "PATH_ESCAPE", (tool, refused)
    found = await call(client, "search_files", pattern="inner", path="workspace")
    assert [m["path"] for m in found["detail"]["matches"]] == ["workspace/x.txt"]
    assert (workspace / "workspace" / "x.txt").read_text() == "inner\n"


# -- read_file(as_image), hostile files --------------------------------------------------------------


async def test_as_image_refuses_a_png_header_on_a_huge_or_sparse_file(client: Client, workspace: Path) -> None:
    """Attack: a file with PNG magic one byte over the cap, and a sparse 100 GiB one: RESOURCE_LIMIT,
    read no further than the cap."""
    (workspace / "big.png").write_bytes(PNG_MAGIC + b"\0" * (MAX_IMAGE_BYTES + 1 - len(PNG_MAGIC)))
    with open(workspace / "sparse.png", "wb") as sparse:
        sparse.write(PNG_MAGIC)
        sparse.truncate(100 * 2**30)
    for path in ("big.png", "sparse.png"):
        refused = await call(client, "read_file", path=path, as_image=True)
        assert refused["code"] == "RESOURCE_LIMIT", (path, refused)


async def test_as_image_takes_a_gif_at_the_cap_and_refuses_one_byte_more(client: Client, workspace: Path) -> None:
    """Boundary: a GIF of exactly 1 MiB is image content; 1 MiB + 1 byte is RESOURCE_LIMIT."""
    (workspace / "edge.gif").write_bytes(b"GIF89a" + b"\0" * (MAX_IMAGE_BYTES - 6))
    (workspace / "over.gif").write_bytes(b"GIF89a" + b"\0" * (MAX_IMAGE_BYTES - 5))
    taken = await client.call_tool("read_file", {"path": "edge.gif", "as_image": True})
    assert taken.structured_content is not None
    assert taken.structured_content["ok"], taken.structured_content
    assert taken.structured_content["detail"]["bytes"] == MAX_IMAGE_BYTES
    refused = await call(client, "read_file", path="over.gif", as_image=True)
    assert refused["code"] == "RESOURCE_LIMIT", refused


async def test_as_image_returns_a_decompression_bomb_as_bytes_without_decoding_it(
    client: Client, workspace: Path
) -> None:
    """Attack: a small PNG whose IDAT inflates to gigabytes; bastion never decodes, so it is just its bytes."""
    bomb = PNG_MAGIC + b"\0\0\0\rIHDR" + b"\0" * 17 + zlib.compress(b"\0" * 50_000_000, 9)
    (workspace / "bomb.png").write_bytes(bomb)
    taken = await client.call_tool("read_file", {"path": "bomb.png", "as_image": True})
    assert taken.structured_content is not None
    assert taken.structured_content["ok"]
    assert taken.structured_content["detail"]["bytes"] == len(bomb)


# -- search_files, hostile trees ---------------------------------------------------------------------


async def test_search_skips_a_sparse_100_gib_file_and_refuses_a_fifo_named_directly(
    client: Client, workspace: Path
) -> None:
    """Attack: a sparse 100 GiB file is skipped as too large (never read); a FIFO named as the path is
    refused without being opened (no reader ever blocks)."""
    with open(workspace / "huge.log", "wb") as sparse:
        sparse.write(b"needle\n")
        sparse.truncate(100 * 2**30)
    os.mkfifo(workspace / "pipe")
    found = await call(client, "search_files", pattern="needle")
    assert found["detail"]["skipped"]["too_large"] == 1
    assert found["detail"]["matches"] == []
    alone = await call(client, "search_files", pattern="needle", path="huge.log")
    assert alone["detail"]["skipped"]["too_large"] == 1
    refused = await call(client, "search_files", pattern="x", path="pipe")
    assert refused["code"] == "POLICY_DENIED", refused


async def test_search_of_a_tree_over_the_walk_cap_stops_with_truncated(client: Client, workspace: Path) -> None:
    """Attack: more entries than the walk takes (100,000): the answer is bounded and says why it stopped.
    The entries are hard links, as an agent would make them: they cost no inode (making 101,000 files took
    10 to 38 s of this machine's ext4 under the suite, hard links about 1 s)."""
    for index in range(MAX_WALK_ENTRIES // 1000 + 1):
        folder = workspace / f"d{index:03}"
        folder.mkdir()
        first = folder / "f0"
        first.touch()
        for name in range(1, 1000):
            os.link(first, folder / f"f{name}")
    found = await call(client, "search_files", pattern="needle-nowhere")
    assert found["ok"], found
    assert found["detail"]["truncated"] is True
    assert found["detail"]["truncated_by"]


# -- in a sandbox: links, races, names a program chose -----------------------------------------------


@pytest.mark.bwrap
async def test_links_climbing_out_through_workspace_dotdot_are_refused(client: Client) -> None:
    """Attack: links to /workspace/../.., /workspace/./../x and /workspace/../etc/passwd, and a relative
    chain of ../: each PATH_ESCAPE in every file tool, and nothing of the host's files shows."""
    box = await create(client)
    made = await sh(
        client,
        box,
        "ln -s /workspace/../.. up; ln -s /workspace/./../etc dotup; ln -s /workspace/../etc/passwd pw; "
        "mkdir -p a/b && ln -s ../../../../etc a/b/rel",
    )
    assert made["ok"], made
    for path in ("up/etc/passwd", "dotup/passwd", "pw", "a/b/rel/passwd", "/workspace/up/etc/hostname"):
        for tool, args in (
            ("read_file", {"path": path}),
            ("search_files", {"pattern": "root", "path": path}),
            ("edit_file", {"path": path, "old": "root", "new": "toor"}),
        ):
            refused = await call(client, tool, sandbox_id=box, **args)
            assert refused["code"] == "PATH_ESCAPE", (path, tool, refused)
            assert "root:x" not in str(refused)


@pytest.mark.bwrap
async def test_a_chain_of_40_links_resolves_and_41_is_refused(client: Client) -> None:
    """Attack: link chains at the kernel's limit (40 links, as a command would follow) and one over it."""
    box = await create(client)
    chain = "echo end > end; ln -s /workspace/end l40; for i in $(seq 39 -1 0); do ln -s l$((i+1)) l$i; done"
    made = await sh(client, box, chain + "; ln -s /workspace/l0 l_over")
    assert made["ok"], made
    inside = await sh(client, box, "cat l1; cat l0 || true")
    assert inside["detail"]["stdout"].startswith("end\n")
    read = await call(client, "read_file", path="l1", sandbox_id=box)
    assert read["detail"]["content"] == "end\n"
    for path in ("l0", "l_over"):
        refused = await call(client, "read_file", path=path, sandbox_id=box)
        assert refused["code"] == "PATH_ESCAPE", (path, refused)
        assert "40 symbolic links" in refused["reason"]


@pytest.mark.bwrap
async def test_a_link_target_with_escapes_long_or_not_utf8_is_refused_without_echoing_it(client: Client) -> None:
    """Attack: link targets a program chose (an escape sequence and a fake instruction, 4000 characters,
    bytes that are not UTF-8): refused, and the target's bytes never reach the caller."""
    box = await create(client)
    script = (
        "printf 'x' > \"$(printf 'e\\033[31mvil')\"; ln -s \"/workspace/$(printf 'e\\033[31mvil')\" esc; "
        "ln -s \"/etc/$(printf 'IGNORE\\033[2J ALL PREVIOUS')\" fake; "
        "ln -s \"/workspace/$(printf 'a/%.0s' $(seq 1 2000))\" long; "
        "printf 'y' > \"$(printf 'caf\\351')\"; ln -s \"/workspace/$(printf 'caf\\351')\" odd"
    )
    made = await sh(client, box, script)
    assert made["ok"], made
    for path, code in (("esc", "INVALID_REQUEST"), ("fake", "PATH_ESCAPE"), ("odd", "INVALID_REQUEST")):
        for tool, args in (("read_file", {"path": path}), ("edit_file", {"path": path, "old": "x", "new": "z"})):
            refused = await call(client, tool, sandbox_id=box, **args)
            assert refused["code"] == code, (path, tool, refused)
            assert "\x1b" not in str(refused)
            assert "IGNORE" not in str(refused)
    long = await call(client, "read_file", path="long", sandbox_id=box)
    assert long["code"] in ("NOT_FOUND", "INVALID_REQUEST"), long
    left = await sh(client, box, "cat \"$(printf 'e\\033[31mvil')\" \"$(printf 'caf\\351')\"")
    assert left["detail"]["stdout"] == "xy"


@pytest.mark.bwrap
async def test_search_while_a_folder_is_swapped_for_a_link_to_root_never_leaks(client: Client) -> None:
    """Attack (race): a background process swaps `d` between a folder and a link to / in a loop while
    search_files walks it; no answer holds a line of the host's files, and d's own file is intact after."""
    box = await create(client)
    made = await sh(client, box, "mkdir d && echo 'root:inside' > d/inner.txt")
    assert made["ok"], made
    loop = "while :; do mv d d.real; ln -s / d; rm d; mv d.real d; done"
    started = await call(client, "run_command", command=loop, background=True, sandbox_id=box)
    assert started["ok"], started
    try:
        for _ in range(30):
            found = await call(client, "search_files", pattern="root:", sandbox_id=box)
            assert found["ok"], found
            for match in found["detail"]["matches"]:
                assert match["text"] == "root:inside", match
    finally:
        killed = await call(client, "kill_process", pid=started["detail"]["pid"], sandbox_id=box)
        assert killed["ok"], killed
    settled = await sh(
        client, box, "if [ -L d ]; then rm d; fi; if [ -d d.real ]; then mv d.real d; fi; cat d/inner.txt"
    )
    assert settled["detail"]["stdout"] == "root:inside\n"


@pytest.mark.bwrap
async def test_edit_while_a_sandbox_process_rewrites_the_file_loses_nothing(client: Client) -> None:
    """Attack (race): a background process replaces f.txt with a new numbered version in a loop while
    edit_file edits it; every edit is OK or CONFLICT (never a traceback), and the file is always one
    whole version, edited or not, never a mix or a truncation."""
    box = await create(client)
    loop = "i=0; while :; do i=$((i+1)); printf 'version %d\\nline\\n' $i > f.tmp; mv f.tmp f.txt; done"
    assert (await sh(client, box, "printf 'version 0\\nline\\n' > f.txt"))["ok"]
    started = await call(client, "run_command", command=loop, background=True, sandbox_id=box)
    assert started["ok"], started
    codes = set()
    try:
        for _ in range(30):
            edited = await call(client, "edit_file", path="f.txt", old="line", new="LINE", sandbox_id=box)
            codes.add((edited["code"], edited["reason"]))
    finally:
        killed = await call(client, "kill_process", pid=started["detail"]["pid"], sandbox_id=box)
        assert killed["ok"], killed
    assert {code for code, _ in codes} <= {"OK", "CONFLICT", "NOT_FOUND"}, codes
    final = await call(client, "read_file", path="f.txt", sandbox_id=box)
    assert re.fullmatch(r"version \d+\n(line|LINE)\n", final["detail"]["content"]), final
    stray = await sh(client, box, "ls -a")
    assert ".bastion-edit" not in stray["detail"]["stdout"]


@pytest.mark.bwrap
async def test_links_to_template_style_read_only_folders_are_outside_the_workspace(client: Client) -> None:
    """Decision: a template's read-only folders are mounted outside /workspace (config refuses one
    inside), so a link into one is PATH_ESCAPE for edit_file, as for /etc."""
    box = await create(client)
    assert (await sh(client, box, "ln -s /usr/lib ro"))["ok"]
    refused = await call(client, "edit_file", path="ro/os-release", old="a", new="b", sandbox_id=box)
    assert refused["code"] == "PATH_ESCAPE", refused


@pytest.mark.parametrize("field", ["old", "new"])
def test_edit_with_a_lone_surrogate_is_invalid_not_an_internal_error(tmp_path: Path, field: str) -> None:
    """Attack: JSON carries "\\ud800" into old or new; no file holds it, and encoding the result would
    raise: InvalidRequest before anything is read or written."""
    (tmp_path / "f.txt").write_text("abc\n")
    args = {"old": "abc", "new": "xyz", field: "a\ud800"}
    with Jail(tmp_path) as jail, pytest.raises(InvalidRequest, match="surrogate"):
        edit_text(jail, Redactor(), "f.txt", args["old"], args["new"], replace_all=False, dry_run=False)
    assert (tmp_path / "f.txt").read_text() == "abc\n"


async def test_search_shows_a_name_that_is_not_utf8_escaped_and_answers(client: Client, workspace: Path) -> None:
    """Attack: a file whose name is not UTF-8 (a program can make one), matched by name, literal and regex:
    the answer is sent (a lone surrogate cannot be JSON) with the byte shown as \\xe9; its content is
    skipped as unreadable (no caller could name it), and list_directory shows it the same way."""
    (workspace / os.fsdecode(b"caf\xe9-needle.txt")).write_text("needle here\n")
    for regex in (False, True):
        found = await call(client, "search_files", pattern="needle", regex=regex)
        assert found["ok"], found
        assert found["detail"]["name_matches"] == ["caf\\xe9-needle.txt"]
        assert found["detail"]["skipped"]["unreadable"] == 1
    listed = await call(client, "list_directory")
    assert "caf\\xe9-needle.txt" in [entry["name"] for entry in listed["detail"]["entries"]]


async def test_special_files_are_never_opened_by_search_edit_or_as_image(client: Client, workspace: Path) -> None:
    """Attack: a FIFO (a read would block), a /dev/zero-like character device (endless bytes) and a sparse
    100 GiB file, each named directly to every new tool: refused (or too large) without reading them."""
    os.mkfifo(workspace / "pipe")
    os.mknod(workspace / "zero", 0o666 | stat.S_IFCHR, os.makedev(1, 5))
    with open(workspace / "sparse.txt", "wb") as sparse:
        sparse.write(b"old\n")
        sparse.truncate(100 * 2**30)
    for path in ("pipe", "zero"):
        for tool, args in (
            ("search_files", {"pattern": "x", "path": path}),
            ("edit_file", {"path": path, "old": "x", "new": "y"}),
            ("read_file", {"path": path, "as_image": True}),
        ):
            refused = await call(client, tool, **args)
            assert refused["code"] == "POLICY_DENIED", (path, tool, refused)
    too_large = await call(client, "edit_file", path="sparse.txt", old="old", new="new")
    assert too_large["code"] == "RESOURCE_LIMIT", too_large
    found = await call(client, "search_files", pattern="x")
    assert found["ok"], found
    assert found["detail"]["skipped"]["too_large"] == 1


async def test_a_burst_of_searches_leaves_threads_for_the_other_tools(
    client: Client, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack: more slow searches at once than the server has worker threads (40) would leave read_file
    (and every other tool that needs a thread) waiting behind them; searches queue behind a limit of
    their own. Found in the twenty-second session: the searches waiting for that limit held their workspace's
    share of threads, so a read of the same workspace (a shared host workspace: another agent's) waited for
    the whole burst. Here each search holds its thread until the end. Invariant: at most
    MAX_PARALLEL_SEARCHES run, and a read of the same workspace that needs a thread answers meanwhile."""
    (workspace / "tree").mkdir()
    (workspace / "note.txt").write_text("x" * 65536)  # over the inline size: read in a worker thread
    release, lock, entered = threading.Event(), threading.Lock(), [0]
    real = HostWorkspace.search_files

    def held(self: HostWorkspace, pattern: str, **kw: Any) -> dict[str, object]:
        with lock:
            entered[0] += 1
        release.wait(HELD_FOR_S)
        return real(self, pattern, **kw)

    monkeypatch.setattr(HostWorkspace, "search_files", held)
    answers: list[dict[str, Any]] = []

    async def search() -> None:
        answers.append(await call(client, "search_files", pattern="absent", path="tree"))

    async with anyio.create_task_group() as group:
        for _ in range(45):
            group.start_soon(search)
        try:
            with anyio.fail_after(READ_DEADLINE_S):
                while entered[0] < MAX_PARALLEL_SEARCHES:
                    await anyio.sleep(0.01)
                read = await call(client, "read_file", path="note.txt")
            assert read["detail"]["content"] == "x" * 65536
            assert entered[0] == MAX_PARALLEL_SEARCHES
            assert answers == []
        finally:
            release.set()
    assert len(answers) == 45
    assert all(answer["ok"] for answer in answers), answers


async def _read_while_a_burst_holds_threads(
    client: Client, monkeypatch: pytest.MonkeyPatch, owner: type, method: str, tool: str, args: dict[str, Any]
) -> None:
    """`BURST` calls of `tool` at once, each holding its worker thread (`owner.method`, held for the folder
    "big") until the end; meanwhile another sandbox's read_file of 64 KiB (in a worker thread: over 8 KiB)
    must answer, and the burst holds no more threads than its place's share. Held, rather than slow: the
    test does not depend on how long a call takes on a loaded machine (the read's place among the answers,
    measured before, moved with the disk's speed)."""
    release, lock, entered = threading.Event(), threading.Lock(), [0]
    real = getattr(owner, method)

    def held(self: object, folder: str = ".") -> Any:
        if folder == "big":
            with lock:
                entered[0] += 1
            release.wait(HELD_FOR_S)
        return real(self, folder)

    monkeypatch.setattr(owner, method, held)
    other = await create(client)
    assert (await sh(client, other, "head -c 65536 /dev/zero | tr '\\0' x > note.txt"))["ok"]
    answers: list[dict[str, Any]] = []

    async def burst() -> None:
        answers.append(await call(client, tool, **args))

    async with anyio.create_task_group() as group:
        for _ in range(BURST):
            group.start_soon(burst)
        try:
            with anyio.fail_after(READ_DEADLINE_S):
                while entered[0] < MAX_THREADS_PER_PLACE:
                    await anyio.sleep(0.01)
                read = await call(client, "read_file", path="note.txt", sandbox_id=other)
            assert read["detail"]["content"] == "x" * 65536
            assert entered[0] == MAX_THREADS_PER_PLACE  # the burst holds its place's share, no more
            assert answers == []
        finally:
            release.set()
    assert len(answers) == BURST
    assert all(answer["ok"] for answer in answers), answers


@pytest.mark.bwrap
async def test_a_burst_of_file_calls_from_one_workspace_leaves_threads_for_another(
    client: Client, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack: 60 list_directory calls at once on a big folder held all 40 of the server's worker threads,
    and another agent's read_file (in a thread: over 8 KiB) waited seconds behind them. A workspace's file
    tools share at most MAX_THREADS_PER_PLACE threads, so the other sandbox's read answers while the whole
    burst is still held."""
    (workspace / "big").mkdir()
    await _read_while_a_burst_holds_threads(
        client, monkeypatch, HostWorkspace, "list_directory", "list_directory", {"path": "big"}
    )


@pytest.mark.bwrap
async def test_a_burst_of_organizer_calls_leaves_threads_for_a_sandbox(
    client: Client, demo_config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: the organizer's tools ran on anyio's shared threads outside any share, and 120
    list_files calls on an inbox folder of 8,000 files made a sandbox's read_file wait 9.4 s (position 81 of
    121). An inbox holds a place's share as a workspace does."""
    (demo_config.inbox[0].path / "big").mkdir()
    await _read_while_a_burst_holds_threads(
        client, monkeypatch, Organizer, "list_files", "list_files", {"subdir": "big"}
    )


def test_an_edit_between_every_two_lines_is_diffed_in_linear_time(tmp_path: Path) -> None:
    """Attack: edit_file(dry_run) of a file of unique lines, old="\\n", new="\\nx\\n", replace_all: a line
    inserted between every two. difflib's matcher found one line at a time at the left: 12,000 lines took
    33 s of CPU in a worker thread that cannot be cancelled (a 1 MiB file, an hour). Four times the lines
    now cost about four times the time, not 16, and the diff shown still applies: its old lines, then its
    new ones."""
    jail = Jail(tmp_path)
    redactor = Redactor()
    for name, count in (("small.txt", 1_500), ("large.txt", 6_000)):
        (tmp_path / name).write_text("".join(f"{i:07d}\n" for i in range(count)))

    def edit(name: str) -> dict[str, object]:
        return edit_text(jail, redactor, name, "\n", "\nx\n", replace_all=True, dry_run=True)

    ratio = least_cpu_s(lambda: edit("large.txt")) / max(least_cpu_s(lambda: edit("small.txt")), 1e-6)
    assert ratio < 8, f"4x the lines took {ratio:.1f}x the time: quadratic"
    shown = edit("small.txt")
    assert shown["replacements"] == 1_500
    assert shown["diff_truncated"] is False
    lines = str(shown["diff"]).splitlines()
    assert lines[:3] == ["--- a/small.txt", "+++ b/small.txt", "@@ -1,1500 +1,3000 @@"]
    # The first line is the same in both, the context of one hunk: the old lines, then the new.
    assert lines[3:] == [" 0000000", *(f"-{i:07d}" for i in range(1, 1_500)), "+x"] + [
        f"+{line}" for i in range(1, 1_500) for line in (f"{i:07d}", "x")
    ]
    assert (tmp_path / "small.txt").read_text() == "".join(f"{i:07d}\n" for i in range(1_500))  # a dry run
    jail.close()


async def test_read_file_at_an_offset_past_2_63_is_an_empty_read_not_an_internal_error(
    client: Client, workspace: Path
) -> None:
    """Attack: read_file(offset=2**64), in a host workspace and in a sandbox, answered INTERNAL_ERROR (pread's
    OverflowError) with a traceback in the log. It is the read past the end of the file it is."""
    (workspace / "a.txt").write_text("abc\n")
    sandbox_id = await create(client)
    assert (await sh(client, sandbox_id, "printf 'abc\\n' > a.txt"))["ok"]
    for where in ({}, {"sandbox_id": sandbox_id}):
        for encoding in ("utf-8", "base64"):
            read = await call(client, "read_file", path="a.txt", offset=2**64, encoding=encoding, **where)
            assert read["ok"], read
            assert (read["detail"]["content"], read["detail"]["eof"], read["detail"]["size"]) == ("", True, 4)


async def test_read_file_of_control_characters_answers_within_its_size_and_pages_on(
    client: Client, workspace: Path
) -> None:
    """Attack (found by attack): 1 MiB of \\x01 is UTF-8 text, but six bytes a character in JSON, and the answer
    carries the content twice: read_file answered 13.6 MiB, about 42 MiB of the server's while its client did
    not read it, and 30 such calls took the server to 1.36 GiB. The read now stops where its escaped text would
    pass 1.5 MiB, and says so (`bytes`, `eof`): reading on from there gives the rest, none lost. A text file
    of 1 MiB, newlines and all, still comes back in one read."""
    (workspace / "controls.txt").write_bytes(b"\x01" * (1 << 20))
    (workspace / "text.txt").write_bytes(b"a line of text\tand a tab\n" * ((1 << 20) // 25))
    first = await call(client, "read_file", path="controls.txt")
    assert first["ok"], first
    detail = first["detail"]
    assert detail["eof"] is False
    assert 0 < detail["bytes"] <= (3 << 20) // 2 // 6
    assert len(json.dumps(first)) < 4 << 20, "the whole answer, content twice and escaped"
    total, offset = 0, 0
    while True:
        page = (await call(client, "read_file", path="controls.txt", offset=offset))["detail"]
        assert set(page["content"]) <= {"\x01"}
        total += len(page["content"])
        offset += page["bytes"]
        if page["eof"]:
            break
    assert total == 1 << 20
    text = (await call(client, "read_file", path="text.txt"))["detail"]
    assert (text["eof"], text["bytes"]) == (True, ((1 << 20) // 25) * 25)
