"""The login limiter and the window limiter, with a fake clock.

What this proves: every attempt is reserved before its check, so an address with a check in flight is
refused and a burst is never verified in parallel; at most `max_checks` checks run server-wide (503 past
that, at once); an address waits after `free` failures, doubling up to the maximum, and a success clears
it; IPv6 addresses are counted by /64; the global limit stops addresses that have failed and never one
that has not (a flood from elsewhere does not lock the administrator out); the tracked addresses stay
bounded; a full line of waiters drops its worst-ranked one for a newcomer from a network with fewer
failed or refused attempts, never for an equal; the window limiter counts per key. What it does not prove:
the HTTP answers (tested live in test_login_attacks.py, test_front_door_attacks.py and test_negative.py).
"""

from __future__ import annotations

import anyio
import pytest

from bastion.transports.http import ratelimit
from bastion.transports.http.ratelimit import (
    MAX_WAITING,
    LoginLimiter,
    LoginRefused,
    WindowLimiter,
    address_key,
    network_key,
)
from tests.helpers import FakeClock


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock(1000.0)
    monkeypatch.setattr("bastion.transports.http.ratelimit.time.monotonic", fake)
    return fake


def fail(limiter: LoginLimiter, ip: str, device: str | None = None) -> None:
    limiter.finish(limiter.begin(ip, device=device), ok=False)


def test_back_off_doubles_then_caps_and_clears(clock: FakeClock) -> None:
    limiter = LoginLimiter(free=3, max_s=5.0, global_per_minute=1000)
    for _ in range(2):
        fail(limiter, "a")
    assert limiter.retry_after("a") == 0
    fail(limiter, "a")
    assert limiter.retry_after("a") == pytest.approx(1.0)
    with pytest.raises(LoginRefused) as refused:
        limiter.begin("a")
    assert refused.value.status == 429
    assert refused.value.retry_after_s == pytest.approx(1.0)
    clock.now += 1.0
    fail(limiter, "a")
    assert limiter.retry_after("a") == pytest.approx(2.0)
    for _ in range(5):
        clock.now += 5.0
        fail(limiter, "a")
    assert limiter.retry_after("a") == pytest.approx(5.0)
    assert limiter.retry_after("b") == 0
    clock.now += 5.0
    assert limiter.retry_after("a") == 0  # the administrator can try again after the cool-down
    limiter.finish(limiter.begin("a"), ok=True)
    fail(limiter, "a")
    assert limiter.retry_after("a") == 0


def test_an_address_that_keeps_guessing_for_days_stays_backed_off(clock: FakeClock) -> None:
    """Attack: keep guessing at the back-off's pace. Past 1,024 failures over the free ones the back-off's
    2.0 ** n overflowed: the failure answered 500 and the address was never backed off again.
    Invariant: the thousandth-and-more failure still backs the address off by max_s."""
    limiter = LoginLimiter(free=3, max_s=900.0, global_per_minute=1_000_000)
    for _ in range(1_100):
        clock.now += 900.0
        fail(limiter, "a")
    assert limiter.retry_after("a") == pytest.approx(900.0)
    with pytest.raises(LoginRefused):
        limiter.begin("a")


def test_concurrent_burst_from_one_address_is_refused_before_any_check(clock: FakeClock) -> None:
    """The attempt is counted at `begin`: a second one from the same address while the first is being
    checked is refused, so 60 parallel guesses cost one argon2 check, not 60."""
    limiter = LoginLimiter(free=5, max_s=900.0, global_per_minute=1000)
    first = limiter.begin("198.51.100.7")
    refused = 0
    for _ in range(59):
        with pytest.raises(LoginRefused) as info:
            limiter.begin("198.51.100.7")
        assert info.value.status == 429
        refused += 1
    assert refused == 59
    with pytest.raises(LoginRefused) as info:
        limiter.begin("192.0.2.1")
    assert info.value.status == 503  # another address without a device cookie waits for the shared slot
    other = limiter.begin("198.51.100.7", device="admin-browser")  # the slot kept for a known browser
    limiter.finish(first, ok=False)
    limiter.finish(other, ok=True)
    limiter.finish(limiter.begin("198.51.100.7"), ok=False)  # the next one, after the answer


