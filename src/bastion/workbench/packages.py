"""install_package: a requirement, and nothing else, installed inside the sandbox.

The argument is checked against a narrow grammar (a PEP 508 name with optional extras
and version specifiers; for npm a package name, optionally scoped, with a version range)
so that no option (``--index-url``, ``-e``, ``--pre``), URL, path or VCS link can reach
the installer; names the installers would read as a local archive (``x.whl``, ``x@1.tgz``)
or folder (npm's ``x@..``) are refused too. The installer runs inside the sandbox (a source
distribution's build code is untrusted), with ``--`` before the requirement and the network
widened to the package registry for the duration of the install only. pip reads no config
file; npm reads the sandbox's ``.npmrc``, whose settings its command line overrides (and
whatever it says, the proxy admits only the registry).

Credentials in ``pip_index_url`` and ``npm_registry_url`` never go on a command line, which every
local user can read (/proc/<pid>/cmdline): pip gets the URL without them and reads them from a netrc
file that a shell writes from its environment (readable only by the sandbox's own id and root) into
the sandbox's /tmp; npm reads them from its environment as its own ``//host/:_auth`` setting. Not a
secret from the agent: the file, and the environment of the installer, are its sandbox's to read
while the install runs.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol
from urllib.parse import SplitResult, unquote, urljoin, urlsplit

import anyio

from bastion.safety.errors import NotFound, OperationFailed, PathEscape
from bastion.safety.requirements import Manager, check_requirement
from bastion.sandbox import SANDBOX_PATH
from bastion.workbench.workspace import OWN_VENV, SYSTEM_PYTHON

if TYPE_CHECKING:
    from bastion.config import AllowRule, SandboxesConfig
    from bastion.safety.paths import Jail
    from bastion.workbench.progress import LineProgress
    from bastion.workbench.workspace import CommandOutput, HostWorkspace

TEMPLATE_SITE_GLOB: Final = "/opt/bastion/env/lib/python3*/site-packages"
NPM_PREFIX: Final = "/workspace"
VENV_PYTHON: Final = ".venv/bin/python"  # relative to the workspace: OWN_VENV's python

# The venv's own site-packages also sees the template's packages (read-only, below it).
_LINK_TEMPLATE: Final = (
    "import glob, site\n"
    f"found = glob.glob({TEMPLATE_SITE_GLOB!r})\n"
    "if found:\n"
    "    open(site.getsitepackages()[0] + '/_bastion_template.pth', 'w').write(found[0] + '\\n')\n"
)


def venv_commands() -> list[tuple[str, ...]]:
    """argv lists that make the sandbox's own venv, linked to the template's packages."""
    return [
        (SYSTEM_PYTHON, "-m", "venv", OWN_VENV),
        (f"{OWN_VENV}/bin/python", "-c", _LINK_TEMPLATE),
    ]


def pip_command(requirement: str, index_url: str, cert: str | None) -> tuple[str, ...]:
    # --isolated skips the user's config and PIP_* variables but still reads the venv's own
    # pip.conf, which the agent can write (find-links, no-index...): PIP_CONFIG_FILE=/dev/null
    # is pip's documented switch that skips every config file.
    argv = [ENV, PIP_NO_CONFIG, f"{OWN_VENV}/bin/python", "-m", "pip", "install", "--isolated", "--no-input"]
    argv += ["--disable-pip-version-check", "--progress-bar", "off", "--index-url", index_url]
    if cert is not None:
        argv += ["--cert", cert]
    return (*argv, "--", requirement)


@dataclass(frozen=True)
class PipIndex:
    """`pip_index_url` split in two: what may go on pip's command line, and the credentials."""

    url: str
    """The index URL without its user and password."""
    netrc: str | None
    """A netrc entry giving the user and password to the index's host; None: the URL had none."""


def pip_index(url: str) -> PipIndex:
    """Split the credentials (``https://user:token@host/...``) out of a pip index URL.

    pip percent-decodes them (its ``split_auth_from_netloc``) and so does this; the host is
    taken as requests matches netrc entries (the netloc up to its first colon).
    """
    scheme, netloc = urlsplit(url)[:2]
    userinfo, at, host_port = netloc.rpartition("@")
    if not at:
        return PipIndex(url, None)
    public = f"{scheme}://{host_port}{url[len(scheme) + 3 + len(netloc) :]}"
    user, colon, password = userinfo.partition(":")
    entry = f"machine {_netrc_token(host_port.split(':')[0])} login {_netrc_token(unquote(user))}"
    if colon and password:
        entry += f" password {_netrc_token(unquote(password))}"
    return PipIndex(public, entry)


