"""Egress allow rules, narrowing, blocked ranges and the [sandboxes.network] config.

The rule parser and `narrow_allow` are the policy: property tests check that a narrowed
rule never admits a destination the ceiling refuses, and that a wildcard never matches
its own apex. What they do not prove: anything about the network path (test_egress.py).
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bastion.config import (
    DEFAULT_BLOCKED_RANGES,
    DEFAULT_PORTS,
    AllowRule,
    load_config,
    narrow_allow,
    normalize_host,
    parse_allow_rule,
    parse_allow_rules,
)
from bastion.egress import _request as _proxy_request
from bastion.egress import proxy as egress
from bastion.egress.proxy import blocked_by, parse_ranges
from bastion.safety.errors import ConfigError, InvalidRequest, PolicyDenied

DEFAULTS = parse_ranges(DEFAULT_BLOCKED_RANGES)

labels = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?", fullmatch=True)
tlds = st.from_regex(r"[a-z]{2,6}", fullmatch=True)
names = st.builds(lambda parts, tld: ".".join([*parts, tld]), st.lists(labels, min_size=1, max_size=3), tlds)
ports = st.integers(1, 65535)


@st.composite
def rules(draw: st.DrawFn) -> str:
    host = draw(names)
    if draw(st.booleans()):
        host = "*." + host
    port = draw(st.one_of(st.none(), st.just("*"), ports.map(str)))
    return host if port is None else f"{host}:{port}"


# -- parsing ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "host", "ports"),
    [
        ("pypi.org", "pypi.org", DEFAULT_PORTS),
        ("PyPI.org.", "pypi.org", DEFAULT_PORTS),
        ("*.example.com:8443", "*.example.com", frozenset({8443})),
        ("files.pythonhosted.org:*", "files.pythonhosted.org", None),
        ("203.0.113.7:443", "203.0.113.7", frozenset({443})),
        ("[2001:DB8::1]:443", "2001:db8::1", frozenset({443})),
        ("local_name:1234", "local_name", frozenset({1234})),
    ],
)
def test_rule_forms(text: str, host: str, ports: frozenset[int] | None) -> None:
    assert parse_allow_rule(text) == AllowRule(host, ports)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "*",
        "*:443",
        "*.com",  # a whole top-level domain
        "*.1.2.3.4",
        "2130706433",  # 127.0.0.1 as one number
        "0x7f.0.0.1",
        "127.1",
        "[1.2.3.4]:80",
        "::1",
        "2001:db8::1:443",
        "[fe80::1%eth0]:80",
        "host:0",
        "host:65536",
        "host:080",
        "host:-1",
        "host:80:81",
        "a..b",
        "-a.com",
        "a b.com",
        "exa\u212ample.com",  # the Kelvin sign lower-cases to ASCII k
        "bücher.de",
        "a/b.com",
        "user@host.com",
        "x" * 64 + ".com",
        "example.com\n",
        "a\n.example.com",
    ],
)
def test_malformed_rules_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"\S"):
        parse_allow_rule(text)


@given(
    st.one_of(
        st.text(max_size=40),
        names.map(lambda n: n + "\n"),
        names.map(str.upper),
        st.ip_addresses().map(str),
        st.ip_addresses(v=6).map(lambda a: f"[{a}]"),
    )
)
def test_normalized_hosts_hold_only_plain_characters(text: str) -> None:
    try:
        host = normalize_host(text)
    except ValueError:
        return
    assert set(host) <= set("abcdefghijklmnopqrstuvwxyz0123456789._-:")
    assert normalize_host(host) == host


@given(rules())
def test_parse_and_format_round_trip(text: str) -> None:
    rule = parse_allow_rule(text)
    assert parse_allow_rule(str(rule)) == rule


@given(names, ports)
def test_wildcard_never_matches_its_apex(name: str, port: int) -> None:
    rule = AllowRule("*." + name, None)
    assert not rule.matches(name, port)
    assert rule.matches("a." + name, port)
    assert rule.matches("a.b." + name, port)
    assert not rule.matches("a" + name, port)  # "aexample.com" is not under "example.com"


def test_rule_without_port_allows_web_ports_only() -> None:
    rule = parse_allow_rule("pypi.org")
    assert rule.matches("pypi.org", 443)
    assert rule.matches("pypi.org", 80)
    assert not rule.matches("pypi.org", 22)


def test_name_rules_never_match_ip_literals() -> None:
    rule = parse_allow_rule("*.example.com:*")
    assert not rule.matches("127.0.0.1", 80)
    assert not rule.matches("::1", 80)
    assert parse_allow_rule("127.0.0.1:80").matches(normalize_host("127.0.0.1"), 80)
    assert not parse_allow_rule("127.0.0.1:80").matches("localhost", 80)


def test_too_many_rules_are_refused() -> None:
    with pytest.raises(ValueError, match="more than"):
        parse_allow_rules([f"h{i}.example.com" for i in range(300)])


# -- narrowing --------------------------------------------------------------------------


@given(st.lists(rules(), min_size=1, max_size=4), rules(), names, ports)
def test_narrowed_rules_never_admit_what_the_ceiling_refuses(
    ceiling_texts: list[str], requested: str, host: str, port: int
) -> None:
    ceiling = parse_allow_rules(ceiling_texts)
    try:
        (rule,) = narrow_allow(ceiling, [requested])
    except PolicyDenied:
        return
    candidates = [host, rule.host.removeprefix("*."), "x." + rule.host.removeprefix("*.")]
    for candidate in candidates:
        if rule.matches(candidate, port):
            assert any(c.matches(candidate, port) for c in ceiling), (candidate, port)


@given(st.lists(rules(), min_size=1, max_size=4))
def test_the_ceiling_narrows_to_itself(ceiling_texts: list[str]) -> None:
    ceiling = parse_allow_rules(ceiling_texts)
    assert narrow_allow(ceiling, [str(rule) for rule in ceiling]) == ceiling


@pytest.mark.parametrize(
    ("ceiling", "requested"),
    [
        (["*.example.com"], "example.com"),  # the apex is not under its wildcard
        (["*.example.com"], "*.com.example"),
        (["a.example.com"], "*.example.com"),
        (["*.a.example.com"], "*.example.com"),
        (["pypi.org"], "pypi.org:22"),
        (["pypi.org"], "pypi.org:*"),
        (["pypi.org:443"], "pypi.org"),  # 80 and 443 is wider than 443
        (["pypi.org:*"], "203.0.113.7:443"),
        ([], "pypi.org"),
    ],
)
def test_wider_requests_are_refused(ceiling: list[str], requested: str) -> None:
    with pytest.raises(PolicyDenied, match="outside the administrator's allowlist"):
        narrow_allow(parse_allow_rules(ceiling), [requested])


@pytest.mark.parametrize(
    ("ceiling", "requested"),
    [
        (["*.example.com"], "a.example.com"),
        (["*.example.com"], "*.a.example.com:443"),
        (["pypi.org:*"], "pypi.org:22"),
        (["pypi.org"], "pypi.org:443"),
        (["*.example.com:*"], "*.example.com"),
    ],
)
def test_narrower_requests_are_granted(ceiling: list[str], requested: str) -> None:
    assert narrow_allow(parse_allow_rules(ceiling), [requested]) == (parse_allow_rule(requested),)


def test_malformed_request_is_invalid_and_empty_means_no_network() -> None:
    with pytest.raises(InvalidRequest):
        narrow_allow(parse_allow_rules(["*.example.com"]), ["*"])
    assert narrow_allow(parse_allow_rules(["*.example.com"]), []) == ()


# -- blocked ranges ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "127.255.0.9",
        "0.0.0.0",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "100.100.100.200",  # Alibaba Cloud metadata (CGNAT range)
        "169.254.169.254",
        "224.0.0.1",
        "255.255.255.255",
        "::",
        "::1",
        "::ffff:127.0.0.1",
        "::ffff:169.254.169.254",
        "::127.0.0.1",
        "64:ff9b::a9fe:a9fe",  # NAT64 of 169.254.169.254
        "2002:7f00:1::1",  # 6to4 of 127.0.0.1
        "fd00:ec2::254",  # AWS metadata over IPv6
        "fe80::1",
        "ff02::1",
    ],
)
def test_default_ranges_block(address: str) -> None:
    assert blocked_by(ipaddress.ip_address(address), DEFAULTS) is not None


@pytest.mark.parametrize("address", ["203.0.113.7", "198.51.100.1", "192.0.2.1", "8.8.8.8", "2606:4700::1"])
def test_default_ranges_allow_public_and_documentation_addresses(address: str) -> None:
    """The CI registry resolves into 203.0.113.0/24: documentation ranges must stay reachable."""
    assert blocked_by(ipaddress.ip_address(address), DEFAULTS) is None


@given(st.integers(0, 2**32 - 1))
def test_ipv4_mapped_addresses_are_judged_as_ipv4(value: int) -> None:
    v4 = ipaddress.IPv4Address(value)
    mapped = ipaddress.IPv6Address("::ffff:" + str(v4))
    assert (blocked_by(mapped, DEFAULTS) is None) == (blocked_by(v4, DEFAULTS) is None)


# -- config -----------------------------------------------------------------------------


def _with(path: Path, toml: str) -> Path:
    path.write_text(path.read_text() + "\n" + toml)
    return path


def test_network_defaults(demo_config_path: Path) -> None:
    network = load_config(demo_config_path).sandboxes.network
    assert network.allow == ()
    assert network.blocked_ranges == DEFAULT_BLOCKED_RANGES
    assert "pypi.org" in network.registry
    assert network.hosts == {}


def test_network_table_loads(demo_config_path: Path) -> None:
    _with(
        demo_config_path,
        "[sandboxes.network]\n"
        'allow = ["*.Example.com:*", "pypi.org"]\n'
        'blocked_ranges = ["10.0.0.0/8"]\n'
        'hosts = { "Registry.Test" = ["127.0.0.1"] }\n'
        "max_connections = 8\n"
        '\n[[template]]\nname = "net"\nnetwork_allow = ["api.example.com:443"]\n',
    )
    config = load_config(demo_config_path)
    network = config.sandboxes.network
    assert network.allow == ("*.example.com:*", "pypi.org")
    assert network.hosts == {"registry.test": ("127.0.0.1",)}
    assert network.allow_rules[0] == AllowRule("*.example.com", None)
    template = config.template_by_name("net")
    assert template is not None
    assert template.network_allow == ("api.example.com:443",)


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('[sandboxes.network]\nallow = ["*"]\n', "sandboxes.network.allow"),
        ('[sandboxes.network]\nblocked_ranges = ["10.0.0.1/8"]\n', "not a network"),
        ('[sandboxes.network]\nhosts = { "1.2.3.4" = ["127.0.0.1"] }\n', "hosts entry"),
        ('[sandboxes.network]\nhosts = { "a.test" = ["localhost"] }\n', "hosts entry"),
        ('[sandboxes.network]\nhosts = { "a.test" = [] }\n', "hosts entry"),
        ('[sandboxes.network]\nproxy = "x"\n', "unknown key"),
        ('[[template]]\nname = "net"\nnetwork_allow = ["api.example.com"]\n', "outside [sandboxes.network] allow"),
    ],
)
def test_bad_network_config_is_refused(demo_config_path: Path, toml: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(_with(demo_config_path, toml))


# -- request head parsing ---------------------------------------------------------------


@given(st.binary(max_size=300))
def test_any_request_head_parses_or_is_refused_cleanly(head: bytes) -> None:
    try:
        request = _proxy_request.parse_http(head, b"")
    except egress.Refused as exc:
        refusal = exc
    else:
        assert normalize_host(request.host) == request.host
        assert 0 < request.port < 65536
        return
    assert (refusal.status, refusal.decision) == (400, "error")


@given(
    st.sampled_from(["GET", "POST", "HEAD"]),
    names,
    st.lists(
        st.tuples(
            st.sampled_from(["Host", "Connection", "Proxy-Authorization", "Keep-Alive", "X-Test", "Accept"]),
            st.from_regex(r"[a-zA-Z0-9 ,=-]{0,20}", fullmatch=True),
        ),
        max_size=6,
    ),
)
def test_rewritten_request_has_one_host_and_asks_to_close(
    method: str, host: str, headers: list[tuple[str, str]]
) -> None:
    head = f"{method} http://{host}:8080/p?q=1 HTTP/1.1\r\n" + "".join(f"{n}: {v}\r\n" for n, v in headers)
    request = _proxy_request.parse_http(head.encode()[:-2], b"body")
    lines = request.forward.split(b"\r\n\r\n", 1)[0].decode().split("\r\n")
    assert lines[0] == f"{method} /p?q=1 HTTP/1.1"
    names_sent = [line.partition(":")[0].lower() for line in lines[1:]]
    assert names_sent.count("host") == 1
    assert f"Host: {host}:8080" in lines
    assert lines[-1] == "Connection: close"
    assert "proxy-authorization" not in names_sent
    assert "keep-alive" not in names_sent
    assert request.forward.endswith(b"\r\n\r\nbody")
