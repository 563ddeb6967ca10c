"""The published attack corpus, replayed against the real server over the real MCP client.

What this proves: every entry of ``attack-corpus.json`` aimed at the terminal or file tools
(organizer entries excepted) is, when sent through the MCP SDK's own client to the server
that ``bastion serve`` builds from the demo config, either refused with a stable result code
or contained: the call does not read or create anything outside the workspace, secrets and
terminal escapes do not reach the answer, a runaway command is killed at its time limit,
and the audit log still verifies afterwards, with a record of the call. The code sandbox
entries (sandbox.execute, sandbox.install_package) go to the real execute_code and
install_package, in sandboxes with and without an egress proxy (see the end of this file).

What it does not prove: that no other attack works. The corpus is a list of known inputs;
passing it says nothing about inputs nobody has published yet, about other configs than the
demo's, or about the kernel sandbox against a command the policy allows.
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from mcp import Client
from mcp_types import CallToolResult

from bastion.safety.audit import CHAIN_FIELDS, verify

if TYPE_CHECKING:
    from .demo import Demo

CORPUS_PATH = Path(__file__).with_name("attack-corpus.json")
CORPUS: list[dict[str, Any]] = json.loads(CORPUS_PATH.read_text(encoding="utf-8"))

ORGANIZER_TOOLS = frozenset({"files.move", "files.set_workspace", "files.apply_plan"})


def _in_scope(entry: dict[str, Any]) -> bool:
    tool = entry["tool"]
    return tool.startswith(("terminal.", "files.")) and tool not in ORGANIZER_TOOLS and entry["category"] != "organizer"


ENTRIES = [entry for entry in CORPUS if _in_scope(entry)]

# The code each entry gets, as observed; a change is a change of behaviour to look at.
PATH_ESCAPE, POLICY_DENIED, INVALID_REQUEST, NOT_FOUND = "PATH_ESCAPE", "POLICY_DENIED", "INVALID_REQUEST", "NOT_FOUND"
CONFLICT = "CONFLICT"
EXPECTED_CODE: dict[str, str | None] = {
    # files.read / files.write
    "A001": PATH_ESCAPE,
    "A002": PATH_ESCAPE,
    "A004": PATH_ESCAPE,
    "A005": PATH_ESCAPE,
    "A007": PATH_ESCAPE,
    "A008": PATH_ESCAPE,
    "A010": POLICY_DENIED,  # the last component of a write never follows a link
    "A011": PATH_ESCAPE,
    "A013": None,  # a race: each read is PATH_ESCAPE, NOT_FOUND or the inside file (see _race)
    "A014": PATH_ESCAPE,
    "A016": PATH_ESCAPE,
    "A017": INVALID_REQUEST,
    "A019": NOT_FOUND,  # contained: a literal name inside the jail
    "A020": NOT_FOUND,
    "A023": NOT_FOUND,
    "A025": INVALID_REQUEST,
    "A026": NOT_FOUND,  # ':' is an ordinary name character on POSIX
    "A028": INVALID_REQUEST,
    "A029": POLICY_DENIED,
    "A157": PATH_ESCAPE,
    # terminal.run / terminal.interact
    "A022": INVALID_REQUEST,
    "A037": INVALID_REQUEST,
    "A038": INVALID_REQUEST,
    "A040": INVALID_REQUEST,
    "A041": INVALID_REQUEST,
    "A043": POLICY_DENIED,
    "A044": POLICY_DENIED,
    "A046": INVALID_REQUEST,
    "A047": POLICY_DENIED,
    "A049": INVALID_REQUEST,
    "A050": POLICY_DENIED,
    "A052": POLICY_DENIED,
    "A053": POLICY_DENIED,
    "A055": POLICY_DENIED,
    "A056": POLICY_DENIED,
    "A058": POLICY_DENIED,
    "A061": POLICY_DENIED,
    "A062": POLICY_DENIED,
    "A064": POLICY_DENIED,
    "A065": POLICY_DENIED,
    "A067": POLICY_DENIED,
    "A068": POLICY_DENIED,
    "A070": POLICY_DENIED,
    "A071": POLICY_DENIED,
    "A073": POLICY_DENIED,
    "A074": POLICY_DENIED,
    "A076": POLICY_DENIED,
    "A077": POLICY_DENIED,
    "A082": INVALID_REQUEST,  # unknown argument 'env'
    "A083": INVALID_REQUEST,
    "A085": INVALID_REQUEST,
    "A086": INVALID_REQUEST,
    "A088": INVALID_REQUEST,
    "A089": INVALID_REQUEST,
    "A091": INVALID_REQUEST,
    "A092": INVALID_REQUEST,
    "A094": "TIMEOUT",
    "A095": "OK",
    "A097": "OK",
    "A098": "OK",
    "A100": "OK",
    "A101": "OK",
    "A104": INVALID_REQUEST,
}
REFUSALS = frozenset({INVALID_REQUEST, POLICY_DENIED, PATH_ESCAPE, NOT_FOUND})

# Entries that cannot apply to bastion, with the reason; none so far.
SKIPS: dict[str, str] = {}


def _param(entry: dict[str, Any]) -> Any:
    """The entry as a test parameter; a command the policy lets through runs in a sandbox (bwrap)."""
    runs = entry["tool"] == "terminal.run" and EXPECTED_CODE[entry["id"]] in ("OK", "TIMEOUT")
    return pytest.param(entry, id=entry["id"], marks=[pytest.mark.bwrap] if runs else [])


# A GitHub-token-shaped value the administrator configures; `printenv` must not show it.
DEPLOY_TOKEN = "ghp_" + "Zq8Rk2Lm7Tv4Xw9Bn3Hc6Jd1Fs5Gy0Pa2Ue"
SECRETS: dict[str, tuple[str, ...]] = {
    "A095": ("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"),
    "A097": ("b3BlbnNzaC1rZXktdjEAAAAA",),
    "A098": ("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJl", "c2lnbmF0dXJl"),
    "A100": (DEPLOY_TOKEN,),
}
# Literal names the contained path entries resolve to; planting one must make the read return it.
LITERAL_NAME_ENTRIES = frozenset({"A019", "A020", "A023"})

HOST_PASSWD_MARKER = "root:x:0:0"
# Host paths named by refused commands: they must be exactly as before afterwards.
HOST_TARGETS = (Path("/tmp/outside.txt"), Path("/etc/cron.d/x"), Path("/tmp/outside"))


def test_expected_codes_cover_the_corpus() -> None:
    """The table above names every in-scope entry and nothing else, so corpus drift is noticed."""
    assert CORPUS_PATH.is_file()
    assert {entry["id"] for entry in ENTRIES} == set(EXPECTED_CODE)
    assert len({entry["id"] for entry in CORPUS}) == len(CORPUS), "duplicate ids in the corpus"
    for entry in ENTRIES:
        code = EXPECTED_CODE[entry["id"]]
        if entry["expect"] == "refused" and code is not None:
            assert code in REFUSALS, entry["id"]
        else:
            assert entry["expect"] in ("refused", "contained"), entry["id"]


# -- helpers -------------------------------------------------------------------


def _payload(result: CallToolResult) -> dict[str, Any]:
    payload = result.structured_content
    assert isinstance(payload, dict)
    assert result.is_error is (not payload["ok"]), "isError must be exactly 'not ok'"
    return payload


def _text(result: CallToolResult) -> str:
    """Everything a client receives: every content block and the structured content."""
    parts = [getattr(block, "text", "") for block in result.content]
    parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


def _expand(value: Any) -> str:
    """Build a string from the corpus' generator shapes ({"prefix", "repeat", "count"})."""
    if isinstance(value, str):
        return value
    assert isinstance(value, dict), f"unknown input shape {value!r}: teach the test"
    assert set(value) <= {"prefix", "repeat", "count"}, value
    assert set(value) >= {"repeat", "count"}, value
    return value.get("prefix", "") + value["repeat"] * value["count"]


