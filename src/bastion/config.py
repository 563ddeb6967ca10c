"""The one typed model of bastion.toml, validated once at start-up.

Relative paths in the file are relative to the file's own folder. Nothing has a
silent default location: the config names every folder bastion touches, and the
loader refuses, with one line, anything that would put the audit log or the
database inside a folder an agent can write.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Final, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from bastion.safety.commands import CommandPolicyConfig
from bastion.safety.errors import ConfigError, InvalidRequest, PolicyDenied
from bastion.safety.paths import DEFAULT_SECRET_PATTERNS, name_problem

CONFIG_ENV: Final = "BASTION_CONFIG"
DB_NAME: Final = "bastion.db"
AUDIT_NAME: Final = "audit.jsonl"
ADMIN_HASH_NAME: Final = "admin-password.argon2"
_ID_PATTERN: Final = r"^[a-z][a-z0-9_-]{0,31}$"
_ENV_NAME: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Variables that change how a program loads code; never settable through config.
_FORBIDDEN_ENV_PREFIXES: Final = ("LD_", "GIT_", "PYTHON", "NODE_", "PERL", "RUBY", "BASH_", "DYLD_")
_FIXED_ENV: Final = frozenset({"PATH", "HOME", "LANG"})
SANDBOX_ID_PREFIX: Final = "sb-"
BASTION_OPT: Final = "/opt/bastion"  # inside a sandbox: a template's python_env is bound at <this>/env
_RESERVED_DESTS: Final = frozenset(
    {"/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/proc", "/dev", "/tmp", "/workspace"}  # noqa: S108
)


def _checked_env(env: dict[str, str]) -> dict[str, str]:
    for name in env:
        if not _ENV_NAME.fullmatch(name):
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
        if normal == "/opt" or normal.startswith(BASTION_OPT):
            raise ValueError(f"dest {dest!r} would shadow {BASTION_OPT}, bastion's own: choose another folder")
        return normal


# -- network egress (issue #4) ---------------------------------------------------

# Ranges the egress proxy never connects to, whatever name led there (DNS rebinding).
# An explicit list on purpose, not "not is_global": the documentation ranges
# (192.0.2.0/24, 198.51.100.0/24, 203.0.113.0/24) hold real registry addresses on some
# CI machines. Sources: RFC 6890 (special-purpose registries), RFC 6598, RFC 6052.
DEFAULT_BLOCKED_RANGES: Final = (
    "0.0.0.0/8",  # "this network": 0.0.0.0 reaches the local host on Linux
    "10.0.0.0/8",
    "100.64.0.0/10",  # CGNAT; also Alibaba Cloud's metadata service 100.100.100.200
    "127.0.0.0/8",
    "169.254.0.0/16",  # link-local: cloud metadata at 169.254.169.254
    "172.16.0.0/12",
    "192.0.0.0/24",  # IETF protocol assignments
    "192.88.99.0/24",  # 6to4 relays
    "192.168.0.0/16",
    "198.18.0.0/15",  # benchmarking
    "224.0.0.0/4",  # multicast
    "240.0.0.0/4",  # reserved, and 255.255.255.255
    "::/96",  # unspecified, loopback, IPv4-compatible
    "64:ff9b::/96",  # NAT64: reaches any IPv4 address, private ones too
    "64:ff9b:1::/48",
    "100::/64",  # discard
    "2001::/32",  # Teredo
    "2002::/16",  # 6to4: embeds any IPv4 address
    "fc00::/7",  # unique local: AWS's metadata service at fd00:ec2::254
    "fe80::/10",  # link-local
    "ff00::/8",  # multicast
)
DEFAULT_REGISTRY: Final = ("pypi.org", "files.pythonhosted.org", "registry.npmjs.org")
DEFAULT_PORTS: Final = frozenset({80, 443})
MAX_ALLOW_RULES: Final = 256
_LABEL: Final = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")  # with fullmatch: "$" would pass "a\n"


def normalize_host(text: str) -> str:
    """A host as the egress rules compare it: lower case, no trailing dot, IP literals canonical.

    Raises:
        ValueError: neither a DNS name (ASCII letters, digits, ``-``, ``_``) nor an IP literal.
    """
    bracketed = text.startswith("[") and text.endswith("]")
    host = text[1:-1] if bracketed else text
    if host.isascii() and "%" not in host:
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            pass
        else:
            if bracketed and address.version == 4:
                raise ValueError(f"{text!r}: only IPv6 literals go in brackets")
            return str(address)
    name = host.lower().removesuffix(".")
    labels = name.split(".")
    # isascii first: str.lower() maps some non-ASCII letters (the Kelvin sign) to ASCII ones.
    if bracketed or not host.isascii() or len(name) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise ValueError(f"{text!r} is not a host name or IP address (use punycode for non-ASCII names)")
    if labels[-1].isdigit():
        raise ValueError(f"{text!r} looks like an IP address in another notation: write it as a.b.c.d")
    return name


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class AllowRule:
    """One destination sandboxes may reach: a host, a ``*.suffix`` or an IP literal, and its ports.

    ``*.example.com`` matches ``a.example.com`` and ``a.b.example.com``, never ``example.com``.
    A host name never matches an IP literal, nor the reverse. ``ports`` None means any port.
    """

    host: str
    ports: frozenset[int] | None = DEFAULT_PORTS

    @property
    def wildcard(self) -> bool:
        return self.host.startswith("*.")

    def matches(self, host: str, port: int) -> bool:
        """Whether `host` (already `normalize_host`-ed) and `port` fall under this rule."""
        if self.ports is not None and port not in self.ports:
            return False
        if self.wildcard:
            return host.endswith(self.host[1:]) and not _is_ip(host)
        return host == self.host

    def covers(self, other: AllowRule) -> bool:
        """Whether every destination `other` allows is also allowed by this rule."""
        if self.ports is not None and (other.ports is None or not other.ports <= self.ports):
            return False
        if self.wildcard:
            return other.host.endswith(self.host[1:])
        return other.host == self.host

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        if self.ports is None:
            return f"{host}:*"
        if self.ports == DEFAULT_PORTS:
            return host
        return ",".join(f"{host}:{port}" for port in sorted(self.ports))


def parse_allow_rule(text: str) -> AllowRule:
    """Parse ``host``, ``host:port``, ``host:*``, ``*.suffix[:port]``, ``1.2.3.4:port`` or ``[v6]:port``.

    Without a port, a rule allows 80 and 443; ``:*`` allows every port.

    Raises:
        ValueError: with one line saying what is wrong.
    """
    if text.startswith("["):
        end = text.find("]")
        host_part, rest = (text[: end + 1], text[end + 1 :]) if end != -1 else (text, "")
        if rest and not rest.startswith(":"):
            raise ValueError(f"allow rule {text!r}: write an IPv6 rule as [address]:port")
        port_part = rest[1:] if rest else None
    elif text.count(":") > 1:
        raise ValueError(f"allow rule {text!r}: put an IPv6 address in brackets, as [2001:db8::1]:443")
    else:
        host_part, colon, port_text = text.partition(":")
        port_part = port_text if colon else None
    wildcard = host_part.startswith("*.")
    host = normalize_host(host_part[2:] if wildcard else host_part)
    if wildcard and (_is_ip(host) or "." not in host):
        raise ValueError(f"allow rule {text!r}: a wildcard needs a domain of two labels or more, as *.example.com")
    if port_part is None:
        ports: frozenset[int] | None = DEFAULT_PORTS
    elif port_part == "*":
        ports = None
    elif port_part.isascii() and port_part.isdigit() and 0 < int(port_part) < 65536 and port_part[0] != "0":
        ports = frozenset({int(port_part)})
    else:
        raise ValueError(f"allow rule {text!r}: the port must be 1 to 65535 or *")
    return AllowRule("*." + host if wildcard else host, ports)


def parse_allow_rules(texts: Sequence[str]) -> tuple[AllowRule, ...]:
    """Parse a list of rules (see `parse_allow_rule`); at most `MAX_ALLOW_RULES`.

    Raises:
        ValueError: the first malformed rule, or too many.
    """
    if len(texts) > MAX_ALLOW_RULES:
        raise ValueError(f"{len(texts)} allow rules is more than {MAX_ALLOW_RULES}: use *.suffix rules")
    return tuple(parse_allow_rule(text) for text in texts)


def narrow_allow(ceiling: Sequence[AllowRule], requested: Sequence[str]) -> tuple[AllowRule, ...]:
    """The requested destinations, each checked to lie within one rule of the ceiling.

    An empty request means no network at all, never "the ceiling".

    Raises:
        InvalidRequest: a malformed rule, or too many.
        PolicyDenied: a rule allows something the administrator's ceiling does not.
    """
    try:
        rules = parse_allow_rules(requested)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    for rule in rules:
        if not any(allowed.covers(rule) for allowed in ceiling):
            raise PolicyDenied(
                f"network destination {str(rule)!r} is outside the administrator's allowlist: ask for one it allows"
            )
    return rules


def _checked_rules(texts: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(str(rule) for rule in parse_allow_rules(texts))


class NetworkConfig(_Model):
    """Egress from sandboxes, through the host's proxy. Nothing is reachable unless a rule names it."""

    allow: tuple[str, ...] = ()
    """The administrator's ceiling: the only destinations a sandbox may ever be allowed."""
    registry: tuple[str, ...] = DEFAULT_REGISTRY
    """The package index hosts install_package may reach (pip, npm)."""
    blocked_ranges: tuple[str, ...] = DEFAULT_BLOCKED_RANGES
    """Addresses never connected to, whatever name resolves to them."""
    hosts: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    """Names the proxy resolves to these addresses instead of asking DNS (like /etc/hosts)."""
    connect_timeout_s: Annotated[float, Field(gt=0, le=120)] = 10.0
    idle_timeout_s: Annotated[float, Field(gt=0, le=86_400)] = 300.0
    max_connections: Annotated[int, Field(ge=1, le=4096)] = 64
    """Open connections per sandbox; past it the proxy answers 503."""

    @field_validator("allow", "registry")
    @classmethod
    def _check_rules(cls, texts: tuple[str, ...]) -> tuple[str, ...]:
        return _checked_rules(texts)

    @field_validator("blocked_ranges")
    @classmethod
    def _check_ranges(cls, ranges: tuple[str, ...]) -> tuple[str, ...]:
        for text in ranges:
            try:
                ipaddress.ip_network(text)
            except ValueError as exc:
                raise ValueError(f"blocked range {text!r} is not a network such as 10.0.0.0/8: {exc}") from None
        return ranges

    @field_validator("hosts")
    @classmethod
    def _check_hosts(cls, hosts: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
        checked: dict[str, tuple[str, ...]] = {}
        for name, addresses in hosts.items():
            key = normalize_host(name)
            if _is_ip(key) or not addresses:
                raise ValueError(f"hosts entry {name!r} must map a host name to one or more addresses")
            try:
                checked[key] = tuple(str(ipaddress.ip_address(a)) for a in addresses)
            except ValueError as exc:
                raise ValueError(f"hosts entry {name!r}: {exc}") from None
        return checked

    @property
    def allow_rules(self) -> tuple[AllowRule, ...]:
        return parse_allow_rules(self.allow)

    @property
    def registry_rules(self) -> tuple[AllowRule, ...]:
        return parse_allow_rules(self.registry)


class TemplateConfig(_Model):
    """A kind of sandbox an agent may ask for by name."""

    name: Annotated[str, Field(pattern=_ID_PATTERN)]
    read_only: tuple[ReadOnlyBind, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)
    limits: TemplateLimitsConfig | None = None
    """Defaults for this template; each must be within [sandboxes.limits]. Absent: the ceiling."""
    policy: CommandPolicyConfig | None = None
    """A stricter command policy; absent: any shell command (the kernel is the boundary)."""
    network_allow: tuple[str, ...] = ()
    """Destinations its sandboxes may reach; each within [sandboxes.network].allow. Empty: no network."""
    python_env: Path | None = None
    """A Python virtual environment on the host with preinstalled packages, shown read-only inside at
    /opt/bastion/env: execute_code and `python` use it; install_package adds to a venv of the sandbox's own."""

    @field_validator("env")
    @classmethod
    def _check_env(cls, env: dict[str, str]) -> dict[str, str]:
        return _checked_env(env)

    @field_validator("network_allow")
    @classmethod
    def _check_network_allow(cls, texts: tuple[str, ...]) -> tuple[str, ...]:
        return _checked_rules(texts)


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
    pip_index_url: Annotated[str, Field(pattern=r"^https://[^\s/]+(/\S*)?$")] = "https://pypi.org/simple"
    """install_package(manager='pip') installs from here; its host must be in [sandboxes.network] registry."""
    npm_registry_url: Annotated[str, Field(pattern=r"^https://[^\s/]+(/\S*)?$")] = "https://registry.npmjs.org/"
    install_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 300.0
    """Wall-clock limit of one install_package call."""
    default_template: Annotated[str, Field(pattern=_ID_PATTERN)] = "default"
    """The template create_sandbox uses when the call names none ("default": no template's extras)."""
    warm_pool: Annotated[int, Field(ge=0, le=64)] = 1
    """Sandboxes started ahead of time, so create_sandbox does not wait for one to boot."""
    limits: SandboxLimitsConfig = SandboxLimitsConfig()
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment for sandbox commands. Values are redacted from output."""
    network: NetworkConfig = NetworkConfig()

    @field_validator("env")
    @classmethod
    def _check_env(cls, env: dict[str, str]) -> dict[str, str]:
        return _checked_env(env)


# The organizer's default categories: folder name -> file extensions (lower case, no leading dot).
DEFAULT_CATEGORIES: Final[dict[str, tuple[str, ...]]] = {
    "Documents": ("pdf", "doc", "docx", "odt", "rtf", "txt", "md", "tex", "pages", "epub", "mobi"),
    "Spreadsheets": ("xls", "xlsx", "ods", "csv", "tsv", "numbers"),
    "Presentations": ("ppt", "pptx", "odp", "key"),
    "Images": ("jpg", "jpeg", "png", "gif", "webp", "bmp", "tif", "tiff", "svg", "heic", "heif", "raw", "ico"),
    "Audio": ("mp3", "wav", "flac", "aac", "ogg", "oga", "m4a", "opus", "wma", "aiff", "mid"),
    "Video": ("mp4", "mkv", "mov", "avi", "webm", "wmv", "m4v", "mpg", "mpeg", "flv"),
    "Archives": ("zip", "tar", "gz", "tgz", "bz2", "xz", "zst", "7z", "rar", "tar.gz", "tar.bz2", "tar.xz", "iso"),
    "Code": (
        "py", "js", "ts", "jsx", "tsx", "java", "c", "h", "cpp", "hpp", "cs", "go", "rs", "rb", "php", "sh",
        "json", "yaml", "yml", "toml", "xml", "html", "css", "sql", "ipynb",
    ),
    "Fonts": ("ttf", "otf", "woff", "woff2"),
}  # fmt: skip

SkipKind = Literal["symlink", "special_file", "unsafe_name", "outside_folder", "occupied_destination", "folder"]
# Checks every organizer tool must make: a skip rule of one of these kinds must have layer "protection".
PROTECTION_KINDS: Final[frozenset[str]] = frozenset(
    {"symlink", "special_file", "unsafe_name", "outside_folder", "occupied_destination"}
)


class SkipRule(_Model):
    """One reason the organizer leaves an entry where it is.

    `layer` has no default: "protection" rules bind every organizer tool (a move naming such a
    file is refused); "restraint" rules bind only the planner, and a person may still move the
    file on purpose with move_file (the plan reports it as NEEDS_EXPLICIT_REQUEST).
    """

    id: Annotated[str, Field(pattern=_ID_PATTERN)]
    layer: Literal["protection", "restraint"]
    kind: SkipKind | None = None
    """A built-in check; or None for a rule by `names` only."""
    names: tuple[str, ...] = ()
    """Name patterns (fnmatch, case-insensitive) matched against the entry's own name."""
    reason: str = ""

    @field_validator("names")
    @classmethod
    def _check_names(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        for name in names:
            if not name or "/" in name:
                raise ValueError(f"skip pattern {name!r} must be a non-empty name without '/'")
        return names


DEFAULT_SKIP_RULES: Final[tuple[SkipRule, ...]] = (
    SkipRule(id="symlinks", layer="protection", kind="symlink", reason="a symbolic link"),
    SkipRule(id="special-files", layer="protection", kind="special_file", reason="a device, pipe or socket"),
    SkipRule(id="unsafe-names", layer="protection", kind="unsafe_name", reason="an unsafe name (control characters)"),
    SkipRule(id="outside", layer="protection", kind="outside_folder", reason="a path that leaves the folder"),
    SkipRule(id="occupied", layer="protection", kind="occupied_destination", reason="an occupied destination"),
    # Matched against every component of a move's paths: no planting of git hooks.
    SkipRule(id="vcs", layer="protection", names=(".git", ".hg", ".svn"), reason="version-control internals"),
    SkipRule(id="folders", layer="restraint", kind="folder", reason="a folder"),
    SkipRule(id="dotfiles", layer="restraint", names=(".*",), reason="a hidden file"),
    SkipRule(
        id="installers",
        layer="restraint",
        names=("*.exe", "*.msi", "*.msix", "*.dmg", "*.pkg", "*.deb", "*.rpm", "*.appimage", "*.apk", "*.snap"),
        reason="an installer",
    ),
    SkipRule(id="app-bundles", layer="restraint", names=("*.app",), reason="an application bundle"),
    SkipRule(
        id="system-files",
        layer="restraint",
        names=("desktop.ini", "thumbs.db", "ehthumbs.db", "$recycle.bin", "system volume information"),
        reason="a system file",
    ),
    SkipRule(
        id="partial-downloads",
        layer="restraint",
        names=("*.part", "*.crdownload", "*.download", "*.partial", "*.opdownload"),
        reason="a download in progress",
    ),
)
_CATEGORY_EXT: Final = re.compile(r"^[a-z0-9][a-z0-9_+-]*(\.[a-z0-9][a-z0-9_+-]*)*$")


class InboxConfig(_Model):
    id: Annotated[str, Field(pattern=_ID_PATTERN)]
    path: Path
    categories: dict[str, tuple[str, ...]] = Field(default_factory=lambda: dict(DEFAULT_CATEGORIES))
    """Folder name -> extensions (lower case, no dot; "tar.gz" matches before "gz")."""
    max_plan_moves: Annotated[int, Field(ge=1, le=10_000)] = 500
    skip: tuple[SkipRule, ...] = DEFAULT_SKIP_RULES
    """The whole rule set; it must keep one protection rule of each built-in protection kind."""

    @field_validator("categories")
    @classmethod
    def _check_categories(cls, categories: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
        seen: dict[str, str] = {}
        for folder, extensions in categories.items():
            if name_problem(folder) is not None or folder.startswith(".") or folder.strip() != folder:
                raise ValueError(f"category folder {folder!r} must be a plain visible folder name")
            for ext in extensions:
                if not _CATEGORY_EXT.fullmatch(ext):
                    raise ValueError(f"extension {ext!r} of {folder!r} must be lower case without a leading dot")
                if ext in seen:
                    raise ValueError(f"extension {ext!r} is in both {seen[ext]!r} and {folder!r}: keep one")
                seen[ext] = folder
        return categories

    @field_validator("skip")
    @classmethod
    def _check_skip(cls, rules: tuple[SkipRule, ...]) -> tuple[SkipRule, ...]:
        ids = [rule.id for rule in rules]
        if len(set(ids)) != len(ids):
            raise ValueError("two skip rules share an id: give each a unique id")
        for kind in sorted(PROTECTION_KINDS):
            layers = {rule.layer for rule in rules if rule.kind == kind}
            if layers != {"protection"}:
                raise ValueError(f"the skip rules must keep a rule of kind {kind!r} with layer 'protection'")
        for rule in rules:
            if rule.kind is None and not rule.names:
                raise ValueError(f"skip rule {rule.id!r} has neither kind nor names: say what it matches")
        return rules


# Known native-app callbacks (RFC 8252 private-use schemes) accepted at registration by exact match.
DEFAULT_APP_CALLBACKS: Final = ("cursor://anysphere.cursor-mcp/oauth/callback",)


class HttpConfig(_Model):
    """Streamable HTTP serving and the built-in OAuth 2.1 authorization server (`bastion serve --http`)."""

    public_url: str | None = None
    """The origin clients use, e.g. https://bastion.example.com (no path). Drives the issuer, the resource
    URL (`<public_url>/mcp`) and the Host/Origin values accepted (DNS-rebinding protection)."""
    listen: str = "127.0.0.1:8765"
    """HOST:PORT to bind; `--listen` overrides it."""
    tls_cert: Path | None = None
    tls_key: Path | None = None
    auth: bool = True
    """Dangerous when false: /mcp then needs no token. Refused unless `listen` is a loopback address."""
    extra_origins: tuple[str, ...] = ()
    """Browser origins besides public_url allowed to call /mcp (e.g. the MCP Inspector's http://localhost:6274)."""
    app_callbacks: tuple[str, ...] = DEFAULT_APP_CALLBACKS
    """Non-https redirect URIs a client may register, matched exactly."""
    max_clients: Annotated[int, Field(ge=1, le=100_000)] = 200
    registrations_per_ip_per_hour: Annotated[int, Field(ge=1, le=10_000)] = 20
    unused_client_ttl_s: Annotated[float, Field(gt=0)] = 86_400.0
    code_lifetime_s: Annotated[float, Field(ge=60, le=120)] = 60.0
    access_token_lifetime_s: Annotated[float, Field(ge=60, le=86_400)] = 3600.0
    refresh_token_lifetime_s: Annotated[float, Field(ge=60)] = 30 * 86_400.0
    """A refresh token unused this long expires; each rotation starts a new one."""
    grant_lifetime_s: Annotated[float, Field(ge=60)] = 90 * 86_400.0
    """After this, the client must ask the administrator again, whatever its refresh tokens."""
    login_failures_before_backoff: Annotated[int, Field(ge=1, le=100)] = 5
    login_backoff_max_s: Annotated[float, Field(gt=0, le=86_400)] = 900.0
    global_login_failures_per_minute: Annotated[int, Field(ge=1, le=10_000)] = 30
    admin_session_lifetime_s: Annotated[float, Field(ge=60, le=86_400)] = 3600.0

    @field_validator("public_url")
    @classmethod
    def _check_public_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.username or parts.password:
            raise ValueError(f"public_url {value!r} must be an http(s) origin such as https://bastion.example.com")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(f"public_url {value!r} must have no path, query or fragment: bastion serves at its root")
        if parts.scheme == "http" and parts.hostname not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"public_url {value!r} is plain http on a non-loopback host: use https")
        return value.rstrip("/")

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"listen {value!r} must be HOST:PORT, e.g. 127.0.0.1:8765")
        return value

    @field_validator("app_callbacks")
    @classmethod
    def _check_app_callbacks(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        for value in values:
            scheme = value.partition(":")[0].lower()
            if not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme) or scheme in ("javascript", "data", "file", "vbscript"):
                raise ValueError(f"app callback {value!r} must be an absolute URI with a private-use scheme")
        return values


_GATEWAY_NAME: Final = r"^[a-z][a-z0-9_]{0,31}$"
_REMOTE_PATH: Final = re.compile(r"^/[A-Za-z0-9._/+-]{1,255}$")
_FROM_ADDRESS: Final = re.compile(r"^!?[A-Za-z0-9.:/*?-]{1,253}$")
_HOST_KEY: Final = re.compile(
    r"^(ssh-ed25519|ecdsa-sha2-nistp(256|384|521)|rsa-sha2-(256|512)|ssh-rsa) [A-Za-z0-9+/]+=*$"
)


def _blob_has_type(kind: str, blob: str) -> bool:
    # An OpenSSH public key blob starts with its own type name (RFC 4253 section 6.6).
    try:
        data = base64.b64decode(blob, validate=True)
    except ValueError:
        return False
    size = int.from_bytes(data[:4], "big")
    name = data[4 : 4 + size].decode("ascii", errors="replace")
    return name == kind or (kind.startswith("rsa-sha2-") and name == "ssh-rsa")


class GatewayArgConfig(_Model):
    """One argument of a gateway action: a tool parameter, checked before anything is sent."""

    name: Annotated[str, Field(pattern=_GATEWAY_NAME)]
    pattern: str
    """A regex the whole value must match (Python `re`). The target's dispatch.toml checks it again."""
    description: str = ""

    @field_validator("pattern")
    @classmethod
    def _check_pattern(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"argument pattern {pattern!r} is not a valid regex: {exc}") from None
        return pattern


class GatewayActionConfig(_Model):
    """An action the gateway may send; the tool is `<gateway>_<action>`."""

    name: Annotated[str, Field(pattern=_GATEWAY_NAME)]
    description: str = ""
    args: tuple[GatewayArgConfig, ...] = ()
    approval: bool = True
    """Wait for a human before sending. True by default: an action runs unapproved only when config says so."""

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        if name == "actions":
            raise ValueError("action name 'actions' is taken by the <gateway>_actions tool: rename it")
        return name


class GatewayConfig(_Model):
    """A production host reached over SSH, where a forced command (dispatch.py) runs fixed actions."""

    name: Annotated[str, Field(pattern=_GATEWAY_NAME)]
    host: Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9.:-]+$")]
    port: Annotated[int, Field(ge=1, le=65535)] = 22
    user: Annotated[str, Field(pattern=r"^[a-z_][a-z0-9_-]{0,31}$")]
    key_path: Path
    """The dedicated private key (`bastion gateway keygen` writes it). Never inside a workspace or inbox."""
    host_key: str | None = None
    """The target's pinned host key, e.g. "ssh-ed25519 AAAA...". Unset: every call is refused (FORBIDDEN)."""
    from_addresses: Annotated[tuple[str, ...], Field(min_length=1)]
    """Client addresses the authorized_keys line accepts (`from=`): bastion's address as the target sees it."""
    remote_python: str = "/usr/bin/python3"
    dispatch_path: str = "/opt/bastion-gateway/dispatch.py"
    dispatch_config: str = "/etc/bastion-gateway/dispatch.toml"
    connect_timeout_s: Annotated[float, Field(gt=0, le=300)] = 10.0
    call_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 120.0
    max_output_bytes: Annotated[int, Field(ge=1024, le=16 * 1024 * 1024)] = 65_536
    action: tuple[GatewayActionConfig, ...] = ()

    @field_validator("remote_python", "dispatch_path", "dispatch_config")
    @classmethod
    def _check_remote_path(cls, value: str) -> str:
        if not _REMOTE_PATH.fullmatch(value) or "/../" in value + "/" or "/./" in value + "/":
            raise ValueError(f"{value!r} must be an absolute path of letters, digits and ._/+-")
        return value

    @field_validator("from_addresses")
    @classmethod
    def _check_from(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        for value in values:
            if not _FROM_ADDRESS.fullmatch(value):
                raise ValueError(f"from address {value!r} must be an address, a CIDR block or a host pattern")
        return values

    @field_validator("host_key")
    @classmethod
    def _check_host_key(cls, value: str | None) -> str | None:
        if value is None:
            return None
        key = " ".join(value.split()[:2])
        if not _HOST_KEY.fullmatch(key) or not _blob_has_type(*key.split(" ")):
            raise ValueError("host_key must be 'TYPE BASE64' as in ssh-keyscan output, e.g. 'ssh-ed25519 AAAA...'")
        return key

    def action_by_name(self, name: str) -> GatewayActionConfig | None:
        return next((a for a in self.action if a.name == name), None)


class ApprovalsConfig(_Model):
    """Human approval of gateway actions marked `approval = true`."""

    wait_s: Annotated[float, Field(ge=0, le=3600)] = 60.0
    """How long a call waits for a decision (sending progress) before returning NEEDS_APPROVAL with an id."""
    ttl_s: Annotated[float, Field(gt=0, le=7 * 86_400)] = 3600.0
    """A request not approved and used within this time expires and never runs."""
    webhook_url: str | None = None
    """If set, each new request is POSTed there as JSON (e.g. a chat webhook)."""
    elicitation: bool = False
    """Also ask through MCP elicitation when the client supports it. Off by default: it lets the
    agent's own client approve a deploy, which is the administrator's choice to make."""

    @field_validator("webhook_url")
    @classmethod
    def _check_webhook(cls, value: str | None) -> str | None:
        if value is not None:
            parts = urlsplit(value)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"webhook_url {value!r} must be an http(s) URL")
        return value


