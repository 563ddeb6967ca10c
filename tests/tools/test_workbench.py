"""upload_file through the SDK's real client, into a real sandbox and a host workspace.

What this proves: bytes arrive exactly (every byte value, checked inside the sandbox and
read back); an existing file is never replaced unless overwrite is asked for; bad base64,
escaping paths, a symlink at the destination and oversized uploads are refused and create
nothing; the audit log keeps the upload's size, not its bytes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mcp import Client

from bastion.app import Services
from bastion.safety.errors import InvalidRequest
from bastion.safety.paths import MAX_READ_BYTES, MAX_WRITE_BYTES
from bastion.workbench.workspace import INLINE_READ_BYTES, decode_base64
from tests.helpers import LoopLag, audit_record, call, create, sh

pytestmark = pytest.mark.anyio

PAYLOAD = bytes(range(256)) * 1200 + os.urandom(4096)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


@pytest.mark.bwrap
async def test_upload_into_a_sandbox_arrives_byte_for_byte(client: Client) -> None:
    box = await create(client)
    done = await call(client, "upload_file", path="in/data.bin", content_base64=b64(PAYLOAD), sandbox_id=box)
    assert done["ok"], done
    detail = done["detail"]
    assert detail == {
        "path": "in/data.bin",
        "bytes_written": len(PAYLOAD),
        "created": True,
        "sha256": hashlib.sha256(PAYLOAD).hexdigest(),
    }
    inside = await sh(client, box, "sha256sum in/data.bin")
    assert inside["detail"]["stdout"].split()[0] == hashlib.sha256(PAYLOAD).hexdigest()
    back = await call(client, "read_file", path="in/data.bin", encoding="base64", sandbox_id=box)
    assert base64.b64decode(back["detail"]["content"]) == PAYLOAD


async def test_upload_never_replaces_a_file_unless_asked(client: Client, workspace: Path) -> None:
    """In the host workspace: CONFLICT leaves the file as it was; overwrite=true replaces it."""
    (workspace / "notes.txt").write_text("mine\n")
    refused = await call(client, "upload_file", path="notes.txt", content_base64=b64(b"theirs\n"))
    assert refused["code"] == "CONFLICT"
    assert "exists" in str(refused["reason"])
    assert (workspace / "notes.txt").read_text() == "mine\n"
    replaced = await call(client, "upload_file", path="notes.txt", content_base64=b64(b"theirs\n"), overwrite=True)
    assert replaced["ok"], replaced
    assert replaced["detail"]["created"] is False
    assert (workspace / "notes.txt").read_text() == "theirs\n"


@pytest.mark.bwrap
async def test_upload_refuses_bad_input_and_creates_nothing(client: Client) -> None:
    box = await create(client)
    await sh(client, box, "echo kept > target.txt; ln -s target.txt link; mkdir d")
    cases = {
        "INVALID_REQUEST": {"path": "a.bin", "content_base64": "not base64!"},
        "PATH_ESCAPE": {"path": "../outside.bin", "content_base64": b64(b"x")},
        "CONFLICT": {"path": "d", "content_base64": b64(b"x")},
        "RESOURCE_LIMIT": {"path": "big.bin", "content_base64": b64(b"\0" * (MAX_WRITE_BYTES + 1))},
    }
    for code, args in cases.items():
        result = await call(client, "upload_file", sandbox_id=box, **args)
        assert result["code"] == code, (code, result)
    # A symlink at the destination is refused with or without overwrite; its target is untouched.
    for overwrite in (False, True):
        result = await call(
            client, "upload_file", path="link", content_base64=b64(b"x"), overwrite=overwrite, sandbox_id=box
        )
        assert not result["ok"], result
    listing = await sh(client, box, "ls -A; cat target.txt")
    assert listing["detail"]["stdout"].split() == ["d", "link", "target.txt", "kept"]


async def test_upload_audit_record_keeps_the_size_not_the_bytes(client: Client, services: Services) -> None:
    """The record has the size and the file written; the client's detail does not carry the audit's file list."""
    marker = b"upload-marker-" + os.urandom(8).hex().encode()
    encoded = b64(marker * 100)
    done = await call(client, "upload_file", path="m.bin", content_base64=encoded)
    assert done["ok"], done
    assert "files_touched" not in done["detail"]
    log = services.config.audit_path.read_text()
    assert encoded[:40] not in log
    end = audit_record(services.config.audit_path, done["audit_id"])
    assert end["args"] == {"path": "m.bin", "content_base64_chars": len(encoded), "overwrite": False}
    assert end["files"] == ["m.bin"]


@given(st.binary(max_size=2048), st.sampled_from(["", "\n", " ", "\r\n"]), st.integers(min_value=1, max_value=76))
def test_decode_base64_accepts_wrapped_text(data: bytes, gap: str, width: int) -> None:
    text = b64(data)
    wrapped = gap.join(text[i : i + width] for i in range(0, len(text), width))
    assert decode_base64(wrapped) == data


@pytest.mark.parametrize("text", ["abc", "ab=c", "a@bc", "YWJj\x00", "YWJ-", "YW_j"])
def test_decode_base64_refuses_what_is_not_standard_base64(text: str) -> None:
    with pytest.raises(InvalidRequest):
        decode_base64(text)


# --- issue 13, finding 5: redaction gaps and the secret-file rule through links ---------------

TOKEN = "ghp_" + "Z9" * 18
PEM_LINES = [("QkFTRTY0" * 8)[:64] for _ in range(60)]  # about 4 KiB of key body


@pytest.mark.bwrap
async def test_list_directory_names_are_redacted_like_ls_and_an_escape_sequence_never_reads_as_another_name(
    client: Client,
) -> None:
    """Invariant: list_directory hides a token or key=value in a file name with the same redactor as `ls`
    through run_command. Attack: `ls`'s cleaning removes an escape sequence, so `a<ESC>[31mb` showed as `ab`,
    the name of another file beside it, and an agent acted on the wrong file; a name's control characters are
    shown escaped instead, never removed.
    """
    box = await create(client)
    made = await sh(
        client,
        box,
        f"mkdir d && cd d && touch {TOKEN} 'password=hunter2secret' plain.txt ab \"$(printf 'a\\033[31mb')\"",
    )
    assert made["detail"]["exit_status"] == 0, made
    listed = await call(client, "list_directory", path="d", sandbox_id=box)
    names = sorted(entry["name"] for entry in listed["detail"]["entries"])
    assert names == sorted(
        ["[REDACTED:github_token]", "ab", "a\\u001b[31mb", "password=[REDACTED:credential]", "plain.txt"]
    )
    assert TOKEN not in json.dumps(listed)
    assert "hunter2secret" not in json.dumps(listed)
    found = await call(client, "search_files", pattern="b", path="d", sandbox_id=box)
    assert {"d/a\\u001b[31mb", "d/ab"} <= set(found["detail"]["name_matches"]), found


async def test_read_file_slices_never_show_a_token_cut_in_two(client: Client, workspace: Path) -> None:
    """The attack: read_file with offset/length meeting inside a token returned its two halves,
    which joined back. Invariant: each slice hides the part of a secret it holds, as reading the
    whole file would; a slice deep inside a 4 KiB private key (far past its BEGIN line) shows
    none of it; text away from secrets reads as before. In the middle of a file larger than twice
    the context, so the context really is a window.
    """
    pad = "lorem ipsum dolor\n" * 2000  # 36 KB on each side
    key = "-----BEGIN RSA PRIVATE KEY-----\n" + "\n".join(PEM_LINES) + "\n-----END RSA PRIVATE KEY-----"
    text = f"{pad}token {TOKEN} here\n{key}\n{pad}"
    (workspace / "big.txt").write_text(text)
    cut = text.index(TOKEN) + 17
    first = await call(client, "read_file", path="big.txt", offset=cut - 40, length=40)
    second = await call(client, "read_file", path="big.txt", offset=cut, length=40)
    shown = first["detail"]["content"] + second["detail"]["content"]
    assert "Z9" not in shown, shown
    # The second slice also ends in the key's BEGIN line: cut there, it is hidden too.
    hidden = "token [REDACTED:github_token][REDACTED:github_token] here\n[REDACTED:private_key]"
    assert shown == f"orem ipsum dolor\n{hidden}"
    inside = text.index(PEM_LINES[40])
    deep = await call(client, "read_file", path="big.txt", offset=inside, length=200)
    assert deep["detail"]["content"] == "[REDACTED:private_key]", deep
    plain = await call(client, "read_file", path="big.txt", offset=100, length=36)
    assert plain["detail"]["content"] == text[100:136]
    assert plain["detail"]["bytes"] == 36


_SECRET_FOLDER_SETUP = (
    "mkdir -p .ssh/sub plain && echo 'ssh-ed25519 AAAA admin' > .ssh/authorized_keys && "
    "ln -s .ssh keys && ln -s keys chained && ln -s ../.ssh plain/up && ln -s plain/../.ssh dotdot"
)


def _tool_calls(base: str) -> list[tuple[str, dict[str, object]]]:
    return [
        ("list_directory", {"path": base}),
        ("list_directory", {"path": f"{base}/sub"}),
        ("read_file", {"path": f"{base}/authorized_keys"}),
        ("write_file", {"path": f"{base}/authorized_keys", "content": "ssh-ed25519 EVIL attacker\n"}),
        ("write_file", {"path": f"{base}/authorized_keys", "content": "ssh-ed25519 EVIL\n", "append": True}),
        ("write_file", {"path": f"{base}/new/deeper", "content": "x"}),
        ("upload_file", {"path": f"{base}/rc", "content_base64": b64(b"x")}),
        ("upload_file", {"path": f"{base}/authorized_keys", "content_base64": b64(b"x"), "overwrite": True}),
        ("run_command", {"command": "ls", "cwd": base}),
    ]


@pytest.mark.bwrap
async def test_secret_folder_through_a_symlinked_parent_is_refused_by_every_file_tool_in_a_sandbox(
    client: Client,
) -> None:
    """The attack: the sandbox links `keys -> .ssh`; list_directory keys listed .ssh and
    write_file keys/authorized_keys wrote into it. Invariant: every file tool (and a command's
    cwd) refuses, POLICY_DENIED naming the rule, through a relative, chained, nested or '..'
    link; nothing in .ssh changes and nothing of it is shown.
    """
    box = await create(client)
    made = await sh(client, box, _SECRET_FOLDER_SETUP)
    assert made["detail"]["exit_status"] == 0, made
    before = await sh(client, box, "ls -AR .ssh; cat .ssh/authorized_keys")
    for base in ("keys", "chained", "plain/up", "dotdot"):
        for tool, args in _tool_calls(base):
            result = await call(client, tool, sandbox_id=box, **args)
            assert result["code"] == "POLICY_DENIED", (tool, args, result)
            assert result["reason"] == "'.ssh' matches the secret-file rule '.ssh': ask the administrator"
            assert "AAAA" not in json.dumps(result)
    after = await sh(client, box, "ls -AR .ssh; cat .ssh/authorized_keys")
    assert after["detail"]["stdout"] == before["detail"]["stdout"]


async def test_secret_folder_through_a_symlinked_parent_is_refused_in_a_host_workspace(
    client: Client, workspace: Path
) -> None:
    """Invariant: the same refusals in a host workspace, whose links were made on the host;
    the real .ssh keeps its one file, byte for byte."""
    (workspace / ".ssh" / "sub").mkdir(parents=True)
    (workspace / ".ssh" / "authorized_keys").write_text("ssh-ed25519 AAAA admin\n")
    (workspace / "plain").mkdir()
    (workspace / "keys").symlink_to(".ssh")
    (workspace / "chained").symlink_to("keys")
    (workspace / "plain" / "up").symlink_to("../.ssh")
    for base in ("keys", "chained", "plain/up"):
        for tool, args in _tool_calls(base):
            result = await call(client, tool, **args)
            assert result["code"] == "POLICY_DENIED", (tool, args, result)
    assert sorted(p.name for p in (workspace / ".ssh").rglob("*")) == ["authorized_keys", "sub"]
    assert (workspace / ".ssh" / "authorized_keys").read_text() == "ssh-ed25519 AAAA admin\n"


@pytest.mark.bwrap
async def test_read_file_of_secret_dense_text_does_not_stall_the_loop(client: Client) -> None:
    """Redacting 1 MiB of `password=...` takes most of a second: a hostile sandbox writing such a
    file and reading it in a loop held every other call for that long (0.8 s per read). It is
    redacted in a worker thread now; the loop's worst stall is one regex pass, not the whole read."""
    box = await create(client)
    dense = "password=abcdefgh " * 60_000
    await call(client, "write_file", path="dense.txt", content=dense, sandbox_id=box)
    with LoopLag(0.002) as lag:
        read = await call(client, "read_file", path="dense.txt", sandbox_id=box)
    assert read["ok"], read
    assert "abcdefgh" not in str(read["detail"]["content"])
    assert lag.worst < 0.3


