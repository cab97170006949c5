"""The checkpoint store's layout: what a committed checkpoint is, listing, retention.

Shared by the learner (which writes checkpoints, `learner/checkpoint.py`), rollout replicas (which
catch up from the newest Hugging Face export) and the API (which lists them).

Layout under the checkpoint store (`checkpoint.dir`, default `<output_dir>/checkpoints`):

    step_<N>/
      state/          torch.distributed.checkpoint: model + optimizer shards (every rank writes)
      trainer.json    step, policy version, data cursor, ledger counters, scheduler, config
      rng.pt          RNG states of rank 0 (torch, python)
      hf/             safetensors + config + tokenizer: loads with from_pretrained and in vLLM
      keep            optional: retention never deletes this checkpoint
      COMMITTED       written last; a directory without it is never listed or loaded

Retention keeps the newest `keep_last` committed checkpoints plus any marked `keep`.
What this does NOT guarantee: Redis state (queued groups) is not part of the checkpoint; on
resume, groups still in the streams are used or accounted for by the ledger, not replayed.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MARKER = "COMMITTED"
KEEP = "keep"


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    committed_at: float
    keep: bool
    meta: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "path": str(self.path),
            "hf_path": str(self.path / "hf"),
            "committed_at": self.committed_at,
            "keep": self.keep,
            "policy_version": self.meta.get("policy_version"),
            "data_cursor": self.meta.get("data_cursor"),
            "metrics": self.meta.get("metrics", {}),
        }


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step}"


def list_checkpoints(root: str | Path) -> list[CheckpointInfo]:
    """Committed checkpoints, oldest first. Half-written ones are invisible."""
    out = []
    root = Path(root)
    if not root.is_dir():
        return out
    for d in root.glob("step_*"):
        marker = d / MARKER
        if not marker.exists():
            continue
        try:
            step = int(d.name.removeprefix("step_"))
            meta = json.loads((d / "trainer.json").read_text())
        except (ValueError, OSError):
            continue
        out.append(CheckpointInfo(step, d, marker.stat().st_mtime, (d / KEEP).exists(), meta))
    return sorted(out, key=lambda c: c.step)


def get_checkpoint(root: str | Path, step: int) -> CheckpointInfo | None:
    return next((c for c in list_checkpoints(root) if c.step == step), None)


def latest_checkpoint(root: str | Path) -> CheckpointInfo | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def apply_retention(root: str | Path, keep_last: int) -> list[int]:
    """Delete committed checkpoints beyond the newest `keep_last` (never those marked keep)."""
    found = list_checkpoints(root)
    doomed = [c for c in found[:-keep_last] if not c.keep] if keep_last > 0 else []
    for c in doomed:
        (c.path / MARKER).unlink(missing_ok=True)  # invisible first, then gone
        shutil.rmtree(c.path, ignore_errors=True)
    return [c.step for c in doomed]