def test_server_wide_checks_are_capped_and_refused_not_queued(clock: FakeClock) -> None:
    """Two checks at most; one of them is kept for browsers with a device cookie, so addresses without
    one share the other: a flood never takes the slot the administrator's browser would use."""
    limiter = LoginLimiter(free=5, max_s=900.0, global_per_minute=1000, max_checks=2)
    running = [limiter.begin("192.0.2.1")]
    with pytest.raises(LoginRefused) as info:
        limiter.begin("192.0.2.2")
    assert info.value.status == 503
    assert limiter.retry_after("192.0.2.2") == 0  # a busy server is not a failure of that address
    running.append(limiter.begin("192.0.2.1", device="admin-browser"))  # the kept slot
    with pytest.raises(LoginRefused) as info:
        limiter.begin("192.0.2.3", device="another-browser")
    assert info.value.status == 503  # never more than two in all
    limiter.finish(running.pop(0), ok=False)
    limiter.finish(limiter.begin("192.0.2.3"), ok=True)
    limiter.finish(running.pop(), ok=False)
    assert limiter._running == limiter._running_untrusted == 0


def test_same_host_flood_does_not_lock_out_a_browser_with_a_device_cookie(clock: FakeClock) -> None:
    """The attacker and the administrator share 127.0.0.1: the attacker's failures back the address off
    and its check in flight refuses the next from that address, but an attempt with a device cookie is
    counted against that browser, and the device's own failures back it off as an address's would."""
    limiter = LoginLimiter(free=3, max_s=900.0, global_per_minute=5)
    attacker = limiter.begin("127.0.0.1")  # the attacker's check, in flight
    with pytest.raises(LoginRefused) as info:
        limiter.begin("127.0.0.1")
    assert info.value.status == 429
    limiter.finish(limiter.begin("127.0.0.1", device="admin"), ok=True)  # the administrator's browser
    limiter.finish(attacker, ok=False)
    for _ in range(6):
        fail(limiter, "127.0.0.1")
        clock.now += limiter.retry_after("127.0.0.1")
    fail(limiter, "127.0.0.1")
    assert limiter.retry_after("127.0.0.1") >= 8.0  # the address backs off, and the global limit holds it
    with pytest.raises(LoginRefused):
        limiter.begin("127.0.0.1")
    limiter.finish(limiter.begin("127.0.0.1", device="admin"), ok=True)
    for _ in range(3):
        fail(limiter, "127.0.0.1", device="admin")
    with pytest.raises(LoginRefused) as info:
        limiter.begin("127.0.0.1", device="admin")  # its own failures count
    assert info.value.status == 429


def test_ipv6_is_counted_per_64(clock: FakeClock) -> None:
    assert address_key("2001:db8:1:2:aaaa::1") == address_key("2001:db8:1:2:bbbb::9") == "2001:db8:1:2::/64"
    assert address_key("2001:db8:1:3::1") != address_key("2001:db8:1:2::1")
    assert address_key("::ffff:192.0.2.5") == "192.0.2.5"
    assert address_key("192.0.2.5") == "192.0.2.5"
    limiter = LoginLimiter(free=2, max_s=900.0, global_per_minute=1000)
    fail(limiter, "2001:db8:1:2::1")
    fail(limiter, "2001:db8:1:2::2")
    with pytest.raises(LoginRefused):
        limiter.begin("2001:db8:1:2:ffff:ffff:ffff:ffff")
    limiter.finish(limiter.begin("2001:db8:1:3::1"), ok=True)


def test_global_limit_stops_failed_addresses_never_a_fresh_one(clock: FakeClock) -> None:
    limiter = LoginLimiter(free=100, max_s=900.0, global_per_minute=5)
    for n in range(5):
        fail(limiter, f"10.0.0.{n}")
        clock.now += 1
    assert limiter.retry_after("10.0.0.0") == pytest.approx(55.0)  # the first attempt leaves the window
    with pytest.raises(LoginRefused):
        limiter.begin("10.0.0.3")
    # The administrator's address has no failure: it is never locked out by the others.
    assert limiter.retry_after("192.0.2.1") == 0
    limiter.finish(limiter.begin("192.0.2.1"), ok=True)
    clock.now += 55.0
    assert limiter.retry_after("10.0.0.0") == 0