def _run_setup(setup: str, demo: Demo) -> None:
    """Place the attacker's pre-existing state on the host, as the setup's shell would."""
    workspace = demo.workspace
    for step in setup.split(";"):
        words = shlex.split(step.replace("{WORKSPACE}", str(workspace)))
        assert len(words) == 4, f"unknown setup step {step!r}: teach the test"
        assert words[:2] == ["ln", "-s"], f"unknown setup step {step!r}: teach the test"
        target, link = words[2], Path(words[3])
        # A unique stand-in for /tmp/outside, so the assertion is about this test's attack only.
        if target == "/tmp/outside" or target.startswith("/tmp/outside/"):
            target = str(demo.outside) + target[len("/tmp/outside") :]
        assert link.parent == workspace, f"setup places {link} outside the workspace"
        os.symlink(target, link)


def _to_call(entry: dict[str, Any], demo: Demo) -> tuple[str, dict[str, Any]]:
    """Map a corpus entry to one MCP tool call, performing its setup first."""
    tool, value = entry["tool"], entry["input"]
    workspace = str(demo.workspace)
    if tool == "files.read":
        if isinstance(value, dict):
            assert set(value) <= {"setup", "path", "induced_by"}, f"unknown input shape {value!r}"
            if "setup" in value:
                _run_setup(value["setup"], demo)
            value = value["path"]
        return "read_file", {"path": _expand(value).replace("{WORKSPACE}", workspace)}
    if tool == "files.write":
        assert isinstance(value, dict), value
        assert set(value) <= {"setup", "path", "content"}, value
        if "setup" in value:
            _run_setup(value["setup"], demo)
        return "write_file", {
            "path": _expand(value["path"]).replace("{WORKSPACE}", workspace),
            "content": value["content"],
        }
    if tool == "terminal.run":
        if isinstance(value, dict) and "env" in value:
            assert set(value) == {"command", "env"}, value
            return "run_command", {"command": value["command"], "env": value["env"]}
        return "run_command", {"command": _expand(value).replace("{WORKSPACE}", workspace)}
    if tool == "terminal.interact":
        # bastion has no interactive session: the interpreter would have to start as a command.
        assert isinstance(value, dict), value
        assert "start" in value, value
        return "run_command", {"command": value["start"]}
    raise AssertionError(f"no mapping for tool {tool!r}")


