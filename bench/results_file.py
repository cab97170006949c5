"""Where every bench writes its figures: `bench/results/<date>-<name>.json`, stamped with the
date, commit and machine, so a figure can always be traced to what produced it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
sys.path.insert(0, str(REPO))  # benches run as scripts from any directory
# re-exported for bench/results_table.py
from services.experiments.provenance import provenance  # noqa: E402

__all__ = ["RESULTS", "provenance", "save_result"]


def save_result(name: str, figures: dict[str, Any], out_dir: str | Path = RESULTS) -> Path:
    """Write `figures` with their provenance; returns the file (also printed as `results: ...`)."""
    result = {**provenance(), **figures}
    out = Path(out_dir) / f"{result['date']}-{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"results: {out}")
    return out
