"""The one typed model of bastion.toml, validated once at start-up.

Relative paths in the file are relative to the file's own folder. Nothing has a
silent default location: the config names every folder bastion touches, and the
loader refuses, with one line, anything that would put the audit log or the
database inside a folder an agent can write.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from bastion.safety.commands import CommandPolicyConfig
from bastion.safety.errors import ConfigError
from bastion.safety.paths import DEFAULT_SECRET_PATTERNS

CONFIG_ENV: Final = "BASTION_CONFIG"
DB_NAME: Final = "bastion.db"
AUDIT_NAME: Final = "audit.jsonl"
_ID_PATTERN: Final = r"^[a-z][a-z0-9_-]{0,31}$"
_ENV_NAME: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Variables that change how a program loads code; never settable through config.
_FORBIDDEN_ENV_PREFIXES: Final = ("LD_", "GIT_", "PYTHON", "NODE_", "PERL", "RUBY", "BASH_", "DYLD_")
_FIXED_ENV: Final = frozenset({"PATH", "HOME", "LANG"})
SANDBOX_ID_PREFIX: Final = "sb-"
_RESERVED_DESTS: Final = frozenset(
    {"/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/proc", "/dev", "/tmp", "/workspace"}  # noqa: S108
)


def _checked_env(env: dict[str, str]) -> dict[str, str]:
    for name in env:
        if not _ENV_NAME.match(name):
            raise ValueError(f"environment variable name {name!r} is not valid")
        if name in _FIXED_ENV or name.upper().startswith(_FORBIDDEN_ENV_PREFIXES):
            raise ValueError(f"environment variable {name!r} may not be set from config")
    return env


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class AuditConfig(_Model):
    path: Path | None = None
    """Default: `<state_dir>/audit.jsonl`."""
    fail_closed: bool = True
    """If false, a failed audit write only logs a warning. Dangerous: operations then run unrecorded."""
    rotate_bytes: Annotated[int, Field(ge=4096)] = 64 * 1024 * 1024


class RedactionConfig(_Model):
    patterns: tuple[str, ...] = ()
    """Extra regular expressions whose matches are replaced in every output and audit record."""

    @field_validator("patterns")
    @classmethod
    def _check_patterns(cls, patterns: tuple[str, ...]) -> tuple[str, ...]:
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"redaction pattern {pattern!r} is not a valid regex: {exc}") from None
        return patterns


class LimitsConfig(_Model):
    """cgroup limits of a workspace's sandbox: all its commands together."""

    memory_bytes: Annotated[int, Field(ge=16 * 1024 * 1024)] = 1024 * 1024 * 1024
    pids: Annotated[int, Field(ge=8, le=1_000_000)] = 256
    cpu_cores: Annotated[float, Field(gt=0, le=1024)] = 1.0


class WorkspaceConfig(_Model):
    id: Annotated[str, Field(pattern=_ID_PATTERN)]
    path: Path
    policy: CommandPolicyConfig
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables for commands. Values are redacted from output."""
    timeout_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    max_output_bytes: Annotated[int, Field(ge=1024, le=16 * 1024 * 1024)] = 65_536
    secret_files: tuple[str, ...] = DEFAULT_SECRET_PATTERNS
    """Name patterns the file tools refuse to read or write (fnmatch, case-insensitive)."""
    allow_hardlinks: bool = False
    """Dangerous: allows reading files with several hard links, one of which may be outside the workspace."""
    limits: LimitsConfig = LimitsConfig()
    use_cgroups: bool = True
    """Dangerous when false: commands then run without memory, pids and CPU limits."""

    @field_validator("env")
    @classmethod
    def _check_env(cls, env: dict[str, str]) -> dict[str, str]:
        return _checked_env(env)

    @field_validator("id")
    @classmethod
    def _check_id(cls, value: str) -> str:
        if value.startswith(SANDBOX_ID_PREFIX):
            raise ValueError(f"workspace id {value!r} starts with {SANDBOX_ID_PREFIX!r}, which names sandboxes")
        return value


class SandboxLimitsConfig(_Model):
    """The administrator's ceiling for each sandbox, and its default; create_sandbox may only narrow it."""

    memory_bytes: Annotated[int, Field(ge=16 * 1024 * 1024)] = 1024 * 1024 * 1024
    pids: Annotated[int, Field(ge=8, le=1_000_000)] = 256
    cpu_cores: Annotated[float, Field(gt=0, le=1024)] = 1.0
    timeout_s: Annotated[float, Field(gt=0, le=3600)] = 60.0
    max_output_bytes: Annotated[int, Field(ge=1024, le=16 * 1024 * 1024)] = 65_536
    disk_bytes: Annotated[int, Field(ge=16 * 1024 * 1024, le=1024**4)] = 2 * 1024**3
    """Size of /workspace: writes past it fail with ENOSPC inside (when disk_quota is on)."""


