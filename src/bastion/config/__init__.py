"""The one typed model of bastion.toml, validated once at start-up.

Relative paths in the file are relative to the file's own folder. Nothing has a
silent default location: the config names every folder bastion touches, and the
loader refuses, with one line, anything that would put the audit log or the
database inside a folder an agent can write.

The sections' models live in modules beside this one: `network` (egress rules), `sandboxes`
(sandboxes and templates), `inbox` (the organizer), `http` (HTTP and OAuth) and `gateway`
(gateways and approvals), on the shared `base`. This module holds the top level, the loader and
the checks across sections, and re-exports every public name (`__all__`): import them from
`bastion.config`.
"""

from __future__ import annotations

import argparse
import os
import re
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Final, Literal
from urllib.parse import unquote, urlsplit

from pydantic import Field, PrivateAttr, ValidationError, field_validator

from bastion.config.base import ID_PATTERN, Model
from bastion.config.gateway import ApprovalsConfig as ApprovalsConfig
from bastion.config.gateway import GatewayActionConfig as GatewayActionConfig
from bastion.config.gateway import GatewayArgConfig as GatewayArgConfig
from bastion.config.gateway import GatewayConfig as GatewayConfig
from bastion.config.http import DEFAULT_APP_CALLBACKS as DEFAULT_APP_CALLBACKS
from bastion.config.http import HttpConfig as HttpConfig
from bastion.config.http import split_listen as split_listen
from bastion.config.inbox import DEFAULT_CATEGORIES as DEFAULT_CATEGORIES
from bastion.config.inbox import DEFAULT_SKIP_RULES as DEFAULT_SKIP_RULES
from bastion.config.inbox import PROTECTION_KINDS as PROTECTION_KINDS
from bastion.config.inbox import InboxConfig as InboxConfig
from bastion.config.inbox import SkipKind as SkipKind
from bastion.config.inbox import SkipRule as SkipRule
from bastion.config.metrics import MetricsConfig as MetricsConfig
from bastion.config.network import DEFAULT_BLOCKED_RANGES as DEFAULT_BLOCKED_RANGES
from bastion.config.network import DEFAULT_BYTE_BURST as DEFAULT_BYTE_BURST
from bastion.config.network import DEFAULT_BYTES_PER_S as DEFAULT_BYTES_PER_S
from bastion.config.network import DEFAULT_PORTS as DEFAULT_PORTS
from bastion.config.network import DEFAULT_REGISTRY as DEFAULT_REGISTRY
from bastion.config.network import MAX_ALLOW_RULES as MAX_ALLOW_RULES
from bastion.config.network import AllowRule as AllowRule
from bastion.config.network import NetworkConfig as NetworkConfig
from bastion.config.network import narrow_allow as narrow_allow
from bastion.config.network import normalize_host as normalize_host
from bastion.config.network import parse_allow_rule as parse_allow_rule
from bastion.config.network import parse_allow_rules as parse_allow_rules
from bastion.config.sandboxes import BASTION_OPT as BASTION_OPT
from bastion.config.sandboxes import MicroVMConfig as MicroVMConfig
from bastion.config.sandboxes import ReadOnlyBind as ReadOnlyBind
from bastion.config.sandboxes import SandboxesConfig as SandboxesConfig
from bastion.config.sandboxes import SandboxLimitsConfig as SandboxLimitsConfig
from bastion.config.sandboxes import TemplateConfig as TemplateConfig
from bastion.config.sandboxes import TemplateLimitsConfig as TemplateLimitsConfig
from bastion.config.sandboxes import python_env_problem, unfinished_env_problem
from bastion.config.terminals import TerminalsConfig as TerminalsConfig
from bastion.safety.commands import CommandPolicyConfig
from bastion.safety.environment import checked_env
from bastion.safety.errors import ConfigError, PolicyDenied
from bastion.safety.paths import DEFAULT_SECRET_PATTERNS, mode_readers, replaceable_by, writers_besides

