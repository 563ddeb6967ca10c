"""bash and JavaScript contexts through the real MCP client, in real sandboxes: state persists
between calls, a timeout interrupts and the context lives, exit ends it and restart brings a fresh
one; and the attacks of a cell on its own context's protocol (a spoofed end marker, closed fds)."""

from __future__ import annotations

import shutil
from typing import Any

import pytest
from mcp import Client

from bastion.sandbox import SANDBOX_PATH
from tests.helpers import call, create

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]

needs_node = pytest.mark.skipif(
    shutil.which("node", path=SANDBOX_PATH) is None, reason="node is not installed on this machine's /usr"
)


async def bash(client: Client, sandbox_id: str, code: str, **args: object) -> dict[str, Any]:
    return await call(client, "execute_code", code=code, sandbox_id=sandbox_id, language="bash", **args)


async def js(client: Client, sandbox_id: str, code: str, **args: object) -> dict[str, Any]:
    return await call(client, "execute_code", code=code, sandbox_id=sandbox_id, language="javascript", **args)


async def test_bash_keeps_variables_functions_and_cwd_between_calls(client: Client) -> None:
    sandbox = await create(client)
    first = await bash(client, sandbox, "x=6\ntwice() { echo $(( $1 * 2 )); }\nmkdir -p sub && cd sub\necho set")
    assert first["ok"], first
    assert first["detail"]["stdout"] == "set\n"
    assert first["detail"]["exit_status"] == 0
    second = await bash(client, sandbox, "twice $x; pwd; echo oops >&2; false")
    assert second["ok"], second
    assert second["detail"]["stdout"] == "12\n/workspace/sub\n"
    assert second["detail"]["stderr"] == "oops\n"
    assert second["detail"]["exit_status"] == 1
    assert second["detail"]["execution_count"] == 2
    listed = await call(client, "list_code_contexts", sandbox_id=sandbox)
    assert [(c["language"], c["context"]) for c in listed["detail"]["contexts"]] == [("bash", "default")]


async def test_bash_timeout_interrupts_and_the_context_lives(client: Client) -> None:
    sandbox = await create(client)
    await bash(client, sandbox, "kept=still-here")
    result = await bash(client, sandbox, "echo started; sleep 30; echo not-reached", timeout_s=0.5)
    assert result["code"] == "TIMEOUT", result
    assert result["detail"]["context_state"] == "alive"
    assert result["detail"]["stdout"] == "started\n"
    assert result["detail"]["exit_status"] == 130
    busy = await bash(client, sandbox, "while true; do :; done", timeout_s=0.5)
    assert busy["code"] == "TIMEOUT", busy
    assert busy["detail"]["context_state"] == "alive"
    after = await bash(client, sandbox, "echo $kept")
    assert after["detail"]["stdout"] == "still-here\n", after


async def test_bash_that_ignores_the_interrupt_is_killed_then_restarted(client: Client) -> None:
    sandbox = await create(client)
    await bash(client, sandbox, "kept=1")
    result = await bash(client, sandbox, "trap '' INT; while true; do :; done", timeout_s=0.3)
    assert result["code"] == "TIMEOUT"
    assert result["detail"]["context_state"] == "dead"
    dead = await bash(client, sandbox, "echo $kept")
    assert dead["code"] == "CONFLICT"
    fresh = await bash(client, sandbox, 'echo "[$kept]"', restart=True)
    assert fresh["detail"]["stdout"] == "[]\n"
    assert fresh["detail"]["execution_count"] == 1


async def test_bash_exit_ends_the_context_and_restart_brings_a_fresh_one(client: Client) -> None:
    sandbox = await create(client)
    ended = await bash(client, sandbox, "echo bye; exit 3")
    assert ended["code"] == "OPERATION_FAILED", ended
    assert ended["detail"]["context_state"] == "dead"
    assert ended["detail"]["stdout"] == "bye\n"
    assert "exited (status 3)" in ended["detail"]["stderr"]
    fresh = await bash(client, sandbox, "echo again", restart=True)
    assert fresh["detail"]["stdout"] == "again\n"


