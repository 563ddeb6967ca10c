"""search_files, edit_file and read_file(as_image) through the SDK's real client, on the demo's host
workspace and in real sandboxes.

What this proves: the search and edit semantics a model relies on from the descriptions alone;
that a secret shows in neither search results nor diffs (and cannot be probed by a pattern);
that secret files, binaries, oversized files and symlinks leaving the workspace are skipped or
refused; that images come back as image content typed by their bytes. What it does not prove:
the regex bound in every shape (tests/safety/test_search.py), the jail's view under races
(tests/safety/test_paths_view.py).
"""

from __future__ import annotations

import base64
import json
import os
import stat
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from mcp_types import ImageContent

from bastion.safety.paths import MAX_READ_BYTES
from bastion.workbench.edit import MAX_DIFF_CHARS
from bastion.workbench.search import MAX_SEARCH_FILE_BYTES
from tests.helpers import call, create, sh

pytestmark = pytest.mark.anyio

TOKEN = "ghp_" + "Z9y8X7w6V5u4T3s2R1q0P9o8N7m6L5k4J3i2"


def png(width: int = 2, height: int = 1) -> bytes:
    """A real, valid PNG (so a viewer would show it), built by hand."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\0" + b"\xff\x00\x00" * width for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


@pytest.fixture
def tree(workspace: Path) -> Path:
    (workspace / "src").mkdir()
    (workspace / "src" / "app.py").write_text("import os\n\ndef main():\n    return os.getcwd()\n")
    (workspace / "src" / "util.py").write_text("def helper():\n    return 'a.c'\n")
    (workspace / "notes.md").write_text("main ideas\nabc\n")
    return workspace


# -- search_files ------------------------------------------------------------------------------------


async def test_search_finds_lines_with_numbers_and_names(client: Client, tree: Path) -> None:
    """Content matches carry path, 1-based line number and the line; a name containing the pattern is listed."""
    found = await call(client, "search_files", pattern="main")
    assert found["ok"], found
    detail = found["detail"]
    assert {"path": "src/app.py", "line": 3, "text": "def main():"} in detail["matches"]
    assert {"path": "notes.md", "line": 1, "text": "main ideas"} in detail["matches"]
    assert detail["truncated"] is False
    named = await call(client, "search_files", pattern="util")
    assert named["detail"]["name_matches"] == ["src/util.py"]


async def test_search_is_literal_by_default_and_regex_on_request(client: Client, tree: Path) -> None:
    """'a.c' literal finds only the literal text; regex=true lets '.' match any character."""
    literal = await call(client, "search_files", pattern="a.c")
    assert [(m["path"], m["line"]) for m in literal["detail"]["matches"]] == [("src/util.py", 2)]
    regex = await call(client, "search_files", pattern="a.c", regex=True)
    assert ("notes.md", 2) in [(m["path"], m["line"]) for m in regex["detail"]["matches"]]


async def test_search_path_and_glob_narrow_it(client: Client, tree: Path) -> None:
    """path limits the folder (or names one file); glob filters file names."""
    only_src = await call(client, "search_files", pattern="return", path="src", glob="app*")
    assert [m["path"] for m in only_src["detail"]["matches"]] == ["src/app.py"]
    one_file = await call(client, "search_files", pattern="def", path="src/util.py")
    assert [m["line"] for m in one_file["detail"]["matches"]] == [1]


async def test_search_shows_a_secret_redacted_and_cannot_probe_it(client: Client, tree: Path) -> None:
    """A token in a file is shown redacted, and a regex that would match its characters finds nothing."""
    (tree / "config.py").write_text(f"GITHUB = '{TOKEN}'\n")
    shown = await call(client, "search_files", pattern="GITHUB")
    assert shown["detail"]["matches"][0]["text"] == "GITHUB = '[REDACTED:github_token]'"
    for probe in (TOKEN[:8], "ghp_Z9", "ghp_[A-Z]"):
        probed = await call(client, "search_files", pattern=probe, regex="[" in probe)
        assert probed["detail"]["matches"] == [], probe
    assert TOKEN not in str(shown)


async def test_search_shows_a_multiline_key_redacted_with_line_numbers_kept(client: Client, tree: Path) -> None:
    """A line inside a PEM key is never shown; a line after it keeps its true number."""
    key = "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA7\nQWERTY\n-----END RSA PRIVATE KEY-----\n"
    (tree / "bundle.txt").write_text("first\n" + key + "after the key\n")
    probe = await call(client, "search_files", pattern="QWERTY")
    assert probe["detail"]["matches"] == []
    after = await call(client, "search_files", pattern="after the key")
    assert after["detail"]["matches"] == [{"path": "bundle.txt", "line": 6, "text": "after the key"}]


async def test_search_skips_secret_files_binaries_and_large_files(client: Client, tree: Path) -> None:
    """.env and .ssh are neither searched nor named; a binary and a file over the cap are counted as skipped."""
    (tree / ".env").write_text("NEEDLE=1\n")
    (tree / ".ssh").mkdir()
    (tree / ".ssh" / "NEEDLE").write_text("NEEDLE\n")
    (tree / "blob.bin").write_bytes(b"NEEDLE\0\1\2")
    (tree / "big.txt").write_bytes(b"NEEDLE\n" + b"x" * MAX_SEARCH_FILE_BYTES)
    found = await call(client, "search_files", pattern="NEEDLE")
    detail = found["detail"]
    assert detail["matches"] == []
    assert detail["name_matches"] == []
    assert detail["skipped"]["binary"] == 1
    assert detail["skipped"]["too_large"] == 1


async def test_search_never_follows_a_symlink_out_of_the_workspace(client: Client, tree: Path, tmp_path: Path) -> None:
    """A link to a folder or file outside is listed by name at most; nothing beyond it is read."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "loot.txt").write_text("OUTSIDE-NEEDLE\n")
    (tree / "door").symlink_to(outside)
    (tree / "loot-link").symlink_to(outside / "loot.txt")
    found = await call(client, "search_files", pattern="OUTSIDE-NEEDLE")
    assert found["detail"]["matches"] == []
    escaped = await call(client, "search_files", pattern="x", path="door")
    assert escaped["code"] == "PATH_ESCAPE", escaped