# -- binary content read as text (issue 15) ---------------------------------------------------------

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 64


@pytest.mark.anyio
async def test_read_file_refuses_an_image_as_text_and_says_how_to_read_it(client: Client, workspace: Path) -> None:
    """A PNG read with the default encoding was 48 KB of U+FFFD. Now it is a one-line refusal naming what the
    file is and the encoding that works, and that encoding gives the exact bytes."""
    (workspace / "plot.png").write_bytes(PNG)
    refused = await call(client, "read_file", path="plot.png")
    assert refused["code"] == "INVALID_REQUEST"
    assert "a PNG image" in refused["reason"]
    assert "encoding='base64'" in refused["reason"]
    assert refused["detail"] == {}
    exact = await call(client, "read_file", path="plot.png", encoding="base64")
    assert base64.b64decode(exact["detail"]["content"]) == PNG
    # A page from the middle of a binary file is refused too, without guessing a type from its first bytes.
    middle = await call(client, "read_file", path="plot.png", offset=100, length=4096)
    assert middle["code"] == "INVALID_REQUEST"
    assert "binary data" in middle["reason"]


@pytest.mark.anyio
async def test_read_file_of_text_with_a_few_stray_bytes_is_text_with_a_note(client: Client, workspace: Path) -> None:
    """Latin-1 in a UTF-8 file: the text comes back (the stray bytes as U+FFFD) and a note says how many."""
    (workspace / "notes.txt").write_bytes("café au lait\n".encode("latin-1") + "naïve ok\n".encode())
    read = await call(client, "read_file", path="notes.txt")
    assert read["ok"], read
    assert read["detail"]["content"] == "caf\ufffd au lait\nnaïve ok\n"
    assert read["detail"]["note"].startswith("1 bytes are not UTF-8")


