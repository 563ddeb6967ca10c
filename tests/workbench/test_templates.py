"""Sandbox templates from config: read-only inputs, environment, limits, a stricter policy."""

from __future__ import annotations

from pathlib import Path

import pytest
from mcp import Client

from bastion.app import build_server, build_services
from bastion.cli import EXIT_CONFIG, main
from bastion.config import load_config

pytestmark = [pytest.mark.anyio, pytest.mark.bwrap]

TEMPLATES = """
[[template]]
name = "data"
env = {{ DATASET = "weather" }}
read_only = [{{ source = "{inputs}", dest = "/data" }}]

[template.limits]
memory_bytes = 134217728
pids = 64
cpu_cores = 0.5
timeout_s = 5
max_output_bytes = 4096

[[template]]
name = "strict"
[template.policy]
allow = ["ls", "echo"]
"""


@pytest.fixture
def template_config(demo_config_path: Path, tmp_path: Path) -> Path:
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "readings.csv").write_text("day,temp\nmon,12\n")
    demo_config_path.write_text(demo_config_path.read_text() + TEMPLATES.format(inputs=inputs))
    return demo_config_path


async def test_template_binds_inputs_read_only_with_env_and_limits(template_config: Path) -> None:
    services = build_services(load_config(template_config))
    try:
        async with Client(build_server(services, caller="test")) as client:
            created = await client.call_tool("create_sandbox", {"template": "data"})
            assert created.structured_content is not None
            detail = created.structured_content["detail"]
            assert detail["template"] == "data"
            assert detail["limits"]["memory_bytes"] == 134217728
            box = detail["sandbox_id"]
            out = await client.call_tool(
                "run_command",
                {"command": "cat /data/readings.csv; echo $DATASET; touch /data/new 2>&1", "sandbox_id": box},
            )
            assert out.structured_content is not None
            stdout = out.structured_content["detail"]["stdout"]
            # The template's env value reached the command, and (like every configured value) is redacted.
            assert stdout.startswith("day,temp\nmon,12\n[REDACTED:secret_value]\n")
            assert "Read-only file system" in stdout
            # Template limits are defaults; the administrator's [sandboxes.limits] stays the ceiling.
            more = await client.call_tool("create_sandbox", {"template": "data", "limits": {"pids": 128}})
            assert more.structured_content is not None
            assert more.structured_content["detail"]["limits"]["pids"] == 128
            too_much = await client.call_tool("create_sandbox", {"template": "data", "limits": {"pids": 512}})
            assert too_much.structured_content is not None
            assert too_much.structured_content["code"] == "POLICY_DENIED"
    finally:
        services.close()


async def test_template_policy_is_enforced_without_a_shell(template_config: Path) -> None:
    services = build_services(load_config(template_config))
    try:
        async with Client(build_server(services, caller="test")) as client:
            created = await client.call_tool("create_sandbox", {"template": "strict"})
            assert created.structured_content is not None
            box = created.structured_content["detail"]["sandbox_id"]
            ok = await client.call_tool("run_command", {"command": "echo 'a;b'", "sandbox_id": box})
            assert ok.structured_content is not None
            assert ok.structured_content["detail"]["stdout"] == "a;b\n"
            denied = await client.call_tool("run_command", {"command": "cat /etc/passwd", "sandbox_id": box})
            assert denied.structured_content is not None
            assert denied.structured_content["code"] == "POLICY_DENIED"
            unknown = await client.call_tool("create_sandbox", {"template": "nope"})
            assert unknown.structured_content is not None
            assert unknown.structured_content["code"] == "NOT_FOUND"
    finally:
        services.close()


@pytest.mark.parametrize(
    ("bind", "message"),
    [
        ('{{ source = "{inputs}", dest = "/usr" }}', "would shadow /usr"),
        ('{{ source = "{inputs}", dest = "/workspace/in" }}', "would shadow /workspace"),
        ('{{ source = "state", dest = "/data" }}', "overlaps the state folder"),
        ('{{ source = "missing", dest = "/data" }}', "not an existing folder"),
    ],
)
def test_template_refusals(
    capsys: pytest.CaptureFixture[str], demo_config_path: Path, tmp_path: Path, bind: str, message: str
) -> None:
    inputs = tmp_path / "in"
    inputs.mkdir()
    extra = f'\n[[template]]\nname = "bad"\nread_only = [{bind.format(inputs=inputs)}]\n'
    demo_config_path.write_text(demo_config_path.read_text() + extra.replace("{{", "{").replace("}}", "}"))
    assert main(["serve", "--config", str(demo_config_path), "--stdio"]) == EXIT_CONFIG
    assert message in capsys.readouterr().err


def test_template_setting_some_limits_takes_the_ceiling_for_the_rest(demo_config_path: Path) -> None:
    """A template that sets only memory keeps loading when the ceiling's other limits are lowered."""
    text = demo_config_path.read_text().replace(
        "pids = 256\ncpu_cores = 1.0\ntimeout_s = 60", "pids = 100\ncpu_cores = 1.0\ntimeout_s = 60"
    )
    assert "pids = 100" in text
    extra = '\n[[template]]\nname = "small"\n[template.limits]\nmemory_bytes = 268435456\n'
    demo_config_path.write_text(text + extra)
    config = load_config(demo_config_path)
    template = config.template_by_name("small")
    assert template is not None
    assert template.limits is not None
    assert template.limits.pids is None


@pytest.mark.parametrize("name", ["DATASET\\n", "1ABC", "A-B", ""])
def test_template_env_name_must_be_whole_and_plain(
    capsys: pytest.CaptureFixture[str], demo_config_path: Path, name: str
) -> None:
    # "$" in a Python regex also matches before a final newline: the name is matched whole.
    extra = f'\n[[template]]\nname = "bad"\nenv = {{ "{name}" = "x" }}\n'
    demo_config_path.write_text(demo_config_path.read_text() + extra)
    assert main(["serve", "--config", str(demo_config_path), "--stdio"]) == EXIT_CONFIG
    assert "is not valid" in capsys.readouterr().err
