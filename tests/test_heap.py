"""The collector's settings for a server (bastion.heap), checked in a fresh interpreter: freezing is
for the whole process, and this one is pytest's."""

from __future__ import annotations

import subprocess
import sys

from bastion import heap


def _run(code: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.split()


def test_settle_freezes_what_start_up_made_and_collects_the_young_less_often() -> None:
    frozen, *thresholds = _run(
        "import gc; import bastion.app; from bastion import heap; heap.settle(); "
        "print(gc.get_freeze_count(), *gc.get_threshold())"
    )
    assert int(frozen) > 10_000  # the app's modules, classes and schemas
    assert tuple(map(int, thresholds)) == (heap.YOUNG_THRESHOLD, *heap.OLDER_THRESHOLDS)


def test_garbage_made_after_settle_is_still_collected() -> None:
    """Invariant: only start-up's objects are left out of collections; a cycle a request drops is freed."""
    (alive,) = _run(
        "import gc, weakref; from bastion import heap; heap.settle()\n"
        "class Node: pass\n"
        "a, b = Node(), Node(); a.peer, b.peer = b, a; ref = weakref.ref(a); del a, b\n"
        "gc.collect(); print(ref() is not None)"
    )
    assert alive == "False"
