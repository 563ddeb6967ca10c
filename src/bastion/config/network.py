"""Network egress (issue #4): the rules that say where sandboxes may connect, and `[sandboxes.network]`.

The egress proxy matches with `normalize_host` and `AllowRule`; create_sandbox narrows the
administrator's ceiling with `narrow_allow`. Private: import these names from `bastion.config`.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Final

from pydantic import Field, field_validator

from bastion.config.base import Model
from bastion.safety.errors import InvalidRequest, PolicyDenied, shown

DEFAULT_BYTES_PER_S: Final = 64 * 1024 * 1024
"""A sandbox's egress, both ways together: 64 MiB/s (more than most links), about 4% of a core of the relay's."""
DEFAULT_BYTE_BURST: Final = 16 * 1024 * 1024
"""Bytes a sandbox moves at the link's speed before the rate applies."""

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
                raise ValueError(f"{shown(text)}: only IPv6 literals go in brackets")
            return str(address)
    name = host.lower().removesuffix(".")
    labels = name.split(".")
    # isascii first: str.lower() maps some non-ASCII letters (the Kelvin sign) to ASCII ones.
    if bracketed or not host.isascii() or len(name) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise ValueError(f"{shown(text)} is not a host name or IP address (use punycode for non-ASCII names)")
    if labels[-1].isdigit():
        raise ValueError(f"{shown(text)} looks like an IP address in another notation: write it as a.b.c.d")
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
            raise ValueError(f"allow rule {shown(text)}: write an IPv6 rule as [address]:port")
        port_part = rest[1:] if rest else None
    elif text.count(":") > 1:
        raise ValueError(f"allow rule {shown(text)}: put an IPv6 address in brackets, as [2001:db8::1]:443")
    else:
        host_part, colon, port_text = text.partition(":")
        port_part = port_text if colon else None
    wildcard = host_part.startswith("*.")
    host = normalize_host(host_part[2:] if wildcard else host_part)
    if wildcard and (_is_ip(host) or "." not in host):
        raise ValueError(f"allow rule {shown(text)}: a wildcard needs a domain of two labels or more, as *.example.com")
    if port_part is None:
        ports: frozenset[int] | None = DEFAULT_PORTS
    elif port_part == "*":
        ports = None
    elif port_part.isascii() and port_part.isdigit() and 0 < int(port_part) < 65536 and port_part[0] != "0":
        ports = frozenset({int(port_part)})
    else:
        raise ValueError(f"allow rule {shown(text)}: the port must be 1 to 65535 or *")
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


def checked_rules(texts: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(str(rule) for rule in parse_allow_rules(texts))


class NetworkConfig(Model):
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
    attempts_per_s: Annotated[float, Field(gt=0, le=10_000)] = 20.0
    """Connection attempts per sandbox per second, on average; past it the proxy answers 429."""
    attempt_burst: Annotated[int, Field(ge=1, le=100_000)] = 200
    """Connection attempts a sandbox may make at once before the rate applies."""
    bytes_per_s: Annotated[int, Field(ge=64 * 1024, le=1 << 40)] = DEFAULT_BYTES_PER_S
    """Bytes per sandbox per second through the proxy, all its connections both ways, on average. The relay runs
    on the server's CPU, not the sandbox's: this bounds what one sandbox's traffic costs the server."""
    byte_burst: Annotated[int, Field(ge=64 * 1024, le=1 << 40)] = DEFAULT_BYTE_BURST
    """Bytes a sandbox may move at once before the rate applies."""

    @field_validator("allow", "registry")
    @classmethod
    def _check_rules(cls, texts: tuple[str, ...]) -> tuple[str, ...]:
        return checked_rules(texts)

    @field_validator("blocked_ranges")
    @classmethod
    def _check_ranges(cls, ranges: tuple[str, ...]) -> tuple[str, ...]:
        for text in ranges:
            try:
                ipaddress.ip_network(text)
            except ValueError as exc:
                raise ValueError(f"blocked range {shown(text)} is not a network such as 10.0.0.0/8: {exc}") from None
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
