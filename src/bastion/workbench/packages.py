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
"""

from __future__ import annotations

import os
import re
import shutil
from typing import TYPE_CHECKING, Final, Literal

from bastion.safety.errors import InvalidRequest, NotFound, OperationFailed, PathEscape, PolicyDenied
from bastion.sandbox import SANDBOX_PATH
from bastion.workbench.code import OWN_VENV, SYSTEM_PYTHON

if TYPE_CHECKING:
    from bastion.config import SandboxesConfig
    from bastion.safety.paths import Jail
    from bastion.workbench.manager import Sandbox
    from bastion.workbench.workspace import CommandOutput, HostWorkspace

Manager = Literal["pip", "npm"]
MAX_REQUIREMENT_CHARS: Final = 200
TEMPLATE_SITE_GLOB: Final = "/opt/bastion/env/lib/python3*/site-packages"
NPM_PREFIX: Final = "/workspace"
VENV_PYTHON: Final = ".venv/bin/python"  # relative to the workspace: OWN_VENV's python

_NAME: Final = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_EXTRAS: Final = rf"\[\s*{_NAME}(?:\s*,\s*{_NAME})*\s*\]"
_VERSION: Final = r"[A-Za-z0-9][A-Za-z0-9.*+!_-]*"
_CLAUSE: Final = rf"(?:===|==|!=|<=|>=|~=|<|>)\s*{_VERSION}"
PIP_REQUIREMENT: Final = re.compile(rf"{_NAME}\s*(?:{_EXTRAS})?\s*(?:{_CLAUSE}(?:\s*,\s*{_CLAUSE})*)?")
_NPM_NAME: Final = r"[a-z0-9][a-z0-9._-]*"
# The range never starts with "." (npm reads "x@.." as the folder "..").
NPM_SPEC: Final = re.compile(rf"(?:@{_NPM_NAME}/)?{_NPM_NAME}(?:@[0-9A-Za-z^~<>=*][0-9A-Za-z.^~<>=*|+_-]*)?")
# pip and npm take a requirement ending like an archive for a file in the current folder
# (pip: "x.whl", "x==1.zip"; npm: "x.tgz", "x@1.tar"), found or not: a path in disguise.
ARCHIVE_SUFFIX: Final = re.compile(r"\.(?:whl|zip|tgz|tbz|txz|tlz|tar(?:\.gz|\.bz2|\.xz|\.lz|\.lzma)?)$", re.IGNORECASE)
_TRAILING_EXTRAS: Final = re.compile(r"\[[^\]]*\]$")

# The venv's own site-packages also sees the template's packages (read-only, below it).
_LINK_TEMPLATE: Final = (
    "import glob, site\n"
    f"found = glob.glob({TEMPLATE_SITE_GLOB!r})\n"
    "if found:\n"
    "    open(site.getsitepackages()[0] + '/_bastion_template.pth', 'w').write(found[0] + '\\n')\n"
)


def check_requirement(text: str, manager: Manager) -> str:
    """The requirement, stripped, if it is only a requirement.

    Raises:
        InvalidRequest: an option, URL, path, VCS link, marker or anything else.
    """
    requirement = text.strip()
    if not requirement or len(requirement) > MAX_REQUIREMENT_CHARS:
        raise InvalidRequest(f"give one package requirement of 1 to {MAX_REQUIREMENT_CHARS} characters")
    if requirement.startswith("-"):
        raise InvalidRequest("options are not accepted: give a package name, e.g. 'requests' or 'requests>=2.31'")
    grammar = PIP_REQUIREMENT if manager == "pip" else NPM_SPEC
    if grammar.fullmatch(requirement) is None:
        example = "'requests', 'requests[socks]>=2.31,<3'" if manager == "pip" else "'lodash', '@types/node@^20'"
        raise InvalidRequest(
            f"{requirement[:60]!r} is not a plain {manager} requirement: URLs, paths, VCS links, options and "
            f"markers are refused; use a name with an optional version, e.g. {example}"
        )
    if ARCHIVE_SUFFIX.search(requirement) or ARCHIVE_SUFFIX.search(_TRAILING_EXTRAS.sub("", requirement).rstrip()):
        raise InvalidRequest(
            f"{requirement[:60]!r} ends like an archive file name, which {manager} would install from a path: "
            "give the package's name and version instead"
        )
    return requirement


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


def npm_command(requirement: str, registry_url: str, cert: str | None) -> tuple[str, ...]:
    # --ignore-scripts: a package's install scripts do not run at install time.
    argv = ["npm", "install", "--prefix", NPM_PREFIX, "--no-audit", "--no-fund", "--no-update-notifier"]
    argv += ["--ignore-scripts"]
    argv += ["--registry", registry_url]
    if cert is not None:
        argv += ["--cafile", cert]
    return (*argv, "--", requirement)


CA_BUNDLE: Final = "/etc/ssl/certs/ca-certificates.crt"  # bound into every sandbox (see _spawn)
ENV: Final = "/usr/bin/env"
PIP_NO_CONFIG: Final = f"PIP_CONFIG_FILE={os.devnull}"
VENV_TIMEOUT_S: Final = 120.0


async def install(
    box: Sandbox, requirement: str, manager: Manager, config: SandboxesConfig
) -> tuple[str, CommandOutput]:
    """Install `requirement` into the sandbox's own environment; return it (checked) and the installer's output.

    Raises:
        InvalidRequest: not a plain requirement.
        PolicyDenied: the sandbox's template has a command policy.
        NotFound: npm is not installed in the sandbox.
        PathEscape: the sandbox's `.venv` is a link leaving its workspace.
        OperationFailed: the sandbox's venv could not be made.
    """
    checked = check_requirement(requirement, manager)
    workspace = box.workspace
    if not workspace.via_sh:
        raise PolicyDenied("this sandbox's template has a command policy: packages cannot be installed in it")
    registry = config.network.registry_rules
    has_venv = manager == "pip" and _has_venv(workspace.jail)  # refused before the network is widened
    async with box.network.widened(workspace, registry):
        if manager == "npm":
            npm = shutil.which("npm", path=SANDBOX_PATH)
            if npm is None:
                raise NotFound("npm is not installed in this sandbox's template")
            argv = npm_command(checked, config.npm_registry_url, _ca_bundle())
            return checked, await workspace.run_argv(npm, argv, timeout_s=None, ceiling_s=config.install_timeout_s)
        if not has_venv:
            await _make_venv(workspace)
        argv = pip_command(checked, config.pip_index_url, _ca_bundle())
        return checked, await workspace.run_argv(argv[0], argv, timeout_s=None, ceiling_s=config.install_timeout_s)


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
