"""The organizer against a naive os.listdir + os.rename loop, on the repository's disk, in the same run.

Figures: plan_organize over 10,000 files, and apply_plan of 1,000 moves (journal fsync'd,
sources re-checked, renameat2(RENAME_NOREPLACE) through directory fds, folders fsync'd),
each as a ratio of the median time of the naive loop; the two alternate, round by round.
Target: apply at most 3x the naive loop.

Run: .venv/bin/python bench/bench_organizer.py [--rounds N]
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bastion.config import DEFAULT_CATEGORIES, InboxConfig
from bastion.organizer import Organizer

REPO = Path(__file__).resolve().parent.parent
PLAN_FILES = 10_000
APPLY_FILES = 1_000
TARGET_APPLY = 3.0
EXTENSIONS = ("pdf", "jpg", "png", "mp3", "mp4", "zip", "py", "csv", "docx", "txt")
BY_EXT = {ext: folder for folder, exts in DEFAULT_CATEGORIES.items() for ext in exts}


def fill(folder: Path, count: int) -> None:
    folder.mkdir(parents=True)
    for index in range(count):
        (folder / f"file {index:05d}.{EXTENSIONS[index % len(EXTENSIONS)]}").write_bytes(b"x" * 64)


def naive_plan(folder: Path) -> list[tuple[str, str]]:
    moves = []
    for name in os.listdir(folder):
        folder_name = BY_EXT.get(os.path.splitext(name)[1][1:].lower())
        if folder_name is not None:
            moves.append((name, f"{folder_name}/{name}"))
    return moves


def naive_apply(folder: Path) -> None:
    made: set[str] = set()
    for name, dst in naive_plan(folder):
        parent = os.path.dirname(dst)
        if parent not in made:
            os.makedirs(folder / parent, exist_ok=True)
            made.add(parent)
        os.rename(folder / name, folder / dst)


def organizer_for(base: Path, inbox: Path, name: str) -> Organizer:
    state = base / f"state-{name}"
    state.mkdir()
    organizer = Organizer(InboxConfig(id="inbox", path=inbox, max_plan_moves=PLAN_FILES), state)
    organizer.open()
    return organizer


def timed(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def bench_plan(base: Path, rounds: int) -> tuple[float, float]:
    inbox = base / "plan-inbox"
    fill(inbox, PLAN_FILES)
    organizer = organizer_for(base, inbox, "plan")
    ours, naive = [], []
    try:
        for _ in range(rounds):
            naive.append(timed(lambda: naive_plan(inbox)))
            ours.append(timed(organizer.plan))
    finally:
        organizer.close()
    return statistics.median(ours), statistics.median(naive)


def bench_apply(base: Path, rounds: int) -> tuple[float, float]:
    ours: list[float] = []
    naive: list[float] = []
    for index in range(rounds):
        naive_inbox, our_inbox = base / f"naive-{index}", base / f"ours-{index}"
        fill(naive_inbox, APPLY_FILES)
        fill(our_inbox, APPLY_FILES)
        organizer = organizer_for(base, our_inbox, f"apply-{index}")
        try:
            plan_id = organizer.plan()["plan_id"]
            naive_work = functools.partial(naive_apply, naive_inbox)
            our_work = functools.partial(organizer.apply, plan_id)
            pair: list[tuple[str, Callable[[], object]]] = [("naive", naive_work), ("ours", our_work)]
            for name, work in pair if index % 2 == 0 else reversed(pair):
                (naive if name == "naive" else ours).append(timed(work))
            assert not any(p.is_file() for p in our_inbox.iterdir()), "apply left files behind"
        finally:
            organizer.close()
    return statistics.median(ours), statistics.median(naive)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix=".bench-organizer-", dir=REPO / "bench"))
    try:
        plan_ours, plan_naive = bench_plan(base, args.rounds)
        apply_ours, apply_naive = bench_apply(base, args.rounds)
    finally:
        shutil.rmtree(base)
    print(f"organizer on {REPO}, median of {args.rounds} alternating rounds")
    print(f"{'case':<44}{'bastion':>11}{'naive':>11}{'ratio':>8}")
    apply_ratio = apply_ours / apply_naive
    for name, ours, naive in (
        (f"plan_organize, {PLAN_FILES:,} files", plan_ours, plan_naive),
        (f"apply_plan, {APPLY_FILES:,} moves", apply_ours, apply_naive),
    ):
        print(f"{name:<44}{ours * 1000:>9.1f}ms{naive * 1000:>9.1f}ms{ours / naive:>7.2f}x")
    verdict = "met" if apply_ratio <= TARGET_APPLY else "MISSED"
    print(f"target: apply_plan of {APPLY_FILES:,} moves <= {TARGET_APPLY}x the naive loop: {verdict}")
    sys.exit(0 if apply_ratio <= TARGET_APPLY else 1)


if __name__ == "__main__":
    main()