async def test_search_never_opens_a_fifo_nor_reads_a_hard_link_to_outside(
    client: Client, tree: Path, tmp_path: Path
) -> None:
    """A FIFO is named, never opened (the search would block); a hard link to a file outside is skipped unread."""
    os.mkfifo(tree / "NEEDLE-pipe")
    outside = tmp_path / "outside-hard.txt"
    outside.write_text("NEEDLE outside\n")
    os.link(outside, tree / "hard.txt")
    found = await call(client, "search_files", pattern="NEEDLE")
    assert found["detail"]["name_matches"] == ["NEEDLE-pipe"]
    assert found["detail"]["matches"] == []
    assert found["detail"]["skipped"]["unreadable"] == 1


async def test_search_shows_hostile_names_cleaned(client: Client, tree: Path) -> None:
    """A name with a terminal escape, a bell and a byte that is not UTF-8 is shown cleaned, never raw; its
    content is not read, as no file tool takes such a path (the jail refuses control characters)."""
    hostile = os.fsencode(tree) + b"/NEEDLE\x1b]0;pwned\x07\xff.txt"
    Path(os.fsdecode(hostile)).write_text("NEEDLE\n")
    found = await call(client, "search_files", pattern="NEEDLE")
    [name] = found["detail"]["name_matches"]
    assert name.startswith("NEEDLE")
    assert "\x1b" not in name
    assert "\x07" not in name
    assert found["detail"]["matches"] == []
    assert found["detail"]["skipped"]["unreadable"] == 1


async def test_search_results_stop_at_max_results_with_truncated(client: Client, tree: Path) -> None:
    """max_results bounds the answer and truncated says so, with what to do."""
    (tree / "many.txt").write_text("hit\n" * 50)
    found = await call(client, "search_files", pattern="hit", max_results=10)
    assert len(found["detail"]["matches"]) == 10
    assert found["detail"]["truncated"] is True
    assert "max_results" in found["detail"]["truncated_by"]


