"""Per-sandbox env and labels: the checks on what a client sends, then end to end through a real
MCP client and real sandboxes (commands, background processes and code contexts see the env; labels
filter list_sandboxes), and the default git identity of a fresh sandbox."""

from __future__ import annotations

import shutil
from pathlib import Path

import anyio
import pytest
from mcp import Client

from bastion.app import build_server, build_services
from bastion.config import load_config
from bastion.safety.errors import InvalidRequest
from bastion.workbench.settings import (
    MAX_ENV_TOTAL_CHARS,
    MAX_ENV_VALUE_CHARS,
    MAX_ENV_VARS,
    MAX_LABEL_VALUE_CHARS,
    MAX_LABELS,
    checked_settings,
    label_filter,
)
from tests.helpers import call, create, sh

# Names the config's `env` refuses: each one changes how code loads, or is bastion's own.
LOADER_NAMES = (
    "LD_PRELOAD",
    "ld_preload",
    "LD_LIBRARY_PATH",
    "PYTHONPATH",
    "PYTHONSTARTUP",
    "GIT_SSH_COMMAND",
    "GIT_CONFIG_GLOBAL",
    "NODE_OPTIONS",
    "PERL5OPT",
    "RUBYOPT",
    "BASH_ENV",
    "DYLD_INSERT_LIBRARIES",
    "PATH",
    "HOME",
    "LANG",
)
BAD_NAMES = ("", "1X", "A=B", "A B", "A-B", "É", "A\0B", "A\nB")


@pytest.mark.parametrize("name", LOADER_NAMES + BAD_NAMES)
def test_env_refuses_what_the_config_refuses(name: str) -> None:
    """Invariant: a name the administrator could not set in bastion.toml cannot be set by an agent either."""
    with pytest.raises(InvalidRequest, match="env: "):
        checked_settings({name: "x"}, None)


def test_env_refuses_names_the_administrator_or_the_proxy_sets() -> None:
    """An agent cannot shadow a configured (secret) variable, nor point a client at another proxy."""
    with pytest.raises(InvalidRequest, match="'TOKEN' is set by the administrator"):
        checked_settings({"TOKEN": "mine"}, None, taken={"TOKEN"})


