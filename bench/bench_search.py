"""search_files' regex engine figure (issue 15): Python's backtracking `re` against RE2.

For each classic catastrophic pattern, one line of growing length that it does not match
(the worst case for backtracking) is searched by `re` (in a child process, killed at the cap,
since it cannot be interrupted) and by `bastion.safety.search` (RE2). Prints the time per line
and, for `re`, "> cap" when it did not finish; then RE2's worst accepted pattern found here
on a line of `MAX_REGEX_LINE_CHARS`.

Run: .venv/bin/python bench/bench_search.py [--cap-s S]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from bastion.safety.search import MAX_REGEX_LINE_CHARS, search_pattern

CASES = (
    ("(a+)+$", "a", "!"),
    ("(a|a)*b", "a", ""),
    (r"(\w+\s?)+$", "a", "!"),
)
LENGTHS = (16, 24, 28, 4096)
WORST_RE2 = ("(.*a){1000}z", "(.*a){80}", "((.*a){30}){30}z")
_CHILD = "import re, sys; re.search(sys.argv[1], sys.argv[2])"


def time_re(pattern: str, line: str, cap_s: float) -> float | None:
    """Seconds `re.search` took in a child process, or None past `cap_s`."""
    start = time.monotonic()
    try:
        subprocess.run([sys.executable, "-c", _CHILD, pattern, line], timeout=cap_s, check=True)
    except subprocess.TimeoutExpired:
        return None
    return time.monotonic() - start


def time_re2(pattern: str, line: str) -> tuple[float, bool]:
    checked = search_pattern(pattern, regex=True)
    start = time.monotonic()
    found = checked.found_in(line)
    return time.monotonic() - start, found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cap-s", type=float, default=5.0, help="stop waiting for `re` after this")
    args = parser.parse_args()
    print(f"{'pattern':<16} {'chars':>6} {'re (child, s)':>14} {'RE2 (ms)':>10}")
    for pattern, unit, tail in CASES:
        for length in LENGTHS:
            line = (unit * length)[:length] + tail
            re_s = time_re(pattern, line, args.cap_s) if length < 100 else None
            re2_s, _ = time_re2(pattern, line)
            shown = "skipped" if length >= 100 else (f"> {args.cap_s:g}" if re_s is None else f"{re_s:.3f}")
            print(f"{pattern:<16} {length:>6} {shown:>14} {re2_s * 1000:>10.3f}")
    print(f"RE2, heavy accepted patterns on a {MAX_REGEX_LINE_CHARS}-character line:")
    line = "a" * MAX_REGEX_LINE_CHARS + "!"
    for pattern in WORST_RE2:
        seconds, found = time_re2(pattern, line)
        print(f"  {pattern:<20} {seconds * 1000:8.2f} ms  found={found}")


if __name__ == "__main__":
    main()