@pytest.mark.parametrize(
    ("pattern", "regex"),
    [("(?<=a)b", True), (r"(\w)\1", True), ("[", True), ("", False), ("a" * 300, False)],
)
async def test_search_refuses_dangerous_or_malformed_patterns(
    client: Client, tree: Path, pattern: str, regex: bool
) -> None:
    """Lookarounds and backreferences (no linear-time algorithm), broken regexes, empty and over-long
    patterns: INVALID_REQUEST."""
    (tree / "a.txt").write_text("a" * 200 + "!\n")
    refused = await call(client, "search_files", pattern=pattern, regex=regex)
    assert refused["code"] == "INVALID_REQUEST", refused


async def test_search_with_catastrophic_regexes_answers_right(client: Client, tree: Path) -> None:
    """Attack: the classic catastrophic-backtracking regexes on 4000-character lines complete (RE2)
    with the right lines found, instead of stalling the server."""
    (tree / "long.txt").write_text("a" * 4000 + "\n" + "a" * 4000 + "!\n" + "a" * 4000 + "b\n")
    for pattern, lines in (("(a+)+$", [1]), ("(a|a)*b", [3]), ("(.*a){20}", [1, 2, 3])):
        found = await call(client, "search_files", pattern=pattern, regex=True, path="long.txt")
        assert found["ok"], found
        assert [m["line"] for m in found["detail"]["matches"]] == lines, pattern


# -- edit_file ---------------------------------------------------------------------------------------


async def test_edit_replaces_a_unique_string_and_returns_a_diff(client: Client, tree: Path) -> None:
    """One occurrence: replaced, the diff shows the line change, the file keeps its mode and gets a new inode."""
    target = tree / "src" / "app.py"
    target.chmod(0o755)
    before = target.stat().st_ino
    done = await call(client, "edit_file", path="src/app.py", old="os.getcwd()", new="os.getpid()")
    assert done["ok"], done
    detail = done["detail"]
    assert detail["replacements"] == 1
    assert "-    return os.getcwd()\n+    return os.getpid()\n" in detail["diff"]
    assert detail["diff"].startswith("--- a/src/app.py\n+++ b/src/app.py\n")
    assert target.read_text() == "import os\n\ndef main():\n    return os.getpid()\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    assert target.stat().st_ino != before  # replaced by rename, never truncated in place
    assert sorted(p.name for p in target.parent.iterdir()) == ["app.py", "util.py"]


async def test_edit_refuses_missing_and_ambiguous_text(client: Client, tree: Path) -> None:
    """Missing: NOT_FOUND; twice without replace_all: INVALID_REQUEST naming the count; nothing is written."""
    (tree / "twice.txt").write_text("x = 1\nx = 1\n")
    missing = await call(client, "edit_file", path="twice.txt", old="y = 2", new="z")
    assert missing["code"] == "NOT_FOUND", missing
    ambiguous = await call(client, "edit_file", path="twice.txt", old="x = 1", new="x = 2")
    assert ambiguous["code"] == "INVALID_REQUEST"
    assert "2 times" in ambiguous["reason"]
    assert "replace_all" in ambiguous["reason"]
    assert (tree / "twice.txt").read_text() == "x = 1\nx = 1\n"
    every = await call(client, "edit_file", path="twice.txt", old="x = 1", new="x = 2", replace_all=True)
    assert every["detail"]["replacements"] == 2
    assert (tree / "twice.txt").read_text() == "x = 2\nx = 2\n"


@pytest.mark.parametrize(("old", "new"), [("", "x"), ("same", "same")])
async def test_edit_refuses_empty_or_unchanged_text(client: Client, tree: Path, old: str, new: str) -> None:
    (tree / "f.txt").write_text("same\n")
    refused = await call(client, "edit_file", path="f.txt", old=old, new=new)
    assert refused["code"] == "INVALID_REQUEST", refused


async def test_edit_dry_run_writes_nothing(client: Client, tree: Path) -> None:
    """dry_run returns the diff and leaves the file, its inode and its time as they were."""
    target = tree / "notes.md"
    before = target.stat()
    done = await call(client, "edit_file", path="notes.md", old="abc", new="xyz", dry_run=True)
    assert done["ok"]
    assert done["detail"]["written"] is False
    assert "+xyz" in done["detail"]["diff"]
    after = target.stat()
    assert (after.st_ino, after.st_mtime_ns, target.read_text()) == (
        before.st_ino,
        before.st_mtime_ns,
        "main ideas\nabc\n",
    )