__all__ = [
    "ADMIN_HASH_NAME",
    "AUDIT_NAME",
    "BASTION_OPT",
    "CONFIG_ENV",
    "DB_NAME",
    "DEFAULT_APP_CALLBACKS",
    "DEFAULT_BLOCKED_RANGES",
    "DEFAULT_BYTES_PER_S",
    "DEFAULT_BYTE_BURST",
    "DEFAULT_CATEGORIES",
    "DEFAULT_PORTS",
    "DEFAULT_REGISTRY",
    "DEFAULT_SKIP_RULES",
    "MAX_ALLOW_RULES",
    "PROTECTION_KINDS",
    "SANDBOX_ID_PREFIX",
    "AllowRule",
    "ApprovalsConfig",
    "AuditConfig",
    "Config",
    "ConfigFile",
    "GatewayActionConfig",
    "GatewayArgConfig",
    "GatewayConfig",
    "HttpConfig",
    "InboxConfig",
    "LimitsConfig",
    "MetricsConfig",
    "MicroVMConfig",
    "NetworkConfig",
    "ReadOnlyBind",
    "RedactionConfig",
    "SandboxLimitsConfig",
    "SandboxesConfig",
    "SkipKind",
    "SkipRule",
    "TemplateConfig",
    "TemplateLimitsConfig",
    "TerminalsConfig",
    "WorkspaceConfig",
    "add_config_option",
    "load_config",
    "narrow_allow",
    "normalize_host",
    "parse_allow_rule",
    "parse_allow_rules",
    "resolve_config_path",
    "split_listen",
]

CONFIG_ENV: Final = "BASTION_CONFIG"
DB_NAME: Final = "bastion.db"
AUDIT_NAME: Final = "audit.jsonl"
ADMIN_HASH_NAME: Final = "admin-password.argon2"
SANDBOX_ID_PREFIX: Final = "sb-"


class AuditConfig(Model):
    path: Path | None = None
    """Default: `<state_dir>/audit.jsonl`."""
    fail_closed: bool = True
    """If false, a failed audit write only logs a warning. Dangerous: operations then run unrecorded."""
    rotate_bytes: Annotated[int, Field(ge=4096)] = 64 * 1024 * 1024
    reserve_bytes: Annotated[int, Field(ge=0)] = 8 * 1024 * 1024
    """Kept allocated past the log's end: records have room for a while after the state filesystem fills."""
    caller_bytes_per_s: Annotated[int, Field(ge=1024)] = 256 * 1024
    """What one caller's tool calls may add to the log a second (stdio's client; over HTTP, each OAuth client)."""
    caller_burst_bytes: Annotated[int, Field(ge=256 * 1024)] = 64 * 1024 * 1024
    """What one caller may add at once, before `caller_bytes_per_s` holds it back (a mutating call holds two
    records' most, 128 KiB, while it runs)."""


class RedactionConfig(Model):
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


class LimitsConfig(Model):
    """cgroup limits of a workspace's sandbox: all its commands together."""

    memory_bytes: Annotated[int, Field(ge=16 * 1024 * 1024)] = 1024 * 1024 * 1024
    pids: Annotated[int, Field(ge=8, le=1_000_000)] = 256
    cpu_cores: Annotated[float, Field(gt=0, le=1024)] = 1.0


class WorkspaceConfig(Model):
    id: Annotated[str, Field(pattern=ID_PATTERN)]
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
    protect_git: bool = True
    """The folder's `.git` is read-only to its commands and refused to the file tools. Dangerous when false: git
    runs the hooks and config programs an agent writes there as whoever next runs git in the folder."""
    terminals: TerminalsConfig = TerminalsConfig()

    @field_validator("env")
    @classmethod
    def _check_env(cls, env: dict[str, str]) -> dict[str, str]:
        return checked_env(env)

    @field_validator("id")
    @classmethod
    def _check_id(cls, value: str) -> str:
        if value.startswith(SANDBOX_ID_PREFIX):
            raise ValueError(f"workspace id {value!r} starts with {SANDBOX_ID_PREFIX!r}, which names sandboxes")
        return value


@dataclass(frozen=True)
class ConfigFile:
    """The file a `Config` was loaded from, as it was when read (for `Config.exposed_secrets`)."""

    path: Path
    mode: int
    gid: int


