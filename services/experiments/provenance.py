"""Where a result came from: the date, the commit and the machine, stamped on every bench result
(`bench/results_file.py`) and on `dapo ablate`'s report, so a figure can be traced."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def provenance() -> dict[str, str]:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=10,
    ).stdout.strip()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory = ""
    with contextlib.suppress(OSError, ValueError, IndexError):
        memory = f", {int(Path('/proc/meminfo').read_text().split()[1]) / 2**20:.0f} GiB memory"
    return {
        "date": datetime.date.today().isoformat(),
        "commit": commit or "unknown",
        "machine": f"{platform.machine()}, {cpus} CPU cores{memory}, {platform.system()}",
    }
