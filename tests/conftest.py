"""Shared fixtures: a real demo config in a temp folder, and the real server built from it."""

from __future__ import annotations

import contextlib
import glob
import os
import stat
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Final

import pytest
from hypothesis import settings
from mcp import Client

from bastion.app import Services, build_server, build_services
from bastion.config import Config, load_config
from tests.helpers import DATA_ENV, demo_config_at

_mktemp = pytest.TempPathFactory.mktemp


def _passable_mktemp(self: pytest.TempPathFactory, basename: str, numbered: bool = True) -> Path:
    """pytest's temp folders, passable by others (o+x) when the tests run as root.

    A root server's sandboxes run as ids of their own and must pass through the folders above
    their state folder, as an administrator's /var/lib is; pytest makes its folders 0700. Every
    temp folder (tmp_path and tmp_path_factory alike) comes from here. Passable, never listable.
    """
    path = _mktemp(self, basename, numbered)
    if os.geteuid() == 0:
        for folder in (path, *path.parents):
            if folder == Path(tempfile.gettempdir()):
                break
            folder.chmod(folder.stat().st_mode | 0o111)
    return path


pytest.TempPathFactory.mktemp = _passable_mktemp  # type: ignore[method-assign]

# No per-example deadline: on a loaded 2-core machine a slow example is noise, not a finding (speed is
# measured in bench/, never by a test's clock); hypothesis still shrinks and reports every failure.
settings.register_profile("bastion", deadline=None)
settings.load_profile("bastion")


WORKER_TEMP: list[Path] = []
"""This worker's temp folder, removed at its end if the tests left it empty."""


CGROUP_BASES: Final = "/sys/fs/cgroup/bastion", "/sys/fs/cgroup/*/bastion"
"""Where the tests' servers make their base cgroup (`CgroupLayout.detect`), as root."""
KEEP_CGROUP_BASES: Final = "BASTION_TESTS_KEEP_CGROUP_BASES"
"""Set by scripts/test-suite.sh: other passes run beside this one and may still use the bases; it removes
them itself once every pass is over."""
BASES_BEFORE: set[str] = set()
"""The base cgroups that existed when this run started: never removed by it."""


def _cgroup_bases() -> set[str]:
    return {base for pattern in CGROUP_BASES for base in glob.glob(pattern) if os.path.isdir(base)}


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker gets a temp folder of its own (TMPDIR, inherited by the servers
    the tests start): tests that check the temp folder for leftovers see only their own worker's. Its
    name has the worker's pid: the root and unprivileged passes run side by side, each with a gw0."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        BASES_BEFORE.update(_cgroup_bases())
        return
    folder = Path(tempfile.gettempdir()) / f"bastion-tests-{worker}-{os.getpid()}"
    folder.mkdir()
    folder.chmod(0o1777)  # as /tmp: the sandboxes' own ids use it too
    WORKER_TEMP.append(folder)
    os.environ["TMPDIR"] = str(folder)
    tempfile.tempdir = None  # gettempdir() caches: read TMPDIR again


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove the worker's temp folder if empty; one the tests left something in stays, to be seen. The run
    (not a worker) removes the base cgroups its servers made, if empty: a server keeps its base while it
    runs, and one holding a sandbox's group stays, to be seen."""
    for folder in WORKER_TEMP:
        with contextlib.suppress(OSError):
            folder.rmdir()
    if os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get(KEEP_CGROUP_BASES):
        return
    for base in _cgroup_bases() - BASES_BEFORE:
        with contextlib.suppress(OSError):
            os.rmdir(base)


@pytest.fixture(scope="session", autouse=True)
def _no_privileged_file_outlives_the_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Tests make setuid and setgid files in their temp folders (to see that sandboxes cannot run or keep them),
    and pytest keeps the last three runs' folders: at the end of the run their bits are cleared, so no
    privileged program is left on the machine (found in the twenty-eighth session: dozens were)."""
    yield
    clear_privilege_bits(tmp_path_factory.getbasetemp())


def clear_privilege_bits(root: Path) -> None:
    """Clear S_ISUID and S_ISGID on every regular file beneath `root`, following no link, on its filesystem."""
    device = root.stat().st_dev

    def same_filesystem(name: str, fd: int) -> bool:
        try:
            return os.stat(name, dir_fd=fd, follow_symlinks=False).st_dev == device
        except OSError:  # gone meanwhile, or not ours to look at (the unprivileged pass)
            return False

    # By fd (os.fwalk, which skips what it cannot read): some tests make folders deeper than PATH_MAX.
    for _, folders, files, fd in os.fwalk(root):
        folders[:] = [name for name in folders if same_filesystem(name, fd)]
        for name in files:
            with contextlib.suppress(OSError):
                mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
                if stat.S_ISREG(mode) and mode & (stat.S_ISUID | stat.S_ISGID):
                    os.chmod(name, stat.S_IMODE(mode) & ~(stat.S_ISUID | stat.S_ISGID), dir_fd=fd)


LONG_FIRST = ("tests/load/test_soak.py", "tests/load/test_load.py")
"""The longest files (minutes, mostly waiting on a steady rate): handed out first."""


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile`, with `LONG_FIRST` handed out before the rest: xdist orders files by their
    number of tests, so the one-test soak went last and held one worker alone for its 3 minutes
    while the other had finished. Scheduling only: no test depends on another's order."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling  # type: ignore[import-untyped]  # xdist ships no types

    class LongFirst(LoadFileScheduling):  # type: ignore[misc]  # an untyped base
        def _assign_work_unit(self, node: Any) -> None:
            for scope in LONG_FIRST:
                if scope in self.workqueue:
                    self.workqueue.move_to_end(scope, last=False)
                    break
            super()._assign_work_unit(node)

    return LongFirst(config, log)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def demo_config_path(tmp_path: Path) -> Path:
    return demo_config_at(tmp_path / "demo", DATA_ENV if (DATA_ENV / "pyvenv.cfg").is_file() else None)


@pytest.fixture
def demo_config(demo_config_path: Path) -> Config:
    return load_config(demo_config_path)


@pytest.fixture
def workspace(demo_config: Config) -> Path:
    return demo_config.workspace[0].path


@pytest.fixture
def services(demo_config: Config) -> Iterator[Services]:
    built = build_services(demo_config)
    yield built
    built.close()


@pytest.fixture
async def client(services: Services) -> AsyncIterator[Client]:
    """The SDK's real client, connected in-process to the real server (real sandbox, jail, audit)."""
    async with Client(build_server(services, caller="test")) as connected:
        yield connected
