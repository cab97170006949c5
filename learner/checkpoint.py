"""Checkpoints: sharded training state + a Hugging Face export, committed atomically.

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
import random
import shutil
import time
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


def save_checkpoint(
    root: Path,
    step: int,
    *,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    rank: int,
    meta: dict[str, Any],
    hf_export: Any | None,
    barrier: Any,
) -> Path:
    """Write step_<step>/ on every rank; rank 0 commits. `hf_export(dir)` runs on rank 0 only.

    `barrier()` synchronises the learner ranks (torch.distributed.barrier).
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = step_dir(root, step)
    if rank == 0:
        if path.exists():  # a half-written attempt (no marker) from a crashed run
            shutil.rmtree(path)
        path.mkdir(parents=True)
    barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / "state"))
    if rank == 0:
        full_meta = {**meta, "step": step, "scheduler": scheduler.state_dict(), "saved_at": time.time()}
        (path / "trainer.json").write_text(json.dumps(full_meta, indent=1))
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, path / "rng.pt")
        if hf_export is not None:
            hf_export(path / "hf")
    barrier()
    if rank == 0:
        (path / MARKER).write_text(str(time.time()))
        log.info("checkpoint step %d committed at %s", step, path)
    barrier()
    return path


def load_checkpoint(info: CheckpointInfo, *, model: Any, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and RNG (every rank); returns trainer.json."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(info.path / "state"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(info.meta["scheduler"])
    rng = torch.load(info.path / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    return info.meta
