"""upload_file through the SDK's real client, into a real sandbox and a host workspace.

What this proves: bytes arrive exactly (every byte value, checked inside the sandbox and
read back); an existing file is never replaced unless overwrite is asked for; bad base64,
escaping paths, a symlink at the destination and oversized uploads are refused and create
nothing; the audit log keeps the upload's size, not its bytes.
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mcp import Client

from bastion.app import Services
from bastion.safety.errors import InvalidRequest
from bastion.safety.paths import MAX_WRITE_BYTES
from bastion.workspaces import decode_base64
from tests.helpers import call, create, sh

pytestmark = pytest.mark.anyio

PAYLOAD = bytes(range(256)) * 1200 + os.urandom(4096)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


async def test_upload_into_a_sandbox_arrives_byte_for_byte(client: Client) -> None:
    box = await create(client)
    done = await call(client, "upload_file", path="in/data.bin", content_base64=b64(PAYLOAD), sandbox_id=box)
    assert done["ok"], done
    detail = done["detail"]
    assert detail == {  # type: ignore[comparison-overlap]
        "path": "in/data.bin",
        "bytes_written": len(PAYLOAD),
        "created": True,
        "sha256": hashlib.sha256(PAYLOAD).hexdigest(),
        "files_touched": ["in/data.bin"],
    }
    inside = await sh(client, box, "sha256sum in/data.bin")
    assert inside["detail"]["stdout"].split()[0] == hashlib.sha256(PAYLOAD).hexdigest()  # type: ignore[index]
    back = await call(client, "read_file", path="in/data.bin", encoding="base64", sandbox_id=box)
    assert base64.b64decode(back["detail"]["content"]) == PAYLOAD  # type: ignore[index]


async def test_upload_never_replaces_a_file_unless_asked(client: Client, workspace: Path) -> None:
    """In the host workspace: CONFLICT leaves the file as it was; overwrite=true replaces it."""
    (workspace / "notes.txt").write_text("mine\n")
    refused = await call(client, "upload_file", path="notes.txt", content_base64=b64(b"theirs\n"))
    assert refused["code"] == "CONFLICT"
    assert "exists" in str(refused["reason"])
    assert (workspace / "notes.txt").read_text() == "mine\n"
    replaced = await call(client, "upload_file", path="notes.txt", content_base64=b64(b"theirs\n"), overwrite=True)
    assert replaced["ok"], replaced
    assert replaced["detail"]["created"] is False  # type: ignore[index]
    assert (workspace / "notes.txt").read_text() == "theirs\n"


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
    assert listing["detail"]["stdout"].split() == ["d", "link", "target.txt", "kept"]  # type: ignore[index]


async def test_upload_audit_record_keeps_the_size_not_the_bytes(client: Client, services: Services) -> None:
    marker = b"upload-marker-" + os.urandom(8).hex().encode()
    encoded = b64(marker * 100)
    done = await call(client, "upload_file", path="m.bin", content_base64=encoded)
    assert done["ok"], done
    log = services.config.audit_path.read_text()
    assert encoded[:40] not in log
    assert f'"content_base64_chars":{len(encoded)}' in log.replace(" ", "")


@given(st.binary(max_size=2048), st.sampled_from(["", "\n", " ", "\r\n"]), st.integers(min_value=1, max_value=76))
def test_decode_base64_accepts_wrapped_text(data: bytes, gap: str, width: int) -> None:
    text = b64(data)
    wrapped = gap.join(text[i : i + width] for i in range(0, len(text), width))
    assert decode_base64(wrapped) == data


@pytest.mark.parametrize("text", ["abc", "ab=c", "a@bc", "YWJj\x00", "YWJ-", "YW_j"])
def test_decode_base64_refuses_what_is_not_standard_base64(text: str) -> None:
    with pytest.raises(InvalidRequest):
        decode_base64(text)