@pytest.mark.anyio
async def test_read_file_pages_that_cut_a_character_are_plain_text(client: Client, workspace: Path) -> None:
    """A page that starts or ends inside a multi-byte character is text, not 'binary', and has no note."""
    text = "日本語のテキスト" * 400
    (workspace / "ja.txt").write_text(text)
    raw = text.encode()
    for offset, length in ((1, 100), (0, 101), (2, 3001), (len(raw) - 5, 5)):
        read = await call(client, "read_file", path="ja.txt", offset=offset, length=length)
        assert read["ok"], (offset, length, read)
        assert "note" not in read["detail"], (offset, length)


def test_stray_byte_count_stops_past_the_limit() -> None:
    """Counting the undecodable bytes of a 1 MiB binary page stops early, so a refusal costs little."""
    from bastion.workbench.workspace import MAX_UNDECODABLE_BYTES, undecodable_bytes

    assert undecodable_bytes(b"\xff" * 1_048_576, cut_before=False, cut_after=False) == MAX_UNDECODABLE_BYTES + 1
    assert undecodable_bytes("é".encode()[1:] + b"abc", cut_before=True, cut_after=False) == 0
    assert undecodable_bytes("é".encode()[1:] + b"abc", cut_before=False, cut_after=False) == 1
    assert undecodable_bytes(b"abc" + "é".encode()[:1], cut_before=False, cut_after=True) == 0