def test_tracked_addresses_stay_bounded(clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ratelimit, "_MAX_TRACKED", 50)
    limiter = LoginLimiter(free=1, max_s=900.0, global_per_minute=100_000)
    held = limiter.begin("192.0.2.1", device="browser")  # in flight: never forgotten
    for n in range(500):
        fail(limiter, f"10.0.{n // 256}.{n % 256}")
    assert len(limiter._by_key) <= 50
    with pytest.raises(LoginRefused) as info:
        limiter.begin("192.0.2.1", device="browser")
    assert info.value.status == 429  # still known to be in flight
    limiter.finish(held, ok=True)


def test_window_limiter(clock: FakeClock) -> None:
    window = WindowLimiter(limit=2, window_s=3600.0)
    assert window.allow("a")
    clock.now += 10
    assert window.allow("a")
    assert not window.allow("a")
    assert window.retry_after("a") == pytest.approx(3590.0)
    assert window.allow("b")
    clock.now += 3591
    assert window.allow("a")


def test_a_window_sprayed_with_keys_stays_bounded_and_fast(clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attack: one request from each of many addresses (an IPv6 /64 holds plenty) at a preview. Its old
    table forgot only keys with no recent event, so past 100,000 it forgot none and rebuilt itself at
    every request. Invariant: the table keeps at most its cap, the key counted the longest forgotten first."""
    monkeypatch.setattr(ratelimit, "_MAX_TRACKED", 50)
    window = WindowLimiter(limit=5, window_s=60.0)
    for n in range(500):
        assert window.allow(f"10.0.{n // 256}.{n % 256}")
    assert len(window._events) <= 50
    assert "10.0.0.0" not in window._events


def test_every_loopback_form_is_one_address() -> None:
    """Attack: a local user binds 127.0.0.2, 127.1.2.3, ... (all of 127.0.0.0/8 is on `lo`) or ::1, each a
    fresh address to the limits. Invariant: every loopback form is one key; others keep their own."""
    for ip in ("127.0.0.1", "127.0.0.2", "127.255.254.1", "::1", "::ffff:127.0.0.9", "::127.3.2.1"):
        assert address_key(ip) == ratelimit.LOOPBACK_KEY, ip
    assert address_key("::192.0.2.5") == "192.0.2.5"
    assert address_key("::") == "::/64"
    assert address_key("128.0.0.1") == "128.0.0.1"


@pytest.mark.anyio
async def test_a_busy_slot_is_handed_to_the_waiter_with_fewest_failures_not_the_fastest_asker() -> None:
    """Attack: a flood retries the shared check slot every few milliseconds, so the first-come slot always
    went to it and a fresh browser got 503 on every try. Invariant: one that finds the slot busy waits; a
    freed slot goes to the waiter with the fewest failures (then the longest waiting), never to a newcomer."""
    limiter = LoginLimiter(free=100, max_s=900.0, global_per_minute=1000)
    fail(limiter, "198.51.100.1")
    running = limiter.begin("198.51.100.2")
    order: list[str] = []

    async def login(ip: str) -> None:
        attempt = await limiter.acquire(ip)
        order.append(ip)
        limiter.finish(attempt, ok=False)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(login, "198.51.100.1")  # failed before: goes last
        await anyio.wait_all_tasks_blocked()
        tasks.start_soon(login, "192.0.2.7")
        await anyio.wait_all_tasks_blocked()
        with pytest.raises(LoginRefused) as busy:
            limiter.begin("203.0.113.9")  # a newcomer never jumps the line
        assert busy.value.status == 503
        limiter.finish(running, ok=False)
    assert order == ["192.0.2.7", "198.51.100.1"]
    assert limiter._running == limiter._running_untrusted == 0
    assert not limiter._line


async def _log_in(limiter: LoginLimiter, ip: str, refused: dict[str, int], order: list[str]) -> None:
    """Wait for a turn and fail, or note the refusal's status."""
    try:
        attempt = await limiter.acquire(ip)
    except LoginRefused as refusal:
        refused[ip] = refusal.status
        return
    order.append(ip)
    limiter.finish(attempt, ok=False)


@pytest.mark.anyio
async def test_flooding_the_line_from_fresh_64s_of_one_48_drops_a_flood_waiter_for_a_fresh_browser() -> None:
    """Attack: more than MAX_WAITING fresh addresses (IPv6 /64s of one /48, none with a failure of its
    own) keep the line full and retry each 503 at once: a fresh browser got 503 at once. Invariant: a
    waiter's rank counts its network's failed and refused attempts; a full line drops its worst-ranked
    waiter (503) for a newcomer from a clean network, who gets the next turn; the flood's own newcomers
    rank no better and get 503 at once; the line never holds more than MAX_WAITING."""
    limiter = LoginLimiter(free=100, max_s=900.0, global_per_minute=1000)
    fail(limiter, "2001:db8:7:ffff::1")
    running = limiter.begin("2001:db8:7:fffe::1")
    refused: dict[str, int] = {}
    order: list[str] = []
    flood = [f"2001:db8:7:{n:x}::1" for n in range(MAX_WAITING + 1)]
    async with anyio.create_task_group() as tasks:
        for ip in flood:
            tasks.start_soon(_log_in, limiter, ip, refused, order)
            await anyio.wait_all_tasks_blocked()
        assert refused == {flood[-1]: 503}  # full, and the flood's newcomer ranks no better
        tasks.start_soon(_log_in, limiter, "192.0.2.7", refused, order)
        await anyio.wait_all_tasks_blocked()
        assert refused == {flood[-1]: 503, flood[-2]: 503}  # the newest of the worst-ranked made room
        assert len(limiter._line) == MAX_WAITING
        limiter.finish(running, ok=False)
    assert order[0] == "192.0.2.7"
    assert sorted(order[1:]) == sorted(flood[:-2])
    assert limiter._running == limiter._running_untrusted == 0
    assert not limiter._line
    assert not any(entry.in_flight for entry in limiter._by_key.values())


@pytest.mark.anyio
async def test_flooding_the_line_from_many_fresh_networks_still_refuses_a_fresh_browser() -> None:
    """The documented limit: a flood whose waiters each come from a network with nothing on record ranks
    with the administrator's fresh browser, and an equal never displaces a waiter: the browser gets 503
    (the device cookie, not the line, keeps a returning administrator's login open). Every waiter still
    gets its turn, in arrival order."""
    limiter = LoginLimiter(free=100, max_s=900.0, global_per_minute=1000)
    running = limiter.begin("203.0.113.1")
    refused: dict[str, int] = {}
    order: list[str] = []
    flood = [f"10.{n}.0.1" for n in range(MAX_WAITING)]
    async with anyio.create_task_group() as tasks:
        for ip in flood:
            tasks.start_soon(_log_in, limiter, ip, refused, order)
            await anyio.wait_all_tasks_blocked()
        with pytest.raises(LoginRefused) as busy:
            await limiter.acquire("192.0.2.7")
        assert busy.value.status == 503
        limiter.finish(running, ok=False)
    assert order == flood
    assert not refused
    assert not limiter._line


def test_networks_are_ipv4_24s_and_ipv6_48s_bounded_and_cleared_by_a_success(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A network's record is bounded like the addresses' (the longest ago counted forgotten first), and a
    right password clears it: the administrator's own typos do not rank their network behind others."""
    assert network_key(address_key("192.0.2.77")) == "192.0.2.0/24"
    assert network_key(address_key("2001:db8:7:1234::5")) == "2001:db8:7::/48"
    assert network_key(address_key("::ffff:192.0.2.77")) == "192.0.2.0/24"
    assert network_key(address_key("127.0.0.9")) == ratelimit.LOOPBACK_KEY
    monkeypatch.setattr(ratelimit, "_MAX_TRACKED", 50)
    limiter = LoginLimiter(free=100, max_s=900.0, global_per_minute=100_000)
    for n in range(500):
        fail(limiter, f"10.{n // 256}.{n % 256}.1")
    assert len(limiter._by_network) <= 50
    assert "10.0.0.0/24" not in limiter._by_network
    fail(limiter, "192.0.2.1")
    fail(limiter, "192.0.2.2")
    assert limiter._by_network["192.0.2.0/24"] == 2
    limiter.finish(limiter.begin("192.0.2.3"), ok=True)
    assert "192.0.2.0/24" not in limiter._by_network
    fail(limiter, "192.0.2.1", device="browser")
    assert "device:browser" not in limiter._by_network
