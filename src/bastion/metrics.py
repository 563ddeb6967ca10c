"""Prometheus metrics: what the server counts, kept in one registry per server (never the global one).

Counters and histograms are updated where things happen (the call runner, the audit log, the egress
proxy, the login limiter); gauges of what exists now (sandboxes, the warm pool) are read at scrape
time from a `SandboxCensus`, so the hot path pays nothing for them. prometheus_client's metrics are
thread-safe with a short lock held only while a value changes: never across an await.

Label values are bounded: tool names are the server's own, result codes are `ResultCode` values,
the egress and login labels are fixed words. Nothing a client chooses becomes a label (a label per
client_id or path would let a client grow the registry without bound).

`/metrics` access is decided in `bastion.transports.http.observe`; this module only counts.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Final, Literal, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE", "EgressVerdict", "LoginFailure", "Metrics", "SandboxCensus"]

CONTENT_TYPE: Final = CONTENT_TYPE_LATEST
# Tool calls run from ~0.1 ms (a read) to minutes (a build in a sandbox).
CALL_BUCKETS_S: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
# An audit append is one fdatasync (tens of microseconds on tmpfs, milliseconds on a disk).
AUDIT_BUCKETS_S: Final = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1)
EgressVerdict = Literal["allowed", "refused"]
LoginFailure = Literal["wrong_password", "refused"]


class SandboxCensus(Protocol):
    """What the sandbox manager tells a scrape: live sandboxes by (state, isolation), and the warm pool."""

    def census(self) -> Mapping[tuple[str, str], int]: ...

    @property
    def pool_size(self) -> int: ...


class _SandboxCollector(Collector):
    def __init__(self, census: SandboxCensus) -> None:
        self._census = census

    def collect(self) -> Iterator[Metric]:
        boxes = GaugeMetricFamily(
            "bastion_sandboxes", "Live sandboxes by state and isolation backend.", labels=["state", "isolation"]
        )
        for (state, isolation), count in sorted(self._census.census().items()):
            boxes.add_metric([state, isolation], count)
        yield boxes
        yield GaugeMetricFamily(
            "bastion_warm_pool_sandboxes", "Started sandboxes waiting in the warm pool.", value=self._census.pool_size
        )


class Metrics:
    """One server's metrics. Create one per server; `render` is the /metrics body."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self._calls = Counter(
            "bastion_tool_calls", "Tool calls by tool and result code.", ["tool", "code"], registry=registry
        )
        self._call_seconds = Histogram(
            "bastion_tool_call_seconds",
            "Tool call latency by tool, audit records included.",
            ["tool"],
            buckets=CALL_BUCKETS_S,
            registry=registry,
        )
        self._audit_seconds = Histogram(
            "bastion_audit_append_seconds",
            "Time to put one audit record on disk, as its writer waited for it.",
            buckets=AUDIT_BUCKETS_S,
            registry=registry,
        )
        self._audit_failures = Counter(
            "bastion_audit_append_failures", "Audit records that could not be written.", registry=registry
        )
        self._egress = Counter(
            "bastion_egress_attempts", "Sandbox egress attempts by verdict.", ["verdict"], registry=registry
        )
        self._egress_bytes = Counter(
            "bastion_egress_bytes", "Bytes carried by the egress proxy, by direction.", ["direction"], registry=registry
        )
        self._logins = Counter(
            "bastion_login_failures",
            "Failed administrator logins (wrong password, or refused by the back-off).",
            ["reason"],
            registry=registry,
        )
        for verdict in ("allowed", "refused"):
            self._egress.labels(verdict)
        for direction in ("up", "down"):
            self._egress_bytes.labels(direction)
        for reason in ("wrong_password", "refused"):
            self._logins.labels(reason)
        # Children by label values: `labels()` takes a lock and builds a key each time.
        self._call_children: dict[tuple[str, str], Counter] = {}
        self._latency_children: dict[str, Histogram] = {}

    def watch_sandboxes(self, census: SandboxCensus) -> None:
        """Report `census`'s sandboxes and warm pool at each scrape."""
        self.registry.register(_SandboxCollector(census))

    def tool_call(self, tool: str, code: str, seconds: float) -> None:
        counter = self._call_children.get((tool, code))
        if counter is None:
            counter = self._call_children.setdefault((tool, code), self._calls.labels(tool, code))
        latency = self._latency_children.get(tool)
        if latency is None:
            latency = self._latency_children.setdefault(tool, self._call_seconds.labels(tool))
        counter.inc()
        latency.observe(seconds)

    def audit_append(self, started: float) -> None:
        """One record's append finished (`started`: its `time.perf_counter()` at the start)."""
        self._audit_seconds.observe(time.perf_counter() - started)

    def audit_failure(self) -> None:
        self._audit_failures.inc()

    def egress_attempt(self, verdict: EgressVerdict, bytes_up: int = 0, bytes_down: int = 0) -> None:
        self._egress.labels(verdict).inc()
        if bytes_up:
            self._egress_bytes.labels("up").inc(bytes_up)
        if bytes_down:
            self._egress_bytes.labels("down").inc(bytes_down)

    def login_failure(self, reason: LoginFailure) -> None:
        self._logins.labels(reason).inc()

    def render(self) -> bytes:
        """The exposition text of every metric (Prometheus text format 0.0.4)."""
        return generate_latest(self.registry)