async def test_edit_diff_never_shows_a_secret(client: Client, tree: Path) -> None:
    """A token beside the edited line, or put in by the edit itself, shows redacted in the diff."""
    (tree / "settings.py").write_text(f"DEBUG = True\nTOKEN = '{TOKEN}'\n")
    done = await call(client, "edit_file", path="settings.py", old="DEBUG = True", new=f"DEBUG = False  # {TOKEN}")
    assert done["ok"], done
    assert TOKEN not in str(done)
    assert "[REDACTED:github_token]" in done["detail"]["diff"]
    assert TOKEN in (tree / "settings.py").read_text()


async def test_edit_refuses_secret_files_binaries_and_hard_links(client: Client, tree: Path) -> None:
    """The jail's rules hold: a secret file, a binary and a hard-linked file are refused and left as they were."""
    (tree / ".env").write_text("A=1\n")
    (tree / "image.bin").write_bytes(b"\x00\xffA=1\x00")
    os.link(tree / "notes.md", tree / "notes-link.md")
    cases = {".env": ("A=1", "POLICY_DENIED"), "image.bin": ("A=1", "INVALID_REQUEST")}
    cases["notes-link.md"] = ("abc", "POLICY_DENIED")
    for path, (old, code) in cases.items():
        refused = await call(client, "edit_file", path=path, old=old, new="B")
        assert refused["code"] == code, (path, refused)
    assert (tree / ".env").read_text() == "A=1\n"
    assert (tree / "notes.md").read_text() == "main ideas\nabc\n"


async def test_edit_through_a_link_edits_its_target_and_never_leaves(
    client: Client, tree: Path, tmp_path: Path
) -> None:
    """A link to a workspace file: the target changes, the link stays a link. A link (or a link to a link)
    leaving the workspace is PATH_ESCAPE and the outside file is untouched."""
    (tree / "link.py").symlink_to("src/app.py")
    done = await call(client, "edit_file", path="link.py", old="import os", new="import sys")
    assert done["detail"]["path"] == "src/app.py"
    assert (tree / "link.py").is_symlink()
    assert (tree / "src" / "app.py").read_text().startswith("import sys\n")
    outside = tmp_path / "outside.txt"
    outside.write_text("root:x:0:0\n")
    (tree / "out").symlink_to(outside)
    (tree / "out2").symlink_to("out")
    for path in ("out", "out2"):
        refused = await call(client, "edit_file", path=path, old="root", new="toor")
        assert refused["code"] == "PATH_ESCAPE", (path, refused)
    assert outside.read_text() == "root:x:0:0\n"


async def test_edit_refuses_a_file_over_the_cap(client: Client, tree: Path) -> None:
    (tree / "huge.txt").write_bytes(b"a" * (MAX_READ_BYTES + 1))
    refused = await call(client, "edit_file", path="huge.txt", old="a", new="b", replace_all=True)
    assert refused["code"] == "RESOURCE_LIMIT", refused


async def test_edit_diff_is_capped(client: Client, tree: Path) -> None:
    """Replacing every line of a large file gives a diff cut at the cap, flagged."""
    (tree / "wide.txt").write_text("line of text\n" * 20_000)
    done = await call(client, "edit_file", path="wide.txt", old="line", new="LINE", replace_all=True)
    assert done["detail"]["diff_truncated"] is True
    assert len(done["detail"]["diff"]) == MAX_DIFF_CHARS


# -- read_file(as_image) -----------------------------------------------------------------------------


IMAGES = {
    "image/png": png(),
    "image/jpeg": b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + b"\0" * 32,
    "image/gif": b"GIF89a\x01\x00\x01\x00\x00\x00\x00;",
    "image/webp": b"RIFF\x1a\x00\x00\x00WEBPVP8L\x0d\x00\x00\x00/\x00\x00\x00\x10\x07\x10\x11\x11\x88\x88\xfe\x07\x00",
}