# -- small files read on the event loop (issue 19) --------------------------------------------------


async def test_read_file_is_the_same_on_either_side_of_the_inline_size(client: Client, workspace: Path) -> None:
    """A file up to INLINE_READ_BYTES is read on the event loop, a bigger one in a worker thread.
    Invariant: both give the whole text, redacted, with the same fields; a length over the maximum is
    still refused. Does not prove the cap when a file grows between the size check and the read."""
    secret = "password=hunter2hunter2\n"
    for size in (INLINE_READ_BYTES - 100, INLINE_READ_BYTES, INLINE_READ_BYTES + 1, 3 * INLINE_READ_BYTES):
        text = secret + "x" * (size - len(secret) - 1) + "\n"
        (workspace / "f.txt").write_text(text)
        read = await call(client, "read_file", path="f.txt")
        assert read["ok"], read
        detail = read["detail"]
        assert (detail["bytes"], detail["size"], detail["eof"]) == (size, size, True)
        assert "hunter2" not in str(detail["content"])
        assert str(detail["content"]).endswith("x" * 100 + "\n")
        part = await call(client, "read_file", path="f.txt", offset=size - 10, length=5)
        assert part["detail"]["content"] == "xxxxx"
    refused = await call(client, "read_file", path="f.txt", length=MAX_READ_BYTES + 1)
    assert refused["code"] == "INVALID_REQUEST"