class Config(Model):
    state_dir: Path
    default_workspace: str
    audit: AuditConfig = AuditConfig()
    redaction: RedactionConfig = RedactionConfig()
    workspace: tuple[WorkspaceConfig, ...] = ()
    inbox: tuple[InboxConfig, ...] = ()
    sandboxes: SandboxesConfig = SandboxesConfig()
    template: tuple[TemplateConfig, ...] = ()
    http: HttpConfig = HttpConfig()
    gateway: tuple[GatewayConfig, ...] = ()
    approvals: ApprovalsConfig = ApprovalsConfig()
    metrics: MetricsConfig = MetricsConfig()

    def gateway_by_name(self, name: str) -> GatewayConfig | None:
        return next((g for g in self.gateway if g.name == name), None)

    def template_by_name(self, name: str) -> TemplateConfig | None:
        return next((t for t in self.template if t.name == name), None)

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "WARNING"
    log_format: Literal["text", "json"] = "text"
    """The server log on stderr: escaped text lines, or one JSON object a line; `--log-format` overrides it."""
    _file: ConfigFile | None = PrivateAttr(default=None)
    """Set by `load_config` (never from the TOML: a private attribute is no key)."""

    @property
    def audit_path(self) -> Path:
        return self.audit.path if self.audit.path is not None else self.state_dir / AUDIT_NAME

    @property
    def db_path(self) -> Path:
        return self.state_dir / DB_NAME

    def workspace_by_id(self, workspace_id: str) -> WorkspaceConfig | None:
        return next((ws for ws in self.workspace if ws.id == workspace_id), None)

    def secret_values(self) -> tuple[str, ...]:
        """What output and audit records are redacted of: env values, and a package index URL's credentials."""
        values = [value for ws in self.workspace for value in ws.env.values()]
        values += self.sandboxes.env.values()
        values += [value for template in self.template for value in template.env.values()]
        for url in (self.sandboxes.pip_index_url, self.sandboxes.npm_registry_url):
            values += url_credentials(url)
        return tuple(value for value in values if value)

    @property
    def file(self) -> ConfigFile | None:
        """The file this config was loaded from (None when built otherwise)."""
        return self._file

    def exposed_secrets(self) -> str | None:
        """A one-line warning when the file this config came from holds secret values and users besides its
        owner may read it, or None. Best effort: judged by the file's mode bits when it was read (an ACL
        entry is seen only through the group bits it widens)."""
        if self._file is None or not self.secret_values():
            return None
        readers = mode_readers(self._file.mode, self._file.gid, os.geteuid())
        if readers is None:
            return None
        return (
            f"config file {self._file.path} holds secret values (env, a package index URL's password) and "
            f"{readers} may read it: chmod 600 it"
        )

    @property
    def sandboxes_dir(self) -> Path:
        return self.state_dir / "sandboxes"

    @property
    def admin_hash_path(self) -> Path:
        """The administrator's argon2id password hash: under the state folder, never in the config file."""
        return self.state_dir / ADMIN_HASH_NAME


def url_credentials(url: str) -> list[str]:
    """The userinfo of `url` (``user:token``), its password, and the password %-decoded, when it has any."""
    netloc = urlsplit(url).netloc
    userinfo, at, _ = netloc.rpartition("@")
    if not at:
        return []
    password = userinfo.partition(":")[2]
    return [userinfo, password, unquote(password), unquote(userinfo)]


def _absolute(base: Path, path: Path) -> Path:
    return Path(os.path.normpath(base / path.expanduser() if not path.is_absolute() else path))


