"""Redaction cost per text: `Redactor.redact` against every rule run over the whole text, in the same run.

Every `read_file`, command output, search line and audit string is redacted before it leaves a tool,
so its cost is paid on each of them. The baseline is the algorithm before 2026-12-05 (one `in` per
needle over the lowered text, then each rule whose needles are present over the whole text), kept
here as it was but for the needle search's case folding (`_fold`, added since); `Redactor.redact`
finds the needles in one RE2 pass and runs a one-line rule only over the lines holding its needles.
Texts: this repository's own source and README (real code and prose, where `key`, `token` and
`password` are common words), a log with secrets, and one character repeated. Both must give the
same text; the ratio is bastion's time over the baseline's (lower is faster).

Run: .venv/bin/python bench/bench_redact.py [--rounds N]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from bastion.safety import redact as redact_mod
from bastion.safety.redact import Redactor

REPO = Path(__file__).resolve().parent.parent
SIZES = (4096, 65_536)


def whole_text_redact(redactor: Redactor, text: str) -> str:
    """The reference: the matches of every rule whose needles are present, each run over the whole text."""
    lowered = redact_mod._fold(text)
    present = {needle for needle in redact_mod._ALL_NEEDLES if needle in lowered}
    found = []
    for prio, rule in enumerate(redactor._rules):
        if not rule.needles or not rule.needles.isdisjoint(present):
            found += redact_mod._matches(rule, prio, text, 0, len(text))
    return redact_mod._apply(text, redact_mod._merge(found, redactor._rules), 0, len(text))


def texts() -> dict[str, str]:
    source = "".join(path.read_text() for path in sorted((REPO / "src" / "bastion").rglob("*.py")))
    prose = (REPO / "README.md").read_text()
    log = "".join(
        f"2026-12-05T10:00:{i % 60:02d}Z worker {i} token=tok_{i:08d}abcdef api_key: sk-{'a' * 24} ok\n"
        f"GET /items/{i} 200 Authorization: Bearer {'b' * 32}\n"
        for i in range(2000)
    )
    return {"source code": source, "README prose": prose, "log with secrets": log, "x repeated": "x" * 70_000}


def median_us(action: Callable[[], object], repeat: int) -> float:
    """Median of `repeat` timings of `action`, in microseconds."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    redactor = Redactor()
    print(f"redaction time per text, median of {args.rounds} rounds, baseline and bastion alternating")
    print(f"{'text':<20}{'size':>8}{'baseline us':>13}{'bastion us':>12}{'ratio':>8}")
    for name, corpus in texts().items():
        for size in SIZES:
            text = corpus[:size]
            if redactor.redact(text) != whole_text_redact(redactor, text):
                raise SystemExit(f"{name} {size}: bastion's redaction differs from the baseline's")
            base, ours = [], []
            for _ in range(args.rounds):
                base.append(median_us(functools.partial(whole_text_redact, redactor, text), 3))
                ours.append(median_us(functools.partial(redactor.redact, text), 3))
            b, o = statistics.median(base), statistics.median(ours)
            print(f"{name:<20}{size:>8,}{b:>13,.0f}{o:>12,.0f}{o / b:>7.2f}x")


if __name__ == "__main__":
    main()
