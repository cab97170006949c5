"""learner.algos is pure: importing it must not pull in the service or engine stacks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import sys
import learner.algos
heavy = sorted(m for m in ("redis", "ray", "vllm", "fastapi", "transformers") if m in sys.modules)
assert not heavy, heavy
"""


def test_import_is_light() -> None:
    result = subprocess.run(
        [sys.executable, "-c", CHECK], cwd=REPO_ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