def _resolve_paths(raw: Config, base: Path) -> Config:
    workspaces = tuple(ws.model_copy(update={"path": _absolute(base, ws.path)}) for ws in raw.workspace)
    inboxes = tuple(ib.model_copy(update={"path": _absolute(base, ib.path)}) for ib in raw.inbox)
    templates = tuple(
        t.model_copy(
            update={
                "read_only": tuple(b.model_copy(update={"source": _absolute(base, b.source)}) for b in t.read_only),
                "python_env": _absolute(base, t.python_env) if t.python_env is not None else None,
                "python_lock": _absolute(base, t.python_lock) if t.python_lock is not None else None,
            }
        )
        for t in raw.template
    )
    audit = raw.audit
    if audit.path is not None:
        audit = audit.model_copy(update={"path": _absolute(base, audit.path)})
    http = raw.http.model_copy(
        update={
            key: _absolute(base, value)
            for key, value in (("tls_cert", raw.http.tls_cert), ("tls_key", raw.http.tls_key))
            if value is not None
        }
    )
    gateways = tuple(g.model_copy(update={"key_path": _absolute(base, g.key_path)}) for g in raw.gateway)
    metrics = raw.metrics
    if metrics.token_file is not None:
        metrics = metrics.model_copy(update={"token_file": _absolute(base, metrics.token_file)})
    return raw.model_copy(
        update={
            "metrics": metrics,
            "gateway": gateways,
            "state_dir": _real_state_dir(_absolute(base, raw.state_dir)),
            "workspace": workspaces,
            "inbox": inboxes,
            "audit": audit,
            "template": templates,
            "http": http,
        }
    )


def _real_state_dir(configured: Path) -> Path:
    """`configured`, which must be its own real path: the state folder is judged, and then opened beneath with
    no link allowed, by that path. Found by attack: resolved here, a link another user planted on the way (in
    a sticky /tmp) was judged by its target, and root took any folder of its as its state (chmod 0711, its
    files, its mounts)."""
    real = Path(os.path.realpath(configured))
    if real != configured:
        raise ConfigError(
            f"state_dir {configured} goes through a symbolic link (to {real}): give its real path, so that no "
            "one who may change a link on the way can move the server's state"
        )
    return real


def _inside(child: Path, parent: Path) -> bool:
    child_real, parent_real = Path(os.path.realpath(child)), Path(os.path.realpath(parent))
    return child_real == parent_real or parent_real in child_real.parents


def _check_semantics(config: Config, *, envs_built: bool) -> None:
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
        if real != folder_path:
            # Another user who owns a component could point it elsewhere (/etc) before a restart.
            raise ConfigError(
                f"{kind} {folder_id!r} root {folder_path} goes through a symbolic link (it leads to {real}): "
                "configure the real path"
            )
        if real in (Path("/"), home):
            raise ConfigError(f"{kind} {folder_id!r} root {real} is / or the home folder: use a dedicated folder")
        for name, guarded in (("audit log", config.audit_path), ("database", config.db_path)):
            if _inside(guarded, folder_path):
                raise ConfigError(
                    f"{name} {guarded} is inside {kind} {folder_id!r} ({folder_path}): move it out of the {kind}"
                )
    _check_apart(config, folders)
    _check_templates(config, home, envs_built=envs_built)
    _check_gateways(config, folders)
    for ws in config.workspace:
        if not ws.policy.allow and not ws.policy.deny:
            raise ConfigError(f"workspace {ws.id!r} policy has neither allow nor deny: list the commands it may run")


def _overlap(first: Path, second: Path) -> bool:
    return _inside(first, second) or _inside(second, first)


def _check_apart(config: Config, folders: list[tuple[str, str, Path]]) -> None:
    """Agents' folders stay out of the state folder, and inboxes out of every other agent's folder.

    The state folder holds the database, the audit log, sandboxes' disks, gateway keys and the
    administrator's password hash: a workspace over any of it would let an agent's commands and
    file tools read or change them.
    """
    for kind, folder_id, path in folders:
        if _overlap(path, config.state_dir):
            raise ConfigError(
                f"{kind} {folder_id!r} ({path}) and the state folder {config.state_dir} overlap: "
                f"change the {kind}'s path or state_dir to keep them apart"
            )
    for index, ib in enumerate(config.inbox):
        for ws in config.workspace:
            # An agent's commands would move files under the organizer's journal, or it theirs.
            if _overlap(ib.path, ws.path):
                raise ConfigError(
                    f"inbox {ib.id!r} ({ib.path}) and workspace {ws.id!r} ({ws.path}) overlap: "
                    "change one of their paths to keep them apart"
                )
        for other in config.inbox[index + 1 :]:
            # Two journals over one tree could each move the other's files: one folder, one organizer.
            if _overlap(ib.path, other.path):
                raise ConfigError(f"inboxes {ib.id!r} and {other.id!r} overlap: give each its own folder")


