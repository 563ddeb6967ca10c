"""What the load and soak runs measure, apart from driving the clients (tests/load/driver.py).

Each client's tally per tool; what one server holds on the host (`ServerProbe` counts only what is
its own, since tests run in parallel on the same host: its cgroups are named `sb-<server pid>-<n>`,
its mounts and loop devices live under its folder, its processes descend from its pid); its RSS and
open fds over time; the audit log's records of the load clients; and the markdown report.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import anyio

from bastion.safety.audit import chain_files
from tests.transports.http.live import BASTION, LiveServer

CLIENT_PREFIX = "load-"
CALLER_PREFIX = f"http:cli:{CLIENT_PREFIX}"
SETTLE_TIMEOUT_S = 60.0
WARM_POOL = 1


# --- tallies ---------------------------------------------------------------------------------------


@dataclass
class ToolTally:
    ok: int = 0
    refused: int = 0
    unexpected: int = 0
    latencies_s: list[float] = field(default_factory=list)
    audit_ids: list[str] = field(default_factory=list)

    @property
    def calls(self) -> int:
        return self.ok + self.refused + self.unexpected


@dataclass
class Tally:
    """One client's own account of its calls, per tool, and the first unexpected ones in words."""

    tools: dict[str, ToolTally] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def tool(self, name: str) -> ToolTally:
        return self.tools.setdefault(name, ToolTally())

    def unexpected(self, name: str, what: str) -> None:
        self.tool(name).unexpected += 1
        if len(self.failures) < 20:
            self.failures.append(f"{name}: {what}")


def merged(tallies: list[Tally]) -> Tally:
    total = Tally()
    for tally in tallies:
        total.failures.extend(tally.failures)
        for name, part in tally.tools.items():
            into = total.tool(name)
            into.ok += part.ok
            into.refused += part.refused
            into.unexpected += part.unexpected
            into.latencies_s.extend(part.latencies_s)
            into.audit_ids.extend(part.audit_ids)
    return total


# --- what the server holds -------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (its own threads, not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Holdings:
    """What one server holds on the host: cgroups, mounts, loop devices, processes (its descendants)."""

    cgroups: int
    mounts: int
    loops: int
    processes: int

    def line(self) -> str:
        return (
            f"{self.cgroups} sandbox cgroups, {self.mounts} mounts, {self.loops} loop devices, "
            f"{self.processes} processes"
        )


@dataclass(frozen=True)
class Sample:
    at: float
    rss_bytes: int
    fds: int


class ServerProbe:
    """Reads /proc and /sys for one server process and its folder `root`."""

    def __init__(self, pid: int, root: Path, *, disks: bool) -> None:
        self.pid = pid
        self.root = str(root.resolve())
        self.disks = disks
        """Sandboxes have a disk each (`disk_quota`): a pool sandbox is made only once its disk is there."""

    def sample(self) -> Sample:
        status = Path(f"/proc/{self.pid}/status").read_text()
        match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
        rss = int(match.group(1)) * 1024 if match else 0
        return Sample(time.monotonic(), rss, len(os.listdir(f"/proc/{self.pid}/fd")))

    def holdings(self) -> Holdings:
        return Holdings(self._cgroups(), self._mounts(), self._loops(), len(self._descendants()))

    def _cgroups(self) -> int:
        """Sandboxes with a group left in any hierarchy (one sandbox has a group in each)."""
        prefix = f"sb-{self.pid}-"
        names: set[str] = set()
        for base in (Path("/sys/fs/cgroup/bastion"), *Path("/sys/fs/cgroup").glob("*/bastion")):
            if base.is_dir():
                names.update(entry.name for entry in base.iterdir() if entry.name.startswith(prefix))
        return len(names)

    def _mounts(self) -> int:
        # mountinfo's fifth field is the mount point, with spaces escaped as \040 (root has none).
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
        return sum(1 for line in lines if line.split()[4].startswith(self.root + "/"))

    def _loops(self) -> int:
        found = 0
        for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
            with contextlib.suppress(OSError):
                if backing.read_text().strip().startswith(self.root + "/"):
                    found += 1
        return found

    def _descendants(self) -> set[int]:
        parents: dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    stat = Path(f"/proc/{entry}/stat").read_text()
                    parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        found: set[int] = set()
        frontier = {self.pid}
        while frontier:
            frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
            found |= frontier
        return found

    async def settled(self, expected: Holdings | None = None) -> Holdings:
        """The holdings once two reads a moment apart agree, the warm pool is made (and they equal `expected`, if
        given), or the last read at the deadline: closes and the warm pool's refill finish in the background.

        The pool's sandbox has its cgroup while its folders and disk are still being made (the two overlap): a
        full run on a loaded machine once read that moment twice as "before", and no "after" could equal it.
        """
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        last = self.holdings()
        while time.monotonic() < deadline:
            await anyio.sleep(0.25)
            now = self.holdings()
            made = now.cgroups >= WARM_POOL and (not self.disks or now.loops >= now.cgroups)
            if now == last and made and (expected is None or now == expected):
                return now
            last = now
        return last


