"""What the sandbox costs: a worker's start (spawn, confinement, loading the function) and a
call's round trip, against a bare `python -I -c pass` spawned in the same run.

Each figure is the median of `--repeats` measurements on this machine, one worker at a time.
Nothing is asserted.

    .venv/bin/python bench/sandbox_start.py [--repeats 20]

Last line: `sandbox_start_ms=<median milliseconds from spawn to a ready, confined worker>`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.results_file import save_result  # noqa: E402  (a module beside this script)
from sandbox.pool import Sandbox  # noqa: E402


def _ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1000, 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = parser.parse_args()

    bare = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-I", "-c", "pass"], check=True)
        bare.append(time.perf_counter() - t0)

    starts, calls = [], []
    confinement = None
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        box = Sandbox("sandbox.builtin_tools:calculator", workers=1)
        starts.append(time.perf_counter() - t0)
        confinement = box.confinement
        for _ in range(10):
            t1 = time.perf_counter()
            assert box.call("12*34").text == "408"
            calls.append(time.perf_counter() - t1)
        box.close()

    figures = {
        "bare_python_ms": _ms(bare),
        "sandbox_start_ms": _ms(starts),
        "start_over_bare": round(statistics.median(starts) / statistics.median(bare), 2),
        "call_round_trip_ms": _ms(calls),
        "confinement": confinement.describe() if confinement else "",
        "repeats": args.repeats,
    }
    for name, value in figures.items():
        print(f"{name:>20}: {value}")
    save_result("sandbox_start", figures, args.out)
    print(f"sandbox_start_ms={figures['sandbox_start_ms']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