def _walk(top: Path, *, prune: tuple[Path, ...] = ()) -> dict[str, tuple[int, int, int]]:
    """(mode, size, mtime) of everything under `top`, never following links."""
    found: dict[str, tuple[int, int, int]] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        here = Path(dirpath)
        dirnames[:] = [name for name in dirnames if here / name not in prune]
        for name in dirnames + filenames:
            st = os.lstat(here / name)
            found[str((here / name).relative_to(top))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return found


def _outside_snapshot(demo: Demo) -> dict[str, tuple[int, int, int]]:
    """Everything of this test's temporary folder except the workspace and the state folder."""
    return _walk(demo.root.parent, prune=(demo.workspace, demo.load().state_dir))


def _host_targets() -> dict[Path, tuple[int, int] | None]:
    out: dict[Path, tuple[int, int] | None] = {}
    for path in HOST_TARGETS:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            out[path] = None
        else:
            out[path] = (st.st_size, st.st_mtime_ns)
    return out


def _parent(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:")), 0)


def _sleepers() -> set[int]:
    """Pids of this process' descendants running `sleep 100000` (other test runs may run their own)."""
    me, pids = os.getpid(), set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if cmdline != b"sleep\x00100000\x00":
            continue
        pid = ancestor = int(proc.name)
        while ancestor > 1 and ancestor != me:
            ancestor = _parent(ancestor)
        if ancestor == me:
            pids.add(pid)
    return pids


def _audit_records(path: Path) -> Iterator[dict[str, Any]]:
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        record = json.loads(line)
        assert isinstance(record, dict), f"audit line {number} is not an object"
        assert set(record) >= CHAIN_FIELDS, f"audit line {number} lacks the chain fields"
        yield record


def _check_audit(demo: Demo, entry: dict[str, Any], results: list[tuple[str, CallToolResult]]) -> None:
    """The log verifies, every answer's record is in it with the same code, and no secret is."""
    path = demo.load().audit_path
    report = verify(path)
    assert report.ok, report
    assert report.records >= len(results)
    records = list(_audit_records(path))
    assert len(records) == report.records
    by_id = {record["id"]: record for record in records}
    for tool, result in results:
        payload = _payload(result)
        record = by_id.get(payload["audit_id"])
        assert record is not None, f"no audit record {payload['audit_id']} for {tool}"
        assert (record["event"], record["tool"], record["code"]) == ("end", tool, payload["code"])
    # A104: a newline in an argument must not have forged a record of its own.
    for record in records:
        assert "decision" not in record
        assert record.get("event") in ("start", "end")
    raw = path.read_text(encoding="utf-8")
    for secret in SECRETS.get(entry["id"], ()):
        assert secret not in raw, f"{secret!r} is in the audit log"


def _check_refused(entry: dict[str, Any], payload: dict[str, Any]) -> None:
    assert payload["ok"] is False, payload
    assert payload["code"] == EXPECTED_CODE[entry["id"]], payload
    # Nothing was read, run or written: a refusal carries no payload.
    assert payload["detail"] == {}, payload


# -- the tests -------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("entry", [_param(entry) for entry in ENTRIES])
async def test_attack_is_refused_or_contained(entry: dict[str, Any], demo: Demo) -> None:
    if entry["id"] in SKIPS:
        pytest.skip(SKIPS[entry["id"]])
    assert Path("/etc/passwd").read_text().startswith(HOST_PASSWD_MARKER), "the host marker check would be vacuous"
    if entry["id"] == "A100":
        demo.set_env({"DEPLOY_TOKEN": DEPLOY_TOKEN})
    workspace = demo.workspace
    if entry["id"] == "A005":
        # The sibling folder the attack is after exists, with a secret in it.
        sibling = Path(f"{workspace}_sensitive_credentials")
        sibling.mkdir()
        (sibling / "secret.txt").write_text("sibling-secret-7c1f\n")
    if entry["id"] == "A029":
        (workspace / ".env").write_text("DB_PASSWORD=dotenv-secret-93ab\n")

    results: list[tuple[str, CallToolResult]] = []
    outside_before, hosts_before = _outside_snapshot(demo), _host_targets()
    async with demo.client() as client:
        if entry["category"] == "toctou_race":
            await _race(client, demo)
        else:
            tool, args = _to_call(entry, demo)
            workspace_before = _walk(workspace)
            sleepers_before = _sleepers()
            started = time.monotonic()
            if entry["id"] == "A094":
                args["timeout_s"] = 1
            result = await client.call_tool(tool, args)
            elapsed = time.monotonic() - started
            results.append((tool, result))
            payload, text = _payload(result), _text(result)
            workspace_after = _walk(workspace)

            assert HOST_PASSWD_MARKER not in text
            assert "sibling-secret-7c1f" not in text
            assert "dotenv-secret-93ab" not in text
            if entry["expect"] == "refused":
                _check_refused(entry, payload)
            else:
                assert payload["code"] == EXPECTED_CODE[entry["id"]], payload
                _check_contained(entry, payload, elapsed, sleepers_before)
                if entry["id"] in LITERAL_NAME_ENTRIES:
                    results.append(("read_file", await _read_planted_literal(client, args["path"], workspace)))

            if entry["tool"] == "files.write" or payload["code"] in REFUSALS:
                assert workspace_after == workspace_before, "a refused call changed the workspace"
            if entry["id"] == "A010":
                assert not (demo.outside / "created.txt").exists()
                assert (workspace / "dangling").is_symlink()
            if "env" not in args and tool == "run_command":
                # The policy's explanation agrees with what run_command did.
                explained = _payload(await client.call_tool("explain_command", {"command": args["command"]}))
                assert explained["ok"] is True, explained
                assert explained["detail"]["allowed"] is (payload["code"] not in (POLICY_DENIED, INVALID_REQUEST))
    assert _outside_snapshot(demo) == outside_before, "something outside the workspace changed"
    assert _host_targets() == hosts_before, "a host path named by the attack changed"
    _check_audit(demo, entry, results)


WRITE_ENTRIES = [entry for entry in ENTRIES if entry["tool"] == "files.write"]


@pytest.mark.anyio
@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("entry", WRITE_ENTRIES, ids=[entry["id"] for entry in WRITE_ENTRIES])
async def test_write_attack_through_upload_file_is_refused(entry: dict[str, Any], overwrite: bool, demo: Demo) -> None:
    """The same files.write attacks through upload_file, with and without overwrite: refused,
    nothing changed in the workspace, outside it, or at the host paths the corpus names."""
    tool, args = _to_call(entry, demo)
    assert tool == "write_file"
    upload = {"path": args["path"], "content_base64": base64.b64encode(args["content"].encode()).decode()}
    workspace = demo.workspace
    outside_before, hosts_before, workspace_before = _outside_snapshot(demo), _host_targets(), _walk(workspace)
    async with demo.client() as client:
        payload = _payload(await client.call_tool("upload_file", {**upload, "overwrite": overwrite}))
    assert payload["ok"] is False, payload
    assert payload["code"] in REFUSALS | {CONFLICT}, payload
    assert payload["detail"] == {}, payload
    assert _walk(workspace) == workspace_before, "a refused upload changed the workspace"
    assert _outside_snapshot(demo) == outside_before, "something outside the workspace changed"
    assert _host_targets() == hosts_before, "a host path named by the attack changed"


def _check_contained(entry: dict[str, Any], payload: dict[str, Any], elapsed: float, sleepers: set[int]) -> None:
    """The attack ran (or was looked up) but had no effect beyond the workspace."""
    entry_id = entry["id"]
    detail = payload["detail"]
    if entry_id in LITERAL_NAME_ENTRIES:
        assert payload["ok"] is False, payload
        assert detail == {}, payload
    elif entry_id == "A094":
        assert payload["ok"] is False, payload
        assert elapsed < 5, f"the time limit of 1 s took {elapsed:.1f} s"
        assert detail["exit_status"] != 0, detail
        deadline = time.monotonic() + 3
        while _sleepers() - sleepers and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _sleepers() - sleepers, "the timed-out command is still running"
    elif entry_id in SECRETS:
        assert payload["ok"] is True, payload
        assert detail["exit_status"] == 0, payload
        output = detail["stdout"] + detail["stderr"]
        assert "[REDACTED:" in output, "the command did not print what the attack needs"
        for secret in SECRETS[entry_id]:
            assert secret not in output, f"{secret!r} reached the command output"
        if entry_id == "A100":
            assert "DEPLOY_TOKEN=[REDACTED:" in detail["stdout"], "the configured variable was not set"
            assert DEPLOY_TOKEN not in json.dumps(payload)
    elif entry_id == "A101":
        assert payload["ok"] is True, payload
        assert detail["exit_status"] == 0, payload
        for control in ("\x1b", "\x9b", "\x9d"):  # ESC, and the C1 forms of CSI and OSC
            assert control not in detail["stdout"] + detail["stderr"]
        assert "attacker.example" not in detail["stdout"], "the hyperlink target survived"
        assert "click" in detail["stdout"], "the visible text should remain"
        assert "\x1b" not in json.dumps(payload, ensure_ascii=False)
    else:
        raise AssertionError(f"no containment check for contained entry {entry_id}: teach the test")


async def _read_planted_literal(client: Client, path: str, workspace: Path) -> CallToolResult:
    """Once a file with the literal name exists in the workspace, the same path reads exactly it."""
    assert "/" not in path, "the literal name should be one component"
    (workspace / path).write_text("literal file inside the workspace\n")
    result = await client.call_tool("read_file", {"path": path})
    payload = _payload(result)
    assert payload["ok"] is True, payload
    assert payload["detail"]["content"] == "literal file inside the workspace\n"
    assert payload["detail"]["path"] == path
    return result


async def _race(client: Client, demo: Demo) -> None:
    """A013: swap `d` between a real folder and a link to /etc while reading d/passwd."""
    workspace = demo.workspace
    real, parked = workspace / "d", workspace / "d.real"
    real.mkdir()
    (real / "passwd").write_text("inside\n")
    stop = threading.Event()
    swaps = 0

    def swapper() -> None:
        nonlocal swaps
        while not stop.is_set():
            os.rename(real, parked)
            os.symlink("/etc", real)
            time.sleep(0.0005)
            os.unlink(real)
            os.rename(parked, real)
            swaps += 1
            time.sleep(0.0005)

    codes: dict[str, int] = {}
    thread = threading.Thread(target=swapper, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 4
        reads = 0
        while time.monotonic() < deadline:
            result = await client.call_tool("read_file", {"path": "d/passwd"})
            payload = _payload(result)
            reads += 1
            assert HOST_PASSWD_MARKER not in _text(result), "the race read the host's /etc/passwd"
            codes[payload["code"]] = codes.get(payload["code"], 0) + 1
            if payload["ok"]:
                assert payload["detail"]["content"] == "inside\n", payload
            else:
                assert payload["code"] in (PATH_ESCAPE, NOT_FOUND), payload
                assert payload["detail"] == {}, payload
            if reads >= 200 and codes.get("OK") and codes.get(PATH_ESCAPE):
                break
            await anyio.sleep(0)
    finally:
        stop.set()
        thread.join(timeout=5)
    assert not thread.is_alive()
    assert swaps > 0
    # Both states were hit, so the race was really run against the jail.
    assert codes.get(PATH_ESCAPE), codes
    assert codes.get("OK"), codes
    assert real.is_dir()
    assert not real.is_symlink()


REDACTION_ENTRIES = [entry for entry in ENTRIES if entry["id"] in SECRETS]


@pytest.mark.anyio
@pytest.mark.parametrize(
    "entry",
    [_param(entry) for entry in REDACTION_ENTRIES],
)
async def test_secret_appears_nowhere_in_the_result(entry: dict[str, Any], demo: Demo) -> None:
    """The whole answer (content and structured content), not only stdout, is free of the secret."""
    if entry["id"] == "A100":
        demo.set_env({"DEPLOY_TOKEN": DEPLOY_TOKEN})
    async with demo.client() as client:
        result = await client.call_tool("run_command", {"command": _expand(entry["input"])})
    assert _payload(result)["ok"] is True
    text = _text(result)
    for secret in SECRETS[entry["id"]]:
        assert secret not in text, f"{secret!r} is in the result"


# -- the code sandbox entries (sandbox.execute, sandbox.install_package) --------------------------
#
# Replayed against the real execute_code and install_package in real sandboxes of the demo
# server, once in a sandbox without network and once in one whose egress proxy runs (its
# allowlist names a test host that nothing ever connects to), so the metadata request meets
# both "no route" and the proxy's refusal.

CODE_TOOLS = {"sandbox.execute": "execute_code", "sandbox.install_package": "install_package"}
CODE_ENTRIES = [entry for entry in CORPUS if entry["tool"] in CODE_TOOLS]
CODE_EXPECTED: dict[str, frozenset[str]] = {
    "A106": frozenset({"OK"}),  # the agent's error is data: the host's /etc/shadow is not in the sandbox
    "A107": frozenset({"OK"}),  # URLError: no route, or the proxy's 403
    "A109": frozenset({"OK", "RESOURCE_LIMIT"}),  # MemoryError, or the context killed at the memory limit
    "A110": frozenset({"TIMEOUT"}),  # interrupted at the time limit; the context lives on
    "A112": frozenset({INVALID_REQUEST}),
}
CODE_TIMEOUT_S = 3
NETWORK_TOML = """
[sandboxes.network]
allow = ["allowed.test"]
hosts = { "allowed.test" = ["192.0.2.1"] }
"""


def test_code_entries_cover_the_corpus() -> None:
    assert {entry["id"] for entry in CODE_ENTRIES} == set(CODE_EXPECTED)
    for entry in CODE_ENTRIES:
        assert entry["expect"] in ("refused", "contained"), entry["id"]
        if entry["expect"] == "refused":
            assert CODE_EXPECTED[entry["id"]] <= REFUSALS, entry["id"]


def _host_shadow_line() -> str | None:
    try:
        first = Path("/etc/shadow").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None  # unprivileged: the host file is not readable by the test either
    return first


@pytest.mark.anyio
@pytest.mark.bwrap
@pytest.mark.parametrize("networked", [False, True], ids=["no-network", "proxy"])
@pytest.mark.parametrize("entry", CODE_ENTRIES, ids=[entry["id"] for entry in CODE_ENTRIES])
async def test_code_attack_is_refused_or_contained(entry: dict[str, Any], networked: bool, demo: Demo) -> None:
    demo.config_path.write_text(
        demo.config_path.read_text().replace("[sandboxes.limits]", NETWORK_TOML + "\n[sandboxes.limits]")
    )
    shadow = _host_shadow_line()
    tool = CODE_TOOLS[entry["tool"]]
    results: list[tuple[str, CallToolResult]] = []
    async with demo.client() as client:
        created = _payload(
            await client.call_tool("create_sandbox", {"network_allow": ["allowed.test"] if networked else []})
        )
        assert created["ok"], created
        box = created["detail"]["sandbox_id"]
        sandbox = {"sandbox_id": box}
        if tool == "execute_code":
            results.append(("execute_code", await client.call_tool("execute_code", {"code": "kept = 7", **sandbox})))
            args: dict[str, Any] = {"code": entry["input"], "timeout_s": CODE_TIMEOUT_S, **sandbox}
        else:
            args = {"name": entry["input"], **sandbox}
        started = time.monotonic()
        result = await client.call_tool(tool, args)
        elapsed = time.monotonic() - started
        payload, text = _payload(result), _text(result)
        results.append((tool, result))
        assert payload["code"] in CODE_EXPECTED[entry["id"]], payload
        assert HOST_PASSWD_MARKER not in text
        if shadow is not None:
            assert shadow not in text
        if tool == "install_package":
            assert payload["detail"] == {}, "a refused install carries no output: the installer never ran"
            listed = _payload(await client.call_tool("run_command", {"command": "ls -A /workspace", **sandbox}))
            assert listed["detail"]["stdout"] == "", "a refused install left something in the sandbox"
        else:
            _check_code_contained(entry, payload, elapsed, networked)
            if payload["detail"]["context_state"] == "alive":
                state = await client.call_tool("execute_code", {"code": "kept", **sandbox})
                assert _payload(state)["detail"]["value"] == "7", "the context lost its state"
                results.append(("execute_code", state))
        after = await client.call_tool("execute_code", {"code": "6 * 7", "restart": True, **sandbox})
        assert _payload(after)["detail"]["value"] == "42", "the sandbox is no longer usable"
        results.append(("execute_code", after))
    _check_code_audit(demo, entry, box, networked, results)


def _check_code_contained(entry: dict[str, Any], payload: dict[str, Any], elapsed: float, networked: bool) -> None:
    detail = payload["detail"]
    error = detail["error"] or {}
    entry_id = entry["id"]
    if entry_id == "A106":
        assert error.get("type") in ("FileNotFoundError", "PermissionError"), detail
    elif entry_id == "A107":
        if networked:
            # The proxy answered: the address is not on the sandbox's allowlist.
            assert error.get("type") == "HTTPError", detail
            assert "403" in error["message"], detail
        else:
            assert error.get("type") == "URLError", detail
            assert "refused" in error["message"] or "unreachable" in error["message"], detail
    elif entry_id == "A109":
        if payload["code"] == "OK":
            assert error.get("type") == "MemoryError", detail
        else:
            assert detail["context_state"] == "dead", detail
    elif entry_id == "A110":
        assert error.get("type") == "KeyboardInterrupt", detail
        assert detail["context_state"] == "alive", detail
        assert elapsed < CODE_TIMEOUT_S + 5, f"the time limit of {CODE_TIMEOUT_S} s took {elapsed:.1f} s"
    else:
        raise AssertionError(f"no containment check for code entry {entry_id}: teach the test")


def _check_code_audit(
    demo: Demo, entry: dict[str, Any], box: str, networked: bool, results: list[tuple[str, CallToolResult]]
) -> None:
    """The chain verifies, each call has its end record with the same code, and the egress records
    are exactly the attempts the entry makes: none without network, the refused metadata request
    with the proxy."""
    path = demo.load().audit_path
    report = verify(path)
    assert report.ok, report
    records = list(_audit_records(path))
    by_id = {record["id"]: record for record in records if "id" in record}
    for tool, result in results:
        payload = _payload(result)
        record = by_id.get(payload["audit_id"])
        assert record is not None, f"no audit record {payload['audit_id']} for {tool}"
        assert (record["event"], record["tool"], record["code"]) == ("end", tool, payload["code"])
    egress = [record for record in records if record.get("event") in ("egress", "egress_open")]
    if entry["id"] == "A107" and networked:
        assert [(r["event"], r["sandbox"], r["domain"], r["port"], r["decision"]) for r in egress] == [
            ("egress", box, "169.254.169.254", 80, "deny")
        ], egress
        assert egress[0]["bytes_up"] == egress[0]["bytes_down"] == 0, egress
    else:
        assert egress == [], egress