@pytest.mark.parametrize("mime", sorted(IMAGES))
async def test_read_file_as_image_returns_image_content_typed_by_its_bytes(
    client: Client, tree: Path, mime: str
) -> None:
    """Each type comes back as ImageContent with the exact bytes, even under a misleading name."""
    (tree / "picture.txt").write_bytes(IMAGES[mime])
    raw = await client.call_tool("read_file", {"path": "picture.txt", "as_image": True})
    assert raw.structured_content is not None
    assert raw.structured_content["ok"], raw
    images = [block for block in raw.content if isinstance(block, ImageContent)]
    assert len(images) == 1
    assert images[0].mime_type == mime
    assert base64.b64decode(images[0].data) == IMAGES[mime]


async def test_read_file_as_image_refuses_what_is_not_an_image(client: Client, tree: Path) -> None:
    """Text named .png, a PDF, and an image over the cap are refused, never sent as an image."""
    (tree / "fake.png").write_text("not an image\n")
    (tree / "doc.png").write_bytes(b"%PDF-1.7\n")
    (tree / "huge.png").write_bytes(png() + b"\0" * MAX_READ_BYTES)
    for path, code in (("fake.png", "INVALID_REQUEST"), ("doc.png", "INVALID_REQUEST"), ("huge.png", "RESOURCE_LIMIT")):
        refused = await call(client, "read_file", path=path, as_image=True)
        assert refused["code"] == code, (path, refused)


async def test_read_file_as_image_refuses_paging_arguments(client: Client, tree: Path) -> None:
    (tree / "plot.png").write_bytes(png())
    for extra in ({"offset": 4}, {"length": 10}, {"encoding": "base64"}):
        refused = await call(client, "read_file", path="plot.png", as_image=True, **extra)
        assert refused["code"] == "INVALID_REQUEST", (extra, refused)


async def test_read_file_of_an_image_as_text_points_to_as_image(client: Client, tree: Path) -> None:
    (tree / "plot.png").write_bytes(png())
    refused = await call(client, "read_file", path="plot.png")
    assert refused["code"] == "INVALID_REQUEST"
    assert "as_image=true" in refused["reason"]


# -- sandboxes: paths as the sandbox sees them -----------------------------------------------------


@pytest.mark.bwrap
async def test_sandbox_file_tools_take_workspace_paths_and_absolute_links(client: Client) -> None:
    """In a sandbox, /workspace/x is x for every file tool, and a link to /workspace/... (valid for its
    commands) is followed by them too; a link to the host's /etc is refused, not read."""
    box = await create(client)
    made = await sh(client, box, "mkdir -p pkg && printf 'VALUE = 1\\n' > pkg/mod.py && ln -s /workspace/pkg alias")
    assert made["ok"], made
    await sh(client, box, "ln -s /etc/passwd leak; ln -s /etc hostetc")
    read = await call(client, "read_file", path="/workspace/alias/mod.py", sandbox_id=box)
    assert read["detail"]["content"] == "VALUE = 1\n"
    listed = await call(client, "list_directory", path="/workspace", sandbox_id=box)
    assert {"alias", "pkg", "leak"} <= {entry["name"] for entry in listed["detail"]["entries"]}
    wrote = await call(client, "write_file", path="/workspace/alias/new.py", content="NEW = 2\n", sandbox_id=box)
    assert wrote["detail"]["path"] == "pkg/new.py"
    edited = await call(
        client, "edit_file", path="/workspace/alias/mod.py", old="VALUE = 1", new="VALUE = 3", sandbox_id=box
    )
    assert edited["ok"], edited
    found = await call(client, "search_files", pattern="VALUE", path="/workspace", sandbox_id=box)
    assert [(m["path"], m["text"]) for m in found["detail"]["matches"]] == [("pkg/mod.py", "VALUE = 3")]
    inside = await sh(client, box, "cat /workspace/alias/mod.py /workspace/pkg/new.py")
    assert inside["detail"]["stdout"] == "VALUE = 3\nNEW = 2\n"
    in_folder = await sh(client, box, "ls", cwd="/workspace/alias")
    assert in_folder["detail"]["stdout"] == "mod.py\nnew.py\n"
    assert in_folder["detail"]["cwd"] == "/workspace/alias"
    for path in ("leak", "hostetc/passwd", "/workspace/hostetc/hostname", "/etc/passwd"):
        refused = await call(client, "read_file", path=path, sandbox_id=box)
        assert refused["code"] == "PATH_ESCAPE", (path, refused)
        assert "root:" not in str(refused)
    for tool, args in (("search_files", {"pattern": "root", "path": "hostetc"}), ("edit_file", _EDIT_LEAK)):
        refused = await call(client, tool, sandbox_id=box, **args)
        assert refused["code"] == "PATH_ESCAPE", (tool, refused)


