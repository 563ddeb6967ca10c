"""The sandbox templates as an agent sees them: what each holds, in one line and as data.

Read from the config (and a template's Python environment's installed distributions) when the
server is built, for create_sandbox's description and the list_templates tool. Host paths never
appear: a read-only folder is named by where it shows inside, and env by its names (values may be secret).
"""

from __future__ import annotations

import glob
import importlib.metadata
import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from bastion.config import BASTION_OPT, SandboxesConfig, TemplateConfig

DEFAULT_NAME: Final = "default"
MAX_PACKAGES_READ: Final = 500  # distributions read from one environment; a bigger one is cut
MAX_PACKAGES_SHOWN: Final = 20  # names in the one-line description; list_templates has them all


@dataclass(frozen=True)
class TemplateInfo:
    """One template as an agent may ask for it."""

    name: str
    default: bool
    python_packages: tuple[tuple[str, str], ...]
    """(name, version) of the packages in its Python environment, sorted by name."""
    read_only: tuple[str, ...]
    network_allow: tuple[str, ...]
    env_names: tuple[str, ...]
    restricted_commands: bool
    limits: dict[str, float]

    def line(self) -> str:
        """One line of what it holds, e.g. "python-data (default): Python packages numpy, pandas; no network"."""
        parts = [self._python()]
        if self.read_only:
            parts.append(f"read-only {', '.join(self.read_only)}")
        parts.append(f"network: {', '.join(self.network_allow)}" if self.network_allow else "no network")
        if self.env_names:
            parts.append(f"env {', '.join(self.env_names)}")
        if self.restricted_commands:
            parts.append("a restricted command policy (explain_command tells)")
        if self.limits:
            parts.append("limits " + ", ".join(f"{key}={_amount(key, value)}" for key, value in self.limits.items()))
        mark = " (default)" if self.default else ""
        return f"{self.name}{mark}: {'; '.join(parts)}"

    def _python(self) -> str:
        if not self.python_packages:
            return "the system's Python, no extra packages"
        names = [name for name, _version in self.python_packages]
        shown = ", ".join(names[:MAX_PACKAGES_SHOWN])
        more = f" and {len(names) - MAX_PACKAGES_SHOWN} more" if len(names) > MAX_PACKAGES_SHOWN else ""
        return f"Python packages {shown}{more} (in {BASTION_OPT}/env, on PATH)"

    def as_detail(self) -> dict[str, object]:
        return {
            "name": self.name,
            "default": self.default,
            "description": self.line().split(": ", 1)[1],
            "python_packages": [{"name": name, "version": version} for name, version in self.python_packages],
            "read_only": list(self.read_only),
            "network_allow": list(self.network_allow),
            "env": list(self.env_names),
            "restricted_commands": self.restricted_commands,
            "limits": self.limits,
        }


def _amount(key: str, value: float) -> str:
    return f"{value / 2**20:g}MiB" if key.endswith("_bytes") else f"{value:g}"


def template_catalog(sandboxes: SandboxesConfig, templates: tuple[TemplateConfig, ...]) -> list[TemplateInfo]:
    """Every template create_sandbox accepts, the default first; "default" is listed when no template has its name."""
    chosen = sandboxes.default_template
    known = list(templates)
    if not any(t.name == chosen for t in known):
        known.insert(0, TemplateConfig(name=chosen))
    known.sort(key=lambda t: t.name != chosen)
    return [_info(t, t.name == chosen, sandboxes) for t in known]


def _info(template: TemplateConfig, default: bool, sandboxes: SandboxesConfig) -> TemplateInfo:
    limits = template.limits.model_dump(exclude_none=True) if template.limits else {}
    return TemplateInfo(
        name=template.name,
        default=default,
        python_packages=installed_packages(template.python_env) if template.python_env else (),
        read_only=tuple(bind.dest for bind in template.read_only),
        network_allow=template.network_allow,
        env_names=tuple(sorted({*sandboxes.env, *template.env})),
        restricted_commands=template.policy is not None,
        limits={key: float(value) for key, value in limits.items()},
    )


def installed_packages(env: Path) -> tuple[tuple[str, str], ...]:
    """(name, version) of the distributions installed in the virtual environment `env`; () if none are readable."""
    site = sorted(glob.glob(os.path.join(glob.escape(str(env)), "lib", "python3*", "site-packages")))
    found: dict[str, str] = {}
    for dist in itertools.islice(importlib.metadata.distributions(path=site), MAX_PACKAGES_READ):
        name = dist.metadata["Name"]
        if name and name.lower() not in {"pip", "setuptools", "wheel"}:
            found[name.lower()] = dist.version
    return tuple(sorted(found.items()))
