"""LineProgress: an installer's output as progress messages, fed the bytes a pipe gives."""

from __future__ import annotations

import pytest

from bastion.safety.redact import Redactor
from bastion.workbench.progress import MAX_MESSAGE_CHARS, LineProgress

pytestmark = pytest.mark.anyio


class Heard:
    def __init__(self) -> None:
        self.messages: list[tuple[float, str]] = []

    async def __call__(self, count: float, message: str) -> None:
        self.messages.append((count, message))


async def test_a_flood_of_lines_costs_one_message_per_turn() -> None:
    """Lines that come faster than the interval are folded into the newest: 10,000 lines read
    before the loop turns give one message, the last line."""
    heard = Heard()
    async with LineProgress(Redactor(), heard).running() as progress:
        out, _ = progress.sinks()
        for number in range(10_000):
            out(f"line {number}\n".encode())
    assert heard.messages == [(10_000.0, "line 9999")]


async def test_lines_are_joined_across_reads_cleaned_cut_and_redacted() -> None:
    heard = Heard()
    secret = "AKIA" + "ABCDEFGHIJKLMNOP"
    async with LineProgress(Redactor(), heard).running() as progress:
        out, err = progress.sinks()
        out(b"Downloading pkg " + secret[:6].encode())
        out(secret[6:].encode() + b"\x1b[31m red\x1b[0m\n")
    assert heard.messages[-1][1] == "Downloading pkg [REDACTED:aws_access_key_id] red", heard.messages
    heard.messages.clear()
    async with LineProgress(Redactor(), heard).running() as progress:
        out, err = progress.sinks()
        err(b"  10%\r  55%\r 100% done\n")  # a progress bar drawn with carriage returns
    assert heard.messages == [(1.0, "100% done")]
    heard.messages.clear()
    async with LineProgress(Redactor(), heard).running() as progress:
        out, _ = progress.sinks()
        for _ in range(2_000):
            out(b"x" * 65_536)  # one 128 MB line: only its first 4 KiB are kept
        out(b"\n")
    assert heard.messages == [(1.0, "x" * MAX_MESSAGE_CHARS)]


async def test_a_send_that_fails_does_not_fail_the_operation() -> None:
    async def broken(count: float, message: str) -> None:
        raise RuntimeError("the client went away")

    async with LineProgress(Redactor(), broken).running() as progress:
        progress.phase("step one")