_EDIT_LEAK = {"path": "leak", "old": "root", "new": "toor"}


# -- the attack corpus, replayed against the new tools ------------------------------------------------

CORPUS: list[dict[str, Any]] = json.loads(
    (Path(__file__).parents[1] / "attacks" / "attack-corpus.json").read_text(encoding="utf-8")
)
PATH_ENTRIES = [entry for entry in CORPUS if entry["tool"] in ("files.read", "files.write")]
SETUP_ENTRIES = [e for e in PATH_ENTRIES if isinstance(e["input"], dict) and "setup" in e["input"]]
STRING_ENTRIES = [e for e in PATH_ENTRIES if isinstance(e["input"], str)]


def _corpus_path(entry: dict[str, Any], root: str) -> str:
    value = entry["input"]
    path = value if isinstance(value, str) else value["path"]
    if isinstance(path, dict):  # {"repeat": "A", "count": 300}
        path = path["repeat"] * path["count"]
    return str(path).replace("{WORKSPACE}", root)


async def _replay(client: Client, entry: dict[str, Any], path: str, **where: object) -> None:
    """Both tools refuse the path (a 'contained' entry may only be NOT_FOUND), and nothing of the host shows."""
    for tool, args in (
        ("search_files", {"pattern": "root", "path": path}),
        ("edit_file", {"path": path, "old": "root", "new": "toor"}),
    ):
        result = await call(client, tool, **args, **where)
        assert not result["ok"], (entry["id"], tool, result)
        if entry["expect"] == "contained":
            assert result["code"] == "NOT_FOUND", (entry["id"], tool, result)
        assert "root:x" not in str(result)


@pytest.mark.parametrize("entry", STRING_ENTRIES + SETUP_ENTRIES, ids=lambda e: e["id"])
async def test_corpus_path_attack_is_refused_by_search_and_edit(
    entry: dict[str, Any], client: Client, tree: Path
) -> None:
    """Invariant: every path attack of the corpus (strings, and the symlink set-ups) is refused by search_files
    and edit_file on a host workspace. A013's swap loop is the jail's own race test (test_paths_view.py)."""
    (tree / "README.md").write_text("readme\n")
    (tree / ".env").write_text("TOKEN=root\n")
    sibling = Path(str(tree) + "_sensitive_credentials")
    sibling.mkdir()
    (sibling / "secret.txt").write_text("root:x:0:0\n")
    setup = entry["input"].get("setup", "") if isinstance(entry["input"], dict) else ""
    for command in setup.split(";") if setup and not setup.startswith("loop") else ():
        words = command.replace("{WORKSPACE}", str(tree)).split()
        assert words[:2] == ["ln", "-s"], command
        os.symlink(words[2], words[3])
    await _replay(client, entry, _corpus_path(entry, str(tree)))


@pytest.mark.bwrap
async def test_corpus_path_attacks_are_refused_in_a_sandbox(client: Client) -> None:
    """Invariant: the same entries, with the set-ups made by the sandbox's own commands and {WORKSPACE} as
    /workspace, are refused by search_files and edit_file in a sandbox (the view resolving /workspace links)."""
    box = await create(client)
    await sh(client, box, "echo readme > README.md; echo TOKEN=root > .env")
    for entry in STRING_ENTRIES + SETUP_ENTRIES:
        setup = entry["input"].get("setup", "") if isinstance(entry["input"], dict) else ""
        if setup and not setup.startswith("loop"):
            made = await sh(client, box, setup.replace("{WORKSPACE}", "/workspace"))
            assert made["ok"], (entry["id"], made)
        await _replay(client, entry, _corpus_path(entry, "/workspace"), sandbox_id=box)