class TemplateLimitsConfig(_Model):
    """A template's defaults; each one it sets must be within [sandboxes.limits], the rest are the ceiling's."""

    memory_bytes: Annotated[int, Field(ge=16 * 1024 * 1024)] | None = None
    pids: Annotated[int, Field(ge=8, le=1_000_000)] | None = None
    cpu_cores: Annotated[float, Field(gt=0, le=1024)] | None = None
    timeout_s: Annotated[float, Field(gt=0, le=3600)] | None = None
    max_output_bytes: Annotated[int, Field(ge=1024, le=16 * 1024 * 1024)] | None = None
    disk_bytes: Annotated[int, Field(ge=16 * 1024 * 1024, le=1024**4)] | None = None


class ReadOnlyBind(_Model):
    source: Path
    """A host folder, shown read-only inside the sandbox."""
    dest: str
    """Where it appears inside, e.g. /data. Not a system folder, /workspace or /tmp."""

    @field_validator("dest")
    @classmethod
    def _check_dest(cls, dest: str) -> str:
        normal = os.path.normpath(dest)
        if not normal.startswith("/") or normal != dest.rstrip("/") or dest == "/":
            raise ValueError(f"dest {dest!r} must be an absolute, normalized path such as /data")
        top = "/" + normal.split("/")[1]
        if top in _RESERVED_DESTS:
            raise ValueError(f"dest {dest!r} would shadow {top}: choose a new top-level folder such as /data")
        return normal


class TemplateConfig(_Model):
    """A kind of sandbox an agent may ask for by name."""

    name: Annotated[str, Field(pattern=_ID_PATTERN)]
    read_only: tuple[ReadOnlyBind, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)
    limits: TemplateLimitsConfig | None = None
    """Defaults for this template; each must be within [sandboxes.limits]. Absent: the ceiling."""
    policy: CommandPolicyConfig | None = None
    """A stricter command policy; absent: any shell command (the kernel is the boundary)."""

    @field_validator("env")
    @classmethod
    def _check_env(cls, env: dict[str, str]) -> dict[str, str]:
        return _checked_env(env)