class Config(_Model):
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

    def gateway_by_name(self, name: str) -> GatewayConfig | None:
        return next((g for g in self.gateway if g.name == name), None)

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

    @property
    def admin_hash_path(self) -> Path:
        """The administrator's argon2id password hash: under the state folder, never in the config file."""
        return self.state_dir / ADMIN_HASH_NAME


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
    return raw.model_copy(
        update={
            "gateway": gateways,
            "state_dir": _absolute(base, raw.state_dir),
            "workspace": workspaces,
            "inbox": inboxes,
            "audit": audit,
            "template": templates,
            "http": http,
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
    for index, ib in enumerate(config.inbox):
        if _inside(ib.path, config.state_dir) or _inside(config.state_dir, ib.path):
            raise ConfigError(
                f"inbox {ib.id!r} ({ib.path}) and the state folder {config.state_dir} overlap: keep them apart"
            )
        for other in config.inbox[index + 1 :]:
            # Two journals over one tree could each move the other's files: one folder, one organizer.
            if _inside(ib.path, other.path) or _inside(other.path, ib.path):
                raise ConfigError(f"inboxes {ib.id!r} and {other.id!r} overlap: give each its own folder")
    _check_templates(config, home)
    _check_gateways(config, folders)
    for ws in config.workspace:
        if not ws.policy.allow and not ws.policy.deny:
            raise ConfigError(f"workspace {ws.id!r} policy has neither allow nor deny: list the commands it may run")


def _check_gateways(config: Config, folders: list[tuple[str, str, Path]]) -> None:
    names = [g.name for g in config.gateway]
    if len(set(names)) != len(names):
        raise ConfigError("two [[gateway]] entries share a name: give each a unique name")
    for gateway in config.gateway:
        actions = [a.name for a in gateway.action]
        if len(set(actions)) != len(actions):
            raise ConfigError(f"gateway {gateway.name!r} lists an action twice: give each a unique name")
        for kind, folder_id, folder_path in folders:
            if _inside(gateway.key_path, folder_path):
                raise ConfigError(
                    f"gateway {gateway.name!r} key {gateway.key_path} is inside {kind} {folder_id!r}: "
                    "an agent could read it; move it (e.g. under the state folder)"
                )


def _check_templates(config: Config, home: Path) -> None:
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
            if not (template.python_env / "pyvenv.cfg").is_file() or not (template.python_env / "bin").is_dir():
                raise ConfigError(f"{where} is not a virtual environment: create it (make install does the demo's)")
            real = template.python_env.resolve()
            if real in (Path("/"), home) or _inside(config.state_dir, real) or _inside(real, config.state_dir):
                raise ConfigError(f"{where} is /, the home folder, or overlaps the state folder: use its own folder")
    default = config.sandboxes.default_template
    if default != "default" and default not in names:
        raise ConfigError(f"[sandboxes] default_template {default!r} is not a [[template]] name: add it or fix it")


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