def _check_gateway_tool_names(gateway: GatewayConfig, tools: dict[str, str]) -> None:
    """Each gateway's tools (`<gateway>_actions`, `<gateway>_<action>`) named once across all gateways, in
    `tools` (name -> what makes it): found by attack, gateway "a_b" action "c" and gateway "a" action "b_c"
    made one tool whose scope was the last one's, a deploy's reachable with gateway:read."""
    made = [(f"{gateway.name}_actions", f"gateway {gateway.name!r} (its list of actions)")]
    made += [(f"{gateway.name}_{a.name}", f"gateway {gateway.name!r} action {a.name!r}") for a in gateway.action]
    for name, what in made:
        if name in tools:
            raise ConfigError(f"{tools[name]} and {what} both make the tool {name!r}: rename one of them")
        tools[name] = what


def _check_gateways(config: Config, folders: list[tuple[str, str, Path]]) -> None:
    names = [g.name for g in config.gateway]
    if len(set(names)) != len(names):
        raise ConfigError("two [[gateway]] entries share a name: give each a unique name")
    tools: dict[str, str] = {}
    for gateway in config.gateway:
        actions = [a.name for a in gateway.action]
        if len(set(actions)) != len(actions):
            raise ConfigError(f"gateway {gateway.name!r} lists an action twice: give each a unique name")
        _check_gateway_tool_names(gateway, tools)
        for kind, folder_id, folder_path in folders:
            if _inside(gateway.key_path, folder_path):
                raise ConfigError(
                    f"gateway {gateway.name!r} key {gateway.key_path} is inside {kind} {folder_id!r}: "
                    "an agent could read it; move it (e.g. under the state folder)"
                )


def _check_templates(config: Config, home: Path, *, envs_built: bool) -> None:
    names = [t.name for t in config.template]
    if len(set(names)) != len(names):
        raise ConfigError("two [[template]] entries share a name: give each a unique name")
    ceiling = config.sandboxes.limits
    allow = config.sandboxes.network.allow_rules
    for template in config.template:
        for rule in template.network_allow:
            try:
                narrow_allow(allow, [rule])
            except PolicyDenied:
                raise ConfigError(
                    f"template {template.name!r} network_allow {rule!r} is outside [sandboxes.network] allow: widen it"
                ) from None
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
        if template.python_env is not None:
            where = f"template {template.name!r} python_env {template.python_env}"
            if envs_built and not _is_venv(template.python_env):
                raise ConfigError(
                    f"{where} is not a virtual environment: build it "
                    f"('bastion template build {template.name} --config CONFIG')"
                )
            real = template.python_env.resolve()
            if real in (Path("/"), home) or _inside(config.state_dir, real) or _inside(real, config.state_dir):
                raise ConfigError(f"{where} is /, the home folder, or overlaps the state folder: use its own folder")
        _check_agent_writable(config, template)
        if envs_built and template.python_env is not None:
            env = template.python_env
            problem = unfinished_env_problem(template.name, env) or python_env_problem(template.name, env)
            if problem is not None:
                raise ConfigError(problem)
    default = config.sandboxes.default_template
    if default != "default" and default not in names:
        raise ConfigError(f"[sandboxes] default_template {default!r} is not a [[template]] name: add it or fix it")


def _check_agent_writable(config: Config, template: TemplateConfig) -> None:
    """A template's venv and lock stay out of the folders agents write: what every sandbox of the
    template imports would be theirs, and `template build` runs the venv's python and pip on the host."""
    named = {"python_env": template.python_env, "python_lock": template.python_lock}
    folders = [("workspace", ws.id, ws.path) for ws in config.workspace]
    folders += [("inbox", ib.id, ib.path) for ib in config.inbox]
    for key, path in named.items():
        if path is None:
            continue
        for kind, folder_id, folder in folders:
            if _inside(path, folder) or _inside(folder, path):
                raise ConfigError(
                    f"template {template.name!r} {key} {path} overlaps {kind} {folder_id!r}, which agents write: "
                    "move it to a folder of its own"
                )


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(part) for part in err["loc"]) or "(top level)"
    if err["type"] == "extra_forbidden":
        return f"unknown key {where!r}: remove it or check its spelling"
    if err["type"] == "missing":
        return f"missing key {where!r}: add it"
    return f"{where}: {err['msg']}"