class SandboxesConfig(_Model):
    """Agent-created sandboxes: fresh workspaces under `<state_dir>/sandboxes/`."""

    enabled: bool = True
    max_sandboxes: Annotated[int, Field(ge=0, le=10_000)] = 16
    idle_timeout_s: Annotated[float, Field(gt=0)] = 1800.0
    lifetime_s: Annotated[float, Field(gt=0)] = 86_400.0
    reap_interval_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    disk_quota: bool = True
    """Give each sandbox's /workspace its own filesystem of `limits.disk_bytes` (needs root).
    False (dangerous: one sandbox can fill the state folder's disk) keeps workspaces as plain folders."""
    orphan_retention_s: Annotated[float, Field(gt=0)] = 7 * 86_400.0
    """How long the workspaces of sandboxes left by a crashed server are kept, as snapshots."""
    warm_pool: Annotated[int, Field(ge=0, le=64)] = 1
    """Sandboxes started ahead of time, so create_sandbox does not wait for one to boot."""
    limits: SandboxLimitsConfig = SandboxLimitsConfig()
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment for sandbox commands. Values are redacted from output."""

    @field_validator("env")
    @classmethod
    def _check_env(cls, env: dict[str, str]) -> dict[str, str]:
        return _checked_env(env)


class InboxConfig(_Model):
    id: Annotated[str, Field(pattern=_ID_PATTERN)]
    path: Path


class Config(_Model):
    state_dir: Path
    default_workspace: str
    audit: AuditConfig = AuditConfig()
    redaction: RedactionConfig = RedactionConfig()
    workspace: tuple[WorkspaceConfig, ...] = ()
    inbox: tuple[InboxConfig, ...] = ()
    sandboxes: SandboxesConfig = SandboxesConfig()
    template: tuple[TemplateConfig, ...] = ()

    def template_by_name(self, name: str) -> TemplateConfig | None:
        return next((t for t in self.template if t.name == name), None)

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "WARNING"

    @property
    def audit_path(self) -> Path:
        return self.audit.path if self.audit.path is not None else self.state_dir / AUDIT_NAME

    @property
    def db_path(self) -> Path:
        return self.state_dir / DB_NAME

    def workspace_by_id(self, workspace_id: str) -> WorkspaceConfig | None:
        return next((ws for ws in self.workspace if ws.id == workspace_id), None)

    def secret_values(self) -> tuple[str, ...]:
        values = [value for ws in self.workspace for value in ws.env.values()]
        values += self.sandboxes.env.values()
        values += [value for template in self.template for value in template.env.values()]
        return tuple(value for value in values if value)

    @property
    def sandboxes_dir(self) -> Path:
        return self.state_dir / "sandboxes"


def _absolute(base: Path, path: Path) -> Path:
    return Path(os.path.normpath(base / path.expanduser() if not path.is_absolute() else path))


def _resolve_paths(raw: Config, base: Path) -> Config:
    workspaces = tuple(ws.model_copy(update={"path": _absolute(base, ws.path)}) for ws in raw.workspace)
    inboxes = tuple(ib.model_copy(update={"path": _absolute(base, ib.path)}) for ib in raw.inbox)
    templates = tuple(
        t.model_copy(
            update={"read_only": tuple(b.model_copy(update={"source": _absolute(base, b.source)}) for b in t.read_only)}
        )
        for t in raw.template
    )
    audit = raw.audit
    if audit.path is not None:
        audit = audit.model_copy(update={"path": _absolute(base, audit.path)})
    return raw.model_copy(
        update={
            "state_dir": _absolute(base, raw.state_dir),
            "workspace": workspaces,
            "inbox": inboxes,
            "audit": audit,
            "template": templates,
        }
    )


def _inside(child: Path, parent: Path) -> bool:
    child_real, parent_real = Path(os.path.realpath(child)), Path(os.path.realpath(parent))
    return child_real == parent_real or parent_real in child_real.parents


def _check_semantics(config: Config) -> None:
    ids = [ws.id for ws in config.workspace] + [ib.id for ib in config.inbox]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ConfigError(f"workspace/inbox id {duplicates[0]!r} is used twice: give each a unique id")
    if config.workspace_by_id(config.default_workspace) is None:
        raise ConfigError(f"default_workspace {config.default_workspace!r} names no [[workspace]]: fix the id")
    home = Path(os.path.expanduser("~")).resolve()
    folders: list[tuple[str, str, Path]] = [("workspace", ws.id, ws.path) for ws in config.workspace]
    folders += [("inbox", ib.id, ib.path) for ib in config.inbox]
    for kind, folder_id, folder_path in folders:
        if not folder_path.exists():
            raise ConfigError(f"{kind} {folder_id!r} root {folder_path} does not exist: create it or fix the path")
        if not folder_path.is_dir():
            raise ConfigError(f"{kind} {folder_id!r} root {folder_path} is not a directory: point it at a folder")
        real = folder_path.resolve()
        if real in (Path("/"), home):
            raise ConfigError(f"{kind} {folder_id!r} root {real} is / or the home folder: use a dedicated folder")
        for name, guarded in (("audit log", config.audit_path), ("database", config.db_path)):
            if _inside(guarded, folder_path):
                raise ConfigError(
                    f"{name} {guarded} is inside {kind} {folder_id!r} ({folder_path}): move it out of the {kind}"
                )
    _check_templates(config, home)
    for ws in config.workspace:
        if not ws.policy.allow and not ws.policy.deny:
            raise ConfigError(f"workspace {ws.id!r} policy has neither allow nor deny: list the commands it may run")


def _check_templates(config: Config, home: Path) -> None:
    names = [t.name for t in config.template]
    if len(set(names)) != len(names):
        raise ConfigError("two [[template]] entries share a name: give each a unique name")
    ceiling = config.sandboxes.limits
    for template in config.template:
        if template.limits is not None:
            for key, value in template.limits.model_dump(exclude_none=True).items():
                if value > getattr(ceiling, key):
                    raise ConfigError(
                        f"template {template.name!r} limit {key}={value} is above [sandboxes.limits]: lower it"
                    )
        for bind in template.read_only:
            where = f"template {template.name!r} read_only {bind.source}"
            if not bind.source.is_dir():
                raise ConfigError(f"{where} is not an existing folder: create it or fix the path")
            real = bind.source.resolve()
            if real in (Path("/"), home) or _inside(config.state_dir, real) or _inside(real, config.state_dir):
                raise ConfigError(f"{where} is /, the home folder, or overlaps the state folder: bind a data folder")


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(part) for part in err["loc"]) or "(top level)"
    if err["type"] == "extra_forbidden":
        return f"unknown key {where!r}: remove it or check its spelling"
    if err["type"] == "missing":
        return f"missing key {where!r}: add it"
    return f"{where}: {err['msg']}"


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read, validate and resolve a bastion.toml.

    Raises:
        ConfigError: with one line saying what is wrong and what to do.
    """
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {file} does not exist: run 'bastion init DIR' or fix the path") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {file} cannot be read: {exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {file} is not valid TOML: {exc}") from None
    try:
        raw = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"config file {file}: {_first_error(exc)}") from None
    config = _resolve_paths(raw, file.resolve().parent)
    _check_semantics(config)
    return config


def resolve_config_path(cli_value: str | None) -> str:
    """`--config` wins, then $BASTION_CONFIG; with neither, refuse (never a silent default)."""
    value = cli_value or os.environ.get(CONFIG_ENV)
    if not value:
        raise ConfigError(
            f"no config given: pass --config PATH or set {CONFIG_ENV} (create one with 'bastion init DIR')"
        )
    return value
