"""The template catalog: each template's name and one line of what it holds, read from the config."""

from __future__ import annotations

from pathlib import Path

from bastion.config import SandboxesConfig, TemplateConfig
from bastion.workbench.catalog import MAX_PACKAGES_SHOWN, installed_packages, template_catalog


def fake_venv(root: Path, packages: dict[str, str]) -> Path:
    """A folder shaped like a virtual environment, with these distributions installed."""
    site = root / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (root / "bin").mkdir()
    (root / "pyvenv.cfg").write_text("home = /usr/bin\n")
    for name, version in packages.items():
        dist = site / f"{name}-{version}.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return root


def test_default_is_listed_first_and_marked_even_without_a_template_of_its_name() -> None:
    catalog = template_catalog(SandboxesConfig(), ())
    assert [(info.name, info.default) for info in catalog] == [("default", True)]
    assert catalog[0].line() == "default (default): the system's Python, no extra packages; no network"


def test_each_template_says_packages_folders_network_env_and_policy(tmp_path: Path) -> None:
    env = fake_venv(tmp_path / "env", {"numpy": "2.4.6", "pandas": "3.1.1", "pip": "25.0"})
    data = TemplateConfig.model_validate(
        {
            "name": "data",
            "python_env": env,
            "read_only": [{"source": tmp_path, "dest": "/data"}],
            "network_allow": ["api.example.org"],
            "env": {"DATASET": "secret-ish"},
            "limits": {"memory_bytes": 128 * 1024 * 1024},
        }
    )
    strict = TemplateConfig.model_validate({"name": "strict", "policy": {"allow": ["ls"]}})
    sandboxes = SandboxesConfig(default_template="data")
    catalog = template_catalog(sandboxes, (strict, data))
    assert [info.name for info in catalog] == ["data", "strict"]
    line = catalog[0].line()
    assert line.startswith("data (default): Python packages numpy, pandas (in /opt/bastion/env, on PATH)")
    assert "read-only /data" in line
    assert "network: api.example.org" in line
    assert "env DATASET" in line
    assert "limits memory_bytes=128MiB" in line
    # Host paths and env values never show: the folder by where it appears inside, env by its name.
    assert str(tmp_path) not in line
    assert "secret-ish" not in line
    assert "restricted command policy" in catalog[1].line()
    detail = catalog[0].as_detail()
    assert detail["python_packages"] == [{"name": "numpy", "version": "2.4.6"}, {"name": "pandas", "version": "3.1.1"}]
    assert detail["default"] is True
    assert str(tmp_path) not in repr(detail)


def test_a_big_environment_is_cut_in_the_line_not_in_the_data(tmp_path: Path) -> None:
    count = MAX_PACKAGES_SHOWN + 5
    env = fake_venv(tmp_path / "env", {f"pkg{i:03d}": "1.0" for i in range(count)})
    template = TemplateConfig.model_validate({"name": "big", "python_env": env})
    info = template_catalog(SandboxesConfig(), (template,))[1]
    assert "and 5 more" in info.line()
    assert len(info.python_packages) == count


def test_an_environment_without_packages_reads_as_none(tmp_path: Path) -> None:
    assert installed_packages(tmp_path / "missing") == ()
    hostile = tmp_path / "odd[*]?"  # glob characters in the path are taken literally
    fake_venv(hostile, {"numpy": "1.0"})
    assert installed_packages(hostile) == (("numpy", "1.0"),)