def test_env_is_bounded_in_count_size_and_bytes() -> None:
    with pytest.raises(InvalidRequest, match=f"at most {MAX_ENV_VARS}"):
        checked_settings({f"V{i}": "x" for i in range(MAX_ENV_VARS + 1)}, None)
    with pytest.raises(InvalidRequest, match=f"longer than {MAX_ENV_VALUE_CHARS}"):
        checked_settings({"BIG": "x" * (MAX_ENV_VALUE_CHARS + 1)}, None)
    with pytest.raises(InvalidRequest, match="variable name is longer"):
        checked_settings({"N" * 129: "x"}, None)
    many = {f"V{i}": "x" * MAX_ENV_VALUE_CHARS for i in range(MAX_ENV_TOTAL_CHARS // MAX_ENV_VALUE_CHARS)}
    with pytest.raises(InvalidRequest, match=f"at most {MAX_ENV_TOTAL_CHARS}"):
        checked_settings(many, None)
    with pytest.raises(InvalidRequest, match="NUL"):
        checked_settings({"V": "a\0b"}, None)


def test_env_values_may_be_any_text_but_nul() -> None:
    """Values are data (quotes, newlines, $(...), unicode): nothing interprets them."""
    odd = {"A": "", "B": "$(reboot)`id`;'\"", "C": "line1\nline2", "D": "héllo ✓"}
    assert dict(checked_settings(odd, None).env) == odd


@pytest.mark.parametrize("key", ["", "-x", ".x", "a b", "a=b", "a/b", "é", "k" * 64, "a\nb"])
def test_labels_refuse_keys_that_are_not_plain_names(key: str) -> None:
    with pytest.raises(InvalidRequest, match="label key"):
        checked_settings(None, {key: "v"})


@pytest.mark.parametrize("value", ["a\nb", "a\x1b[2Jb", "x" * (MAX_LABEL_VALUE_CHARS + 1), "\0"])
def test_labels_refuse_values_that_are_not_short_printable_text(value: str) -> None:
    """Label values come back in every list_sandboxes: no terminal escapes, no newlines, bounded."""
    with pytest.raises(InvalidRequest, match="printable"):
        checked_settings(None, {"k": value})


def test_labels_are_bounded_in_count() -> None:
    with pytest.raises(InvalidRequest, match=f"at most {MAX_LABELS}"):
        checked_settings(None, {f"k{i}": "v" for i in range(MAX_LABELS + 1)})


def test_label_filter_takes_key_or_key_value() -> None:
    assert label_filter("team=blue") == ("team", "blue")
    assert label_filter("team=") == ("team", "")
    assert label_filter("team") == ("team", None)
    assert label_filter("url=a=b") == ("url", "a=b")
    with pytest.raises(InvalidRequest, match="label key"):
        label_filter("=blue")


@pytest.mark.anyio
@pytest.mark.bwrap
async def test_env_reaches_commands_background_processes_and_code(client: Client) -> None:
    """The variables reach everything that runs in the sandbox, unredacted, and get_sandbox_status shows them."""
    env = {"APP_ENV": "staging", "GREETING": "hello world"}
    created = await call(client, "create_sandbox", env=env)
    assert created["ok"], created
    box = created["detail"]["sandbox_id"]
    assert created["detail"]["env"] == env
    out = await sh(client, box, 'echo "$APP_ENV/$GREETING"')
    assert out["detail"]["stdout"] == "staging/hello world\n"
    started = await sh(client, box, 'echo "bg $APP_ENV"', background=True)
    pid = started["detail"]["pid"]
    with anyio.fail_after(10):
        read = await call(client, "read_process_output", pid=pid, sandbox_id=box)
        while read["detail"]["state"] == "running" or read["detail"]["more"]:
            await anyio.sleep(0.02)
            read = await call(client, "read_process_output", pid=pid, sandbox_id=box)
    assert read["detail"]["stdout"] == "bg staging\n"
    code = await call(client, "execute_code", code="import os; os.environ['GREETING']", sandbox_id=box)
    assert code["detail"]["value"] == "'hello world'"
    status = await call(client, "get_sandbox_status", sandbox_id=box)
    assert status["detail"]["env"] == env
    # Another sandbox has none of them.
    other = await create(client)
    empty = await sh(client, other, 'echo "[$APP_ENV]"')
    assert empty["detail"]["stdout"] == "[]\n"


@pytest.mark.anyio
@pytest.mark.bwrap
async def test_refused_env_is_a_typed_error_and_no_sandbox(client: Client) -> None:
    """LD_PRELOAD (any loader variable) is INVALID_REQUEST naming it, before any sandbox is made."""
    for name in ("LD_PRELOAD", "PYTHONPATH", "HTTP_PROXY"):
        refused = await call(client, "create_sandbox", env={name: "/tmp/x.so"})
        assert refused["code"] == "INVALID_REQUEST", refused
        assert name in refused["reason"]
    too_many = await call(client, "create_sandbox", env={f"V{i}": "x" for i in range(MAX_ENV_VARS + 1)})
    assert too_many["code"] == "INVALID_REQUEST"
    wrong_type = await call(client, "create_sandbox", env={"A": 1})
    assert wrong_type["code"] == "INVALID_REQUEST"
    listed = await call(client, "list_sandboxes")
    assert listed["detail"]["sandboxes"] == []


@pytest.mark.anyio
@pytest.mark.bwrap
async def test_labels_show_in_list_and_status_and_filter(client: Client) -> None:
    blue = await create(client, labels={"team": "blue", "ci": "yes"})
    red = await create(client, labels={"team": "red"})
    bare = await create(client)

    async def ids(label: str | None = None) -> list[str]:
        args = {"label": label} if label is not None else {}
        listed = await call(client, "list_sandboxes", **args)
        return [s["sandbox_id"] for s in listed["detail"]["sandboxes"]]

    assert await ids() == [blue, red, bare]
    assert await ids("team=blue") == [blue]
    assert await ids("team") == [blue, red]
    assert await ids("ci=no") == []
    listed = await call(client, "list_sandboxes", label="team=red")
    assert listed["detail"]["sandboxes"][0]["labels"] == {"team": "red"}
    status = await call(client, "get_sandbox_status", sandbox_id=blue)
    assert status["detail"]["labels"] == {"team": "blue", "ci": "yes"}
    bad = await call(client, "list_sandboxes", label="a b=c")
    assert bad["code"] == "INVALID_REQUEST"
    refused = await call(client, "create_sandbox", labels={"team": "line\nbreak"})
    assert refused["code"] == "INVALID_REQUEST"


@pytest.mark.anyio
@pytest.mark.bwrap
async def test_administrators_env_cannot_be_shadowed(demo_config_path: Path) -> None:
    """A configured (secret) variable keeps its value: the agent's same name is refused, not merged."""
    text = demo_config_path.read_text().replace(
        '# env = { NAME = "value" }', 'env = { SERVICE_TOKEN = "s3cr3t-value" }'
    )
    demo_config_path.write_text(text)
    services = build_services(load_config(demo_config_path))
    try:
        async with Client(build_server(services, caller="test")) as client:
            refused = await call(client, "create_sandbox", env={"SERVICE_TOKEN": "mine"})
            assert refused["code"] == "INVALID_REQUEST"
            assert "administrator" in refused["reason"]
    finally:
        services.close()


@pytest.mark.anyio
@pytest.mark.bwrap
@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed on this host")
async def test_git_commit_works_in_a_fresh_sandbox(client: Client) -> None:
    """A default author in the sandbox's own /etc/gitconfig; `-c user.email=...` overrides it; the host's
    /etc/gitconfig (credential helpers and the like) is not shown."""
    box = await create(client)
    out = await sh(
        client,
        box,
        "git init -q repo && cd repo && echo hi > a.txt && git add a.txt && git commit -qm first "
        "&& git log --format='%an <%ae>'",
    )
    assert out["detail"]["exit_status"] == 0, out
    assert out["detail"]["stdout"] == "bastion sandbox <sandbox@bastion.invalid>\n"
    other = await sh(
        client,
        box,
        "cd repo && git -c user.name=Ada -c user.email=ada@example.org commit -q --allow-empty -m second "
        "&& git log -1 --format='%an <%ae>' && git config --system --list",
    )
    assert other["detail"]["exit_status"] == 0, other
    assert other["detail"]["stdout"] == (
        "Ada <ada@example.org>\nuser.name=bastion sandbox\nuser.email=sandbox@bastion.invalid\n"
    )


@pytest.mark.anyio
@pytest.mark.bwrap
@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed on this host")
async def test_git_commit_works_in_a_host_workspace_and_dash_c_stays_refused(client: Client) -> None:
    """The host workspace's commands get the same default author, so its policy need not allow `git -c`,
    which can set core.pager or core.sshCommand and so run any program past the allow-list."""
    init = await call(client, "run_command", command="git init -q repo")
    assert init["ok"], init
    assert init["detail"]["exit_status"] == 0, init
    commit = await call(client, "run_command", command="git commit -q --allow-empty -m first", cwd="repo")
    assert commit["ok"], commit
    assert commit["detail"]["exit_status"] == 0, commit
    log = await call(client, "run_command", command="git log --format=%an", cwd="repo")
    assert log["detail"]["stdout"] == "bastion sandbox\n"
    refused = await call(client, "run_command", command="git -c user.email=a@b.example log", cwd="repo")
    assert refused["code"] == "POLICY_DENIED"


@pytest.mark.anyio
@pytest.mark.bwrap
async def test_restore_keeps_files_not_env_or_labels(client: Client) -> None:
    """As restore_sandbox says: only files come back (like the template, env and labels are not kept)."""
    box = await create(client, env={"APP_ENV": "x"}, labels={"team": "blue"})
    await sh(client, box, "echo kept > f.txt")
    snap = await call(client, "snapshot_sandbox", sandbox_id=box)
    restored = await call(client, "restore_sandbox", snapshot_id=snap["detail"]["snapshot_id"])
    again = restored["detail"]["sandbox_id"]
    assert restored["detail"]["labels"] == {}
    out = await sh(client, again, 'cat f.txt; echo "[$APP_ENV]"')
    assert out["detail"]["stdout"] == "kept\n[]\n"
    assert (await call(client, "get_sandbox_status", sandbox_id=again))["detail"]["env"] == {}


@pytest.mark.anyio
@pytest.mark.bwrap
async def test_a_policy_template_takes_no_env(demo_config_path: Path) -> None:
    """Attack: with an allow-list of `man` or `git log`, PAGER=sh or LESSOPEN='|cmd' would run any program
    the policy refuses. A template with a policy is where the agent has no shell to set variables: no env."""
    demo_config_path.write_text(
        demo_config_path.read_text() + '\n[[template]]\nname = "strict"\n[template.policy]\nallow = ["ls"]\n'
    )
    services = build_services(load_config(demo_config_path))
    try:
        async with Client(build_server(services, caller="test")) as client:
            refused = await call(client, "create_sandbox", template="strict", env={"PAGER": "sh"})
            assert refused["code"] == "POLICY_DENIED", refused
            labelled = await call(client, "create_sandbox", template="strict", labels={"k": "v"})
            assert labelled["ok"], labelled
    finally:
        services.close()