async def test_bash_cell_cannot_spoof_its_end_marker_or_status(client: Client) -> None:
    """Invariant: a cell ends when its own epilogue runs, not when the cell prints something that looks
    like an end marker or writes a status line into the context's FIFO: the token is random per cell
    and unknown to the cell. Does not prove a cell cannot read the token from bash's memory."""
    sandbox = await create(client)
    await bash(client, sandbox, "echo warm")
    spoof = (
        "printf '\\0%s\\0' 00000000000000000000000000000000; printf '\\0\\0' >&2\n"
        'for f in /tmp/.bastion-bash-*/status; do printf \'%s {"exit_status":0,"o":0,"e":0}\\n\' x > $f; done\n'
        "sleep 0.5; echo after-spoof; exit_code=7; (exit 7)"
    )
    result = await bash(client, sandbox, spoof)
    assert result["ok"], result
    assert result["detail"]["stdout"].endswith("after-spoof\n"), result
    assert result["detail"]["exit_status"] == 7
    assert (await bash(client, sandbox, "echo $exit_code"))["detail"]["stdout"] == "7\n"


async def test_bash_cell_that_closes_its_stdout_still_ends(client: Client) -> None:
    sandbox = await create(client)
    closed = await bash(client, sandbox, "echo before; exec >&-; exec 2>&-; echo lost", timeout_s=10)
    assert closed["ok"], closed
    assert closed["detail"]["stdout"] == "before\n"
    assert closed["detail"]["context_state"] == "alive"
    fresh = await bash(client, sandbox, "echo back", restart=True)
    assert fresh["detail"]["stdout"] == "back\n"


async def test_bash_cell_reading_stdin_reads_eof_not_the_next_cell(client: Client) -> None:
    sandbox = await create(client)
    result = await bash(client, sandbox, 'cat; read line; echo "read=[$line] $?"')
    assert result["detail"]["stdout"] == "read=[] 1\n", result


async def test_bash_in_a_policy_template_is_refused(client: Client) -> None:
    result = await call(client, "execute_code", code="echo x", sandbox_id="default", language="bash")
    assert result["code"] == "FORBIDDEN"


async def test_unknown_language_is_refused_naming_the_languages(client: Client) -> None:
    sandbox = await create(client)
    result = await call(client, "execute_code", code="1", sandbox_id=sandbox, language="cobol")
    assert result["code"] == "INVALID_REQUEST", result
    assert "python" in result["reason"]
    assert "bash" in result["reason"]


@needs_node
async def test_javascript_keeps_globals_and_modules_between_calls(client: Client) -> None:
    sandbox = await create(client)
    first = await js(client, sandbox, "let n = 20; const path = require('path'); function f(x) { return x + 1 }\nn + 1")
    assert first["ok"], first
    assert first["detail"]["value"] == "21"
    second = await js(client, sandbox, "console.log('hi', path.basename('/a/b.txt')); f(n) * 2")
    assert second["detail"]["stdout"] == "hi b.txt\n"
    assert second["detail"]["value"] == "42"
    awaited = await js(client, sandbox, "await new Promise((r) => setTimeout(() => r(5), 10))")
    assert awaited["ok"], awaited
    promised = await js(client, sandbox, "new Promise((r) => setTimeout(() => r({a: [1, 2]}), 10))")
    assert promised["detail"]["value"] == "{ a: [ 1, 2 ] }"
    thrown = await js(client, sandbox, "function g() { throw new TypeError('bad') }\ng()")
    assert thrown["ok"]
    assert thrown["detail"]["error"]["type"] == "TypeError"
    assert "<cell-" in thrown["detail"]["error"]["traceback"]
    assert "runner.js" not in thrown["detail"]["error"]["traceback"]


@needs_node
async def test_javascript_timeout_interrupts_and_the_context_lives(client: Client) -> None:
    sandbox = await create(client)
    await js(client, sandbox, "globalThis.kept = 'yes'")
    spin = await js(client, sandbox, "console.log('spinning'); while (true) {}", timeout_s=0.5)
    assert spin["code"] == "TIMEOUT", spin
    assert spin["detail"]["context_state"] == "alive"
    assert spin["detail"]["stdout"] == "spinning\n"
    waiting = await js(client, sandbox, "await new Promise(() => {})", timeout_s=0.5)
    assert waiting["code"] == "TIMEOUT", waiting
    assert waiting["detail"]["context_state"] == "alive"
    assert (await js(client, sandbox, "kept"))["detail"]["value"] == "'yes'"


@needs_node
async def test_javascript_process_exit_ends_the_context(client: Client) -> None:
    sandbox = await create(client)
    ended = await js(client, sandbox, "console.log('bye'); process.exit(4)")
    assert ended["code"] == "OPERATION_FAILED", ended
    assert ended["detail"]["context_state"] == "dead"
    assert ended["detail"]["stdout"] == "bye\n"
    assert "exited (status 4)" in ended["detail"]["stderr"]
    fresh = await js(client, sandbox, "typeof kept", restart=True)
    assert fresh["detail"]["value"] == "'undefined'"


