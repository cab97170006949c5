"""Where every bench writes its figures: `bench/results/<date>-<name>.json`, stamped with the
date, commit and machine, so a figure can always be traced to what produced it."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def provenance() -> dict[str, str]:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    return {"date": datetime.date.today().isoformat(), "commit": commit, "machine": f"{platform.machine()}, {os.cpu_count()} cores"}


def save_result(name: str, figures: dict[str, Any], out_dir: str | Path = RESULTS) -> Path:
    """Write `figures` with their provenance; returns the file (also printed as `results: ...`)."""
    result = {**provenance(), **figures}
    out = Path(out_dir) / f"{result['date']}-{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"results: {out}")
    return out