async def test_read_file_of_a_secret_dense_small_file_stalls_the_loop_briefly(client: Client, workspace: Path) -> None:
    """Attack: a file just under the inline size, dense with secrets, read in a loop to hold the event
    loop. Invariant: each read holds it far less than the 0.3 s a worker-thread read may. Measured as the
    loop thread's CPU time between two ticks: a CI run saw 0.23 s of wall stall here that was not the
    redaction (most likely the call's inline audit fdatasync on a disk other tests were loading)."""
    dense = "password=abcdefgh "
    (workspace / "dense.txt").write_text(dense * (INLINE_READ_BYTES // len(dense)))
    with LoopLag(0.002) as lag:
        for _ in range(5):
            read = await call(client, "read_file", path="dense.txt")
            assert read["ok"], read
            assert "abcdefgh" not in str(read["detail"]["content"])
    assert lag.cpu_worst < 0.1, lag.cpu_worst


# -- deep new paths written off the event loop -------------------------------------------------------

# A path of 1,900 new folders: with the workspace's own path (pytest's basetemp, ~150 characters) it stays under
# PATH_MAX (4096), which the jail's check of where a file leads needs (a deeper one is refused: tests/safety).
DEEP_FOLDERS = 1900


async def test_deep_new_paths_written_again_and_again_do_not_stall_the_loop(client: Client, workspace: Path) -> None:
    """Attack (p6_deep_write.py): write_file and upload_file of a file ~2,000 new folders deep, each call under
    a new top folder. The folders were made on the event loop (0.78 s of it a call, every other call
    waiting). Invariant: the writes run in a worker thread, so the loop's thread spends little CPU between
    two ticks, and every file arrives with its content. Does not prove how long the write itself takes (the
    jail's folder making: tests/safety)."""
    paths = {f"{tool}{i}/{'a/' * DEEP_FOLDERS}f": f"{tool} {i}\n" for i in range(2) for tool in ("write", "upload")}
    # Each tool's first call builds what it needs once (~0.1 s): not what is measured.
    assert (await call(client, "write_file", path="warm.txt", content="x"))["ok"]
    assert (await call(client, "upload_file", path="warm.bin", content_base64=b64(b"x")))["ok"]
    try:
        with LoopLag(0.002) as lag:
            for path, text in paths.items():
                if path.startswith("write"):
                    done = await call(client, "write_file", path=path, content=text)
                else:
                    done = await call(client, "upload_file", path=path, content_base64=b64(text.encode()))
                assert done["ok"], done
        assert lag.cpu_worst < 0.05, lag.cpu_worst
        for path, text in paths.items():
            read = await call(client, "read_file", path=path)
            assert read["detail"]["content"] == text, read
    finally:
        # shutil.rmtree (pytest's too, on its next run) recurses once per folder: past Python's limit here.
        tops = [str(workspace / path.split("/")[0]) for path in paths]
        subprocess.run(["rm", "-rf", "--one-file-system", *tops], check=True, timeout=60)


async def test_lone_surrogates_are_refused_in_every_argument_before_anything_runs(client: Client) -> None:
    """Attack (surrogate_env.py, a review of the write_file fix): the 2026-07-28 era's JSON parser takes
    "\\ud800", which no file, command line or environment can hold. Refused in write_file alone, it still
    reached a sandbox's env (every later command of that sandbox then failed to start: exit 127) and
    run_command (reported OK, exit 127). Invariant: any string argument, or a key or value of one, with a
    lone surrogate is INVALID_REQUEST naming it, before the tool runs; nothing is made."""
    refused = [
        await call(client, "create_sandbox", env={"A": "x\ud800y"}),
        await call(client, "run_command", command="echo \ud800"),
        await call(client, "write_file", path="odd.txt", content="a\ud800b"),
    ]
    for answer in refused:
        assert answer["code"] == "INVALID_REQUEST", answer
        assert "lone surrogate" in answer["reason"], answer
    listed = await call(client, "list_sandboxes")
    assert listed["ok"], listed
    assert listed["detail"]["sandboxes"] == [], listed
    assert (await call(client, "run_command", command="echo fine"))["ok"]
