"""Run every benchmark in bench/, one after another; exit non-zero if a figure misses its target.

Each script measures bastion against a baseline in the same run and prints ratios.
Run: make bench (or .venv/bin/python bench/run_all.py)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = (
    "bench_stdio.py",
    "bench_audit.py",
    "bench_sandbox.py",
    "bench_identity.py",
    "bench_code.py",
    "bench_loop.py",
    "bench_egress.py",
    "bench_gateway.py",
    "bench_organizer.py",
    "bench_http.py",
    "bench_login.py",
    "bench_search.py",
    "bench_redact.py",
    "bench_preview.py",
    "bench_terminal.py",
    "bench_metrics.py",
    "bench_microvm.py",
)


def main() -> int:
    failed = []
    for script in SCRIPTS:
        print(f"== {script}", flush=True)
        proc = subprocess.run([sys.executable, str(HERE / script)], check=False)
        if proc.returncode != 0:
            failed.append(script)
        print(flush=True)
    if failed:
        print("missed a target: " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