_NETRC_BARE: Final = re.compile(r'[^\s"\\#]+')


def _netrc_token(text: str) -> str:
    # Bare when it can be; quoted otherwise, with \ and " escaped (Python 3.11's netrc reads both).
    if _NETRC_BARE.fullmatch(text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


NETRC_VAR: Final = "BASTION_PIP_NETRC"
# pip puts its index URL, credentials and all, on the command line of the pip that installs an
# sdist's build dependencies (pip/_internal/build_env.py): so they reach pip as a netrc file
# (requests reads the one $NETRC names), written by the shell's printf builtin (no new process).
_WITH_NETRC: Final = (
    "umask 077 && netrc=$(mktemp) || exit 1\n"
    f'printf "%s\\n" "${NETRC_VAR}" > "$netrc" || exit 1\n'
    f"unset {NETRC_VAR}\n"
    'NETRC=$netrc "$@"\n'
    "status=$?\n"
    'rm -f "$netrc"\n'
    'exit "$status"\n'
)


def with_netrc(argv: tuple[str, ...]) -> tuple[str, ...]:
    """`argv` run by a shell that first writes ``$BASTION_PIP_NETRC`` to a netrc file named by ``NETRC``."""
    return (SHELL, "-c", _WITH_NETRC, "sh", *argv)


@dataclass(frozen=True)
class NpmRegistry:
    """`npm_registry_url` split in two: what may go on npm's command line, and the credentials."""

    url: str
    """The registry URL without its user and password."""
    env: dict[str, str]
    """npm's setting of them, as an environment variable (empty: the URL had none)."""


def npm_registry(url: str) -> NpmRegistry:
    """Split the credentials (``https://user:token@host/...``) out of an npm registry URL.

    npm sends a registry URL's user and password, percent-decoded, as basic auth; the same from its
    ``//host/dir/:_auth`` setting, which it reads from ``npm_config_//host/dir/:_auth`` unchanged (an
    environment variable: /proc/<pid>/environ is the sandbox's own, cmdline any local user's). The key is
    npm's "nerf dart" of the URL: host and port, and the path up to its last slash.
    """
    parts = urlsplit(url)
    scheme, netloc = parts[:2]
    userinfo, at, host_port = netloc.rpartition("@")
    if not at:
        return NpmRegistry(url, {})
    public = f"{scheme}://{host_port}{url[len(scheme) + 3 + len(netloc) :]}"
    user, _, password = userinfo.partition(":")
    basic = base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode("ascii")
    return NpmRegistry(public, {f"npm_config_{_nerf_dart(parts)}:_auth": basic})


_DEFAULT_PORTS: Final = {"http": 80, "https": 443}


def _nerf_dart(parts: SplitResult) -> str:
    """npm's key for a registry's settings (its `nerfDart`): ``//host[:port]/dir/`` of the URL as WHATWG URL
    reads it, the host lower-cased, the scheme's default port left out, dot segments resolved, and the path
    cut after its last slash. A key written otherwise is not found, and npm sends no credentials."""
    host = (parts.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"
    port = parts.port
    if port is not None and port != _DEFAULT_PORTS.get(parts.scheme):
        host += f":{port}"
    # urljoin resolves dot segments as RFC 3986 does; joining "." then cuts after the last slash.
    folder = urlsplit(urljoin(urljoin("http://x/", parts.path or "/"), ".")).path
    return f"//{host}{folder}"


def npm_command(requirement: str, registry_url: str, cert: str | None) -> tuple[str, ...]:
    # --ignore-scripts: a package's install scripts do not run at install time.
    argv = ["npm", "install", "--prefix", NPM_PREFIX, "--no-audit", "--no-fund", "--no-update-notifier"]
    argv += ["--ignore-scripts"]
    argv += ["--registry", registry_url]
    if cert is not None:
        argv += ["--cafile", cert]
    return (*argv, "--", requirement)


CA_BUNDLE: Final = "/etc/ssl/certs/ca-certificates.crt"  # bound into every sandbox (see _spawn)


class Widens(Protocol):
    """A sandbox's network that can be widened for one block (`SandboxNetwork.widened`)."""

    def widened(self, workspace: HostWorkspace, extra: Sequence[AllowRule]) -> AbstractAsyncContextManager[None]: ...


class Installable(Protocol):
    """What an install needs of a sandbox (the manager's `Sandbox` is one): given, never looked up."""

    @property
    def workspace(self) -> HostWorkspace: ...

    @property
    def network(self) -> Widens: ...


ENV: Final = "/usr/bin/env"
SHELL: Final = "/bin/sh"
PIP_NO_CONFIG: Final = f"PIP_CONFIG_FILE={os.devnull}"
VENV_TIMEOUT_S: Final = 120.0


async def install(
    box: Installable,
    requirement: str,
    manager: Manager,
    config: SandboxesConfig,
    progress: LineProgress | None = None,
) -> tuple[str, CommandOutput]:
    """Install `requirement` into the sandbox's own environment; return it (checked) and the installer's output.

    `progress`, when given, hears each step and the installer's output as it comes.

    Raises:
        InvalidRequest: not a plain requirement (`check_requirement`).
        Forbidden: a host workspace (only sandboxes have packages of their own).
        PolicyDenied: the sandbox's template has a command policy.
        NotFound: npm is not installed in the sandbox.
        PathEscape: the sandbox's `.venv` is a link leaving its workspace.
        OperationFailed: the sandbox's venv could not be made.
    """
    checked = check_requirement(requirement, manager)
    workspace = box.workspace
    workspace.require_shell("package installs")
    registry = config.network.registry_rules
    # Refused before the network is widened; in a worker thread, as the jail resolves the sandbox's links.
    has_venv = manager == "pip" and await anyio.to_thread.run_sync(_has_venv, workspace.jail)
    sinks = progress.sinks() if progress is not None else None
    ceiling = config.install_timeout_s
    async with box.network.widened(workspace, registry):
        if manager == "npm":
            npm = shutil.which("npm", path=SANDBOX_PATH)
            if npm is None:
                raise NotFound("npm is not installed in this sandbox's template")
            registry_url = npm_registry(config.npm_registry_url)
            argv = npm_command(checked, registry_url.url, _ca_bundle())
            _tell(progress, f"npm install {checked}")
            return checked, await workspace.run_argv(
                npm, argv, timeout_s=None, ceiling_s=ceiling, on_output=sinks, env=registry_url.env
            )
        if not has_venv:
            _tell(progress, f"making the sandbox's own venv ({OWN_VENV})")
            await _make_venv(workspace)
        index = pip_index(config.pip_index_url)
        argv = pip_command(checked, index.url, _ca_bundle())
        env: dict[str, str] = {}
        if index.netrc is not None:
            argv, env = with_netrc(argv), {NETRC_VAR: index.netrc}
        _tell(progress, f"pip install {checked}")
        out = await workspace.run_argv(argv[0], argv, timeout_s=None, ceiling_s=ceiling, on_output=sinks, env=env)
        return checked, out


def _tell(progress: LineProgress | None, step: str) -> None:
    if progress is not None:
        progress.phase(step)


def _has_venv(jail: Jail) -> bool:
    """Whether the sandbox's venv has its python (a link counts, dangling or not).

    Asked through the jail: the sandbox makes `.venv` and its parts, and a host lookup that
    followed its links would answer by whether a host path exists (an oracle on the host's
    files). The jail refuses any link leaving the workspace, whatever its target.

    Raises:
        PathEscape: `.venv`, `.venv/bin` or its python is reached through a link leaving the workspace.
    """
    try:
        return jail.kind(VENV_PYTHON) is not None
    except PathEscape:
        raise PathEscape(
            f"/workspace/{VENV_PYTHON} goes through a link that leaves the workspace: remove the link "
            "(or the .venv folder) and install again"
        ) from None


def _ca_bundle() -> str | None:
    # The machine's CA bundle (it may trust a registry mirror's certificate); pip's own otherwise.
    return CA_BUNDLE if os.path.isfile(CA_BUNDLE) else None


async def _make_venv(workspace: HostWorkspace) -> None:
    for argv in venv_commands():
        out = await workspace.run_argv(argv[0], argv, timeout_s=None, ceiling_s=VENV_TIMEOUT_S)
        if out.exit_status != 0:
            last = (out.stderr.strip().splitlines() or ["no output"])[-1][:300]
            raise OperationFailed(f"the sandbox's own venv could not be made: {last}")