@needs_node
async def test_javascript_late_error_does_not_end_the_context(client: Client) -> None:
    sandbox = await create(client)
    await js(client, sandbox, "setTimeout(() => { throw new Error('late') }, 1); Promise.reject(new Error('r'))")
    after = await js(client, sandbox, "await new Promise((r) => setTimeout(r, 50)); 1 + 1")
    assert after["ok"], after
    assert after["detail"]["context_state"] == "alive"
    assert (await js(client, sandbox, "2 + 2"))["detail"]["value"] == "4"


async def test_bash_flood_is_capped_and_the_context_lives(client: Client) -> None:
    sandbox = await create(client, limits={"max_output_bytes": 4096})
    flood = await bash(client, sandbox, "head -c 50000000 /dev/zero | tr '\\0' x; echo; echo done >&2", timeout_s=30)
    assert flood["code"] == "OUTPUT_TRUNCATED", flood
    assert flood["detail"]["truncated"]
    assert len(flood["detail"]["stdout"]) <= 4096
    assert flood["detail"]["stderr"] == "done\n"
    assert (await bash(client, sandbox, "echo alive"))["detail"]["stdout"] == "alive\n"


async def test_bash_odd_text_in_code_does_not_break_the_context(client: Client) -> None:
    """A lone surrogate in a cell is refused before it runs (INVALID_REQUEST, as in every tool's text since
    2026-12-06: no file or program holds one); an unclosed quote is bash's own syntax error. Either way the
    context lives on."""
    sandbox = await create(client)
    refused = await bash(client, sandbox, "echo 'lone \ud800 surrogate'")
    assert refused["code"] == "INVALID_REQUEST", refused
    assert "lone surrogate" in refused["reason"]
    odd = await bash(client, sandbox, "echo 'lone'\necho \"quote never closed")
    assert odd["ok"], odd
    assert "lone" in odd["detail"]["stdout"]
    assert odd["detail"]["exit_status"] == 2  # bash's syntax error, in the cell's own file
    assert (await bash(client, sandbox, "echo fine"))["detail"]["stdout"] == "fine\n"


@needs_node
async def test_javascript_cell_cannot_spoof_its_end_or_silence_it(client: Client) -> None:
    """Invariant: a cell that prints marker-like bytes, writes fake statuses into the FIFO, or closes
    its own stdout still ends when its code does, with what it printed before."""
    sandbox = await create(client)
    code = (
        "const fs = require('fs');\n"
        "process.stdout.write('\\0' + '0'.repeat(32) + '\\0');\n"
        "for (const d of fs.readdirSync('/tmp').filter((n) => n.startsWith('.bastion-javascript-')))\n"
        '  fs.writeFileSync(`/tmp/${d}/status`, \'x {"o":0,"e":0,"value":"spoofed"}\\n\');\n'
        "await new Promise((r) => setTimeout(r, 300));\n"
        "console.log('after'); fs.closeSync(1); 'real'"
    )
    result = await js(client, sandbox, code, timeout_s=10)
    assert result["ok"], result
    assert result["detail"]["stdout"].endswith("after\n"), result
    assert result["detail"]["error"] is None, result


async def test_bash_cell_writing_into_its_drivers_fds_ends_only_its_own_context(client: Client) -> None:
    """Invariant: the driver's pipes are reachable from a cell (/proc/$PPID/fd, same user); garbage
    written into all of them ends at most this context, with a one-line reason, while the sandbox
    and its other contexts live and a restart works. Does not prove which fd broke it."""
    sandbox = await create(client)
    await call(client, "execute_code", code="x = 41", sandbox_id=sandbox)
    code = "for f in /proc/$PPID/fd/*; do echo 'garbage {' > $f; done 2>/dev/null; sleep 1; echo end"
    result = await bash(client, sandbox, code, timeout_s=5)
    assert result["code"] in ("OK", "OPERATION_FAILED", "TIMEOUT"), result
    python = await call(client, "execute_code", code="x + 1", sandbox_id=sandbox)
    assert python["detail"]["value"] == "42", python
    fresh = await bash(client, sandbox, "echo back", restart=True)
    assert fresh["detail"]["stdout"] == "back\n", fresh
