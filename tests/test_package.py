"""The wheel an administrator installs with `uv tool install` or `pipx install` (issue 18).

Built by `uv build` from this tree, installed into a fresh venv (its dependencies pinned to uv.lock,
from PyPI), and run from there with no source tree in sight: `init`, `doctor`, then the SDK's
stdio client calls tools (one of them in a bubblewrap sandbox, whose programs come from the wheel).
It does not prove `uv tool install` or `pipx` themselves work (README.md's steps were tried by hand).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from mcp import Client, StdioServerParameters

from tests.helpers import REPO, call, registry_reachable

pytestmark = [pytest.mark.network, pytest.mark.bwrap]


def uv() -> str:
    """`make install` puts uv in .tools/; a machine may also have its own."""
    local = REPO / ".tools" / "bin" / "uv"
    found = str(local) if local.exists() else shutil.which("uv")
    if found is None:
        pytest.skip("uv is not installed: 'make install' puts it in .tools/")
    return found


def clean_env() -> dict[str, str]:
    """No PYTHONPATH (the tests' own points at src/) and no venv of the test run: only the wheel.
    HOME stays, so uv's cache does too: the dependencies are not fetched again each run."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "VIRTUAL_ENV", "UV_"))}
    return {**env, "UV_PYTHON_DOWNLOADS": "never"}


def run(argv: list[str | Path], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(a) for a in argv], env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (argv, done.stdout, done.stderr)
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A fresh venv holding the built wheel and uv.lock's versions of its dependencies."""
    if not registry_reachable():
        pytest.skip("the package registry (pypi.org:443) is not reachable from this machine")
    root = tmp_path_factory.mktemp("package")
    env = clean_env()
    tool = uv()
    run([tool, "build", "--wheel", "--quiet", "--out-dir", root / "dist", REPO], env, root)
    (wheel,) = (root / "dist").glob("bastion-*.whl")
    pins: list[str | Path] = [
        "export",
        "--frozen",
        "--no-dev",
        "--no-hashes",
        "--no-emit-project",
        "--output-file",
        root / "pins.txt",
    ]
    run([tool, *pins, "--project", REPO], env, root)
    run([tool, "venv", "--quiet", "--python", "/usr/bin/python3", root / "venv"], env, root)
    python = root / "venv" / "bin" / "python"
    run([tool, "pip", "install", "--quiet", "--python", python, "--constraint", root / "pins.txt", wheel], env, root)
    return root / "venv", env


def test_the_wheel_carries_its_data_and_imports_from_the_venv(installed: tuple[Path, dict[str, str]]) -> None:
    venv, env = installed
    code = (
        "import bastion, importlib.resources as r; print(bastion.__file__); "
        "print(r.files('bastion.templates').joinpath('python-data.lock').is_file())"
    )
    out = run([venv / "bin" / "python", "-c", code], env, venv).stdout.split()
    assert Path(out[0]).is_relative_to(venv)
    assert out[1] == "True"


@pytest.mark.anyio
async def test_an_installed_wheel_inits_passes_doctor_and_serves_stdio(
    installed: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    venv, env = installed
    bastion = venv / "bin" / "bastion"
    run([bastion, "init", tmp_path / "demo"], env, tmp_path)
    config = tmp_path / "demo" / "bastion.toml"
    if os.geteuid() != 0:  # no mounts unprivileged: no per-sandbox filesystem
        config.write_text(config.read_text().replace("disk_quota = true", "disk_quota = false"))
    doctor = run([bastion, "doctor", "--config", config], env, tmp_path)
    assert "no FAIL" in doctor.stdout
    params = StdioServerParameters(command=str(bastion), args=["serve", "--config", str(config), "--stdio"], env=env)
    async with Client(params) as client:
        read = await call(client, "read_file", path="README.md")
        assert read["ok"], read
        assert "bastion demo workspace" in read["detail"]["content"]
        listed = await call(client, "run_command", command="ls")
        assert listed["ok"], listed
        assert listed["detail"]["stdout"] == "README.md\n"