class Sampler:
    """RSS and open fds of the server every `every_s` seconds, in a task of the caller's task group."""

    def __init__(self, probe: ServerProbe, every_s: float) -> None:
        self.probe = probe
        self.every_s = every_s
        self.samples: list[Sample] = []
        self.holdings: list[Holdings] = []

    async def run(self) -> None:
        while True:
            self.samples.append(self.probe.sample())
            self.holdings.append(await anyio.to_thread.run_sync(self.probe.holdings))
            await anyio.sleep(self.every_s)

    def level(self, start: float, end: float) -> tuple[float, float]:
        """Median RSS and fds of the samples taken in [start, end)."""
        window = [s for s in self.samples if start <= s.at < end]
        if not window:
            raise AssertionError(f"no sample between {start:.1f} and {end:.1f}")
        return statistics.median(s.rss_bytes for s in window), statistics.median(s.fds for s in window)


# --- the audit log ---------------------------------------------------------------------------------


@dataclass
class AuditCount:
    """The load clients' records: end record ids per tool, and start call ids without an end."""

    ends: dict[str, list[str]] = field(default_factory=dict)
    unended_starts: int = 0
    records: int = 0
    files: int = 0


def count_audit(path: Path) -> AuditCount:
    files, missing = chain_files(path)
    if missing is not None:
        raise AssertionError(missing.first_error)
    count = AuditCount(files=len(files))
    starts: set[str] = set()
    ended: set[str] = set()
    for file in files:
        with open(file, encoding="utf-8") as lines:
            for line in lines:
                record = json.loads(line)
                count.records += 1
                if not str(record.get("caller", "")).startswith(CALLER_PREFIX):
                    continue
                if record.get("event") == "start":
                    starts.add(record["call"])
                elif record.get("event") == "end":
                    ended.add(record["call"])
                    count.ends.setdefault(record["tool"], []).append(record["id"])
    count.unended_starts = len(starts - ended)
    return count


def audit_mismatches(tally: Tally, audit: AuditCount) -> list[str]:
    """Every answered call's end record present exactly once, and no end record no client saw."""
    problems = []
    for tool in sorted(set(tally.tools) | set(audit.ends)):
        answered = Counter(tally.tools[tool].audit_ids if tool in tally.tools else [])
        recorded = Counter(audit.ends.get(tool, []))
        calls = tally.tools[tool].calls if tool in tally.tools else 0
        if answered != recorded or calls != sum(recorded.values()):
            problems.append(
                f"{tool}: clients counted {calls} calls ({sum(answered.values())} audit ids), "
                f"the log has {sum(recorded.values())} end records "
                f"({len(recorded - answered)} unanswered, {len(answered - recorded)} missing, "
                f"{sum(1 for n in recorded.values() if n > 1)} duplicated)"
            )
    if audit.unended_starts:
        problems.append(f"{audit.unended_starts} start records have no end record")
    return problems


def verify_audit(server: LiveServer) -> subprocess.CompletedProcess[str]:
    command = [str(BASTION), "audit", "verify", "--config", str(server.config_path)]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)


# --- the report ------------------------------------------------------------------------------------


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def tool_table(tally: Tally) -> str:
    rows = [
        "| tool | calls | ok | expected refusals | unexpected | p50 ms | p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in sorted(tally.tools):
        t = tally.tools[name]
        p50, p99 = percentile(t.latencies_s, 0.5) * 1000, percentile(t.latencies_s, 0.99) * 1000
        rows.append(f"| {name} | {t.calls} | {t.ok} | {t.refused} | {t.unexpected} | {p50:.1f} | {p99:.1f} |")
    return "\n".join(rows)


def report_path(tmp_path: Path) -> Path:
    """BASTION_LOAD_REPORT (the make targets point it at docs/load-report.md), else under `tmp_path`."""
    return Path(os.environ.get("BASTION_LOAD_REPORT") or tmp_path / "load-report.md")


def machine_line() -> str:
    memory = int(Path("/proc/meminfo").read_text().split()[1]) // (1024 * 1024)
    return f"{os.cpu_count()} cores, {memory} GiB, Linux {os.uname().release}"


def today() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d")


def write_section(path: Path, heading: str, body: str) -> None:
    """Put `heading` + `body` in the markdown file at `path`, replacing that section if present (up to
    the next `## ` heading) and keeping the others (the load, soak and fault runs each own one)."""
    text = path.read_text() if path.exists() else "# Load, soak and fault report\n"
    section = f"{heading}\n\n{body.strip()}\n"
    pattern = re.compile(rf"(?ms)^{re.escape(heading)}\n.*?(?=^## |\Z)")
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
