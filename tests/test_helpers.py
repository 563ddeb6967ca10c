"""The shared test helpers that decide whether tests can race each other."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import free_port


def test_free_port_is_outside_the_range_connect_takes_source_ports_from() -> None:
    """A client's connect(2) anywhere on the machine can never be given a port `free_port` handed out."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [free_port() for _ in range(50)]
    assert all(1024 <= port < low for port in ports), (low, high, ports)
    assert len(set(ports)) == len(ports)  # one process does not hand out one port twice in a row