def _is_venv(path: Path) -> bool:
    return (path / "pyvenv.cfg").is_file() and (path / "bin").is_dir()


def load_config(path: str | os.PathLike[str], *, envs_built: bool = True) -> Config:
    """Read, validate and resolve a bastion.toml.

    `envs_built=False` lets a template's python_env be missing or not yet a venv: `bastion template build`
    loads the config so, to make it (and checks the folder itself).

    Raises:
        ConfigError: with one line saying what is wrong and what to do.
    """
    file = Path(path)
    text, info = _read_config_file(file)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {file} is not valid TOML: {exc}") from None
    try:
        raw = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"config file {file}: {_first_error(exc)}") from None
    config = _resolve_paths(raw, file.resolve().parent)
    _check_semantics(config, envs_built=envs_built)
    config._file = ConfigFile(path=Path(os.path.abspath(file)), mode=info.st_mode, gid=info.st_gid)
    return config


def _read_config_file(file: Path) -> tuple[str, os.stat_result]:
    """The file's text and what fstat says of it; as root, only a file no one else could write or replace.

    Raises:
        ConfigError: it does not exist, cannot be read, is not UTF-8, or (as root) is unsafe.
    """
    try:
        # O_NONBLOCK: a FIFO planted at the path must not hang the open; reads block again below.
        fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ConfigError(f"config file {file} does not exist: run 'bastion init DIR' or fix the path") from None
    except OSError as exc:
        raise ConfigError(f"config file {file} cannot be read: {exc}") from None
    with open(fd, "rb") as handle:
        info = os.fstat(fd)
        if os.geteuid() == 0:
            _refuse_unsafe_for_root(file, info)
        try:
            os.set_blocking(fd, True)
            return handle.read().decode("utf-8"), info
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {file} cannot be read: {exc}") from None


def _refuse_unsafe_for_root(file: Path, info: os.stat_result) -> None:
    """Refuse a config another user could write or replace: root would run what they wrote (which
    folders it serves, mounts and chowns, which commands workspaces allow).

    The opened file is the one judged (fstat), and the folders above its real path; a link on the way
    to it is read through once, as it points now.
    """
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"config file {file} is not a regular file: as root, give the path of a plain file")
    if info.st_uid != 0:
        raise ConfigError(
            f"config file {file} is owned by uid {info.st_uid}, who could change what root serves: "
            "chown it to root (or run bastion as that user)"
        )
    real = os.path.realpath(file)
    try:
        seen = os.lstat(real)
        writers = writers_besides(real, (0, 0))
        who = replaceable_by(real, (0, 0))
    except OSError as exc:
        raise ConfigError(f"config file {file} cannot be examined ({exc.strerror or exc}): fix its path") from None
    if (seen.st_dev, seen.st_ino) != (info.st_dev, info.st_ino):
        raise ConfigError(f"config file {file} changed while it was read: check who can change {real}")
    if writers is not None:
        raise ConfigError(f"config file {file} may be written by {writers}: chmod go-w it")
    if who is not None:
        raise ConfigError(
            f"config file {file} could be replaced by {who}: keep it in a folder only root can write (/etc/bastion)"
        )


def add_config_option(parser: argparse.ArgumentParser) -> None:
    """`--config PATH` on a subcommand. Suppressed when absent, so that a `--config` given before
    the subcommand (`bastion --config X approvals list`) is not overwritten by this one's default."""
    parser.add_argument("--config", default=argparse.SUPPRESS, help=f"path to bastion.toml (or set {CONFIG_ENV})")


def resolve_config_path(cli_value: str | None) -> str:
    """`--config` wins, then $BASTION_CONFIG; with neither, refuse (never a silent default)."""
    value = cli_value or os.environ.get(CONFIG_ENV)
    if not value:
        raise ConfigError(
            f"no config given: pass --config PATH or set {CONFIG_ENV} (create one with 'bastion init DIR')"
        )
    return value
