"""The connection cap's arithmetic (the live flood is in test_transport_attacks.py)."""

from __future__ import annotations

import resource

from hypothesis import given
from hypothesis import strategies as st

from bastion.transports.http.connections import IN_FLIGHT_BURSTS, MAX_BACKLOG, fd_limits


def test_a_512_file_limit_gives_bursts_of_32_and_128_connections() -> None:
    assert fd_limits(1024, soft=512) == fd_limits(1024, listeners=1, soft=512)
    limits = fd_limits(1024, soft=512)
    assert (limits.backlog, limits.cap) == (32, 128)


def test_the_configured_maximum_wins_when_files_are_plenty() -> None:
    assert fd_limits(1024, soft=1 << 20).cap == 1024
    assert fd_limits(1024, soft=1 << 20).backlog == MAX_BACKLOG
    assert fd_limits(1024, soft=resource.RLIM_INFINITY).cap == 1024


@given(soft=st.integers(min_value=512, max_value=1 << 22), listeners=st.sampled_from([1, 2]))
def test_a_flood_on_every_listener_leaves_a_quarter_of_the_files_free(soft: int, listeners: int) -> None:
    """Every listener full (its cap) and its accept bursts in flight still leave the server at least a
    quarter of its files: accept() never meets EMFILE before the cap evicts."""
    limits = fd_limits(100_000, listeners=listeners, soft=soft)
    held = listeners * (limits.cap + IN_FLIGHT_BURSTS * limits.backlog)
    assert soft - held >= soft // 4
    assert 16 <= limits.backlog <= MAX_BACKLOG
