"""Make a virtual environment on the system's Python and pip-install a hashed lock into it. DANGEROUS.

This module starts processes on the host, as the user running `bastion` (often root), outside any
sandbox. It trusts its arguments: `bastion.templates.env` has checked the folder and picked the lock.
What keeps the install from running a package's code: `--only-binary=:all:` (wheels only, so no
setup.py or build backend runs) and `--require-hashes` (every file must match the lock's digest).
Both Pythons run isolated (`-I`) from "/": the caller's working folder is never on sys.path, so a
`venv.py` or `pip/` planted there (in /tmp, say) does not run as root.
Credentials in the index URL never go on pip's command line, which every local user can read
(/proc/<pid>/cmdline): pip reads them from a netrc file only root can read, named by ``NETRC``, held in
memory only (requests reads it; ``--isolated`` leaves it on).
"""

from __future__ import annotations

import contextlib
import os
import subprocess  # allowed in pyproject.toml: this module builds template environments
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from bastion.safety.errors import OperationFailed, Unavailable
from bastion.workbench.packages import pip_index

# Sandboxes see the host's /usr, so an environment made on this interpreter runs inside them too.
SYSTEM_PYTHON: Final = "/usr/bin/python3"


def _clean_env() -> dict[str, str]:
    """The caller's environment without PYTHON* variables (a PYTHONPATH would leak into pip)."""
    return {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}


def make_venv(target: Path) -> None:
    """`python3 -m venv target` with pip (Debian's python3-venv provides ensurepip).

    Raises:
        Unavailable: the system Python cannot make a venv.
    """
    if not Path(SYSTEM_PYTHON).is_file():
        raise Unavailable(f"{SYSTEM_PYTHON} is missing: install python3 (sandboxes use the system's Python)")
    done = subprocess.run(
        [SYSTEM_PYTHON, "-I", "-m", "venv", str(target.absolute())],
        env=_clean_env(),
        cwd="/",
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip() or "no message").splitlines()[-1]
        raise Unavailable(f"{SYSTEM_PYTHON} -m venv {target} failed ({last}): install python3-venv")


def install_lock(target: Path, lock: Path, index_url: str) -> None:
    """pip-install every package of `lock` into the venv `target`; pip's own messages go to stderr.

    Raises:
        OperationFailed: pip exited non-zero (a hash mismatch, an unpinned dependency, no wheel...).
    """
    index = pip_index(index_url)
    argv = [
        str(target.absolute() / "bin" / "python"),
        "-I",  # not the working folder's modules, nor PYTHON* variables, nor the user's site-packages
        "-m",
        "pip",
        "install",
        "--isolated",  # no pip.conf, no PIP_* variables: only what is on this line
        "--no-input",
        "--disable-pip-version-check",
        "--root-user-action=ignore",
        "--quiet",
        "--require-hashes",
        "--only-binary=:all:",
        "--index-url",
        index.url,
        "--requirement",
        str(lock.absolute()),
    ]
    with _netrc_env(index.netrc) as (env, fds):
        done = subprocess.run(argv, env=env, pass_fds=fds, cwd="/", stdin=subprocess.DEVNULL, check=False)
    if done.returncode != 0:
        raise OperationFailed(
            f"pip could not install {lock} into {target} (exit {done.returncode}): see its message above"
        )


@contextlib.contextmanager
def _netrc_env(entry: str | None) -> Iterator[tuple[dict[str, str], tuple[int, ...]]]:
    """pip's environment and the fds it inherits: with `entry`, ``NETRC`` names a memory file holding it.

    Never on disk: a file in /tmp was left behind when the build was killed (SIGTERM skips `finally`; found
    by review). Reached as /dev/fd/N, which opens it afresh at each read (requests reads it per host); other
    users cannot open another process's fds.
    """
    env = _clean_env()
    if entry is None:
        yield env, ()
        return
    fd = os.memfd_create("bastion-netrc", os.MFD_CLOEXEC)
    try:
        os.write(fd, (entry + "\n").encode())  # a few hundred bytes at most: one write to a memory file
        yield {**env, "NETRC": f"/dev/fd/{fd}"}, (fd,)
    finally:
        os.close(fd)
