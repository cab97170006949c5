"""Writing and loading the learner's training state in the checkpoint store.

The layout, listing and retention are the store's (`services/contracts/checkpoint_store.py`);
this module fills a `step_<N>/` directory: sharded model and optimizer (every rank writes its
shards with torch.distributed.checkpoint), trainer.json and RNG states from rank 0, the Hugging
Face export, the `keep` marker when asked, and last the COMMITTED marker; then retention.
`Checkpoints` is what the learner loop holds (every rank).
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from services.contracts.checkpoint_store import (
    KEEP,
    MARKER,
    CheckpointInfo,
    apply_retention,
    get_checkpoint,
    latest_checkpoint,
    step_dir,
)

log = logging.getLogger(__name__)


def save_checkpoint(
    root: Path,
    step: int,
    *,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    rank: int,
    meta: dict[str, Any],
    hf_export: Callable[[Path], None] | None,
    barrier: Callable[[], Any],
    keep: bool = False,
) -> Path:
    """Write step_<step>/ on every rank; rank 0 commits. `hf_export(dir)` runs on rank 0 only.

    `barrier()` synchronises the learner ranks (torch.distributed.barrier); `keep` exempts the
    checkpoint from retention.
    """
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    path = step_dir(root, step)
    if rank == 0:
        if path.exists():  # a half-written attempt (no marker) from a crashed run
            shutil.rmtree(path)
        path.mkdir(parents=True)
    barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / "state"))
    if rank == 0:
        full_meta = {**meta, "step": step, "scheduler": scheduler.state_dict(), "saved_at": time.time()}
        (path / "trainer.json").write_text(json.dumps(full_meta, indent=1))
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, path / "rng.pt")
        if hf_export is not None:
            hf_export(path / "hf")
        if keep:
            (path / KEEP).touch()
    barrier()
    if rank == 0:
        (path / MARKER).write_text(str(time.time()))
        log.info("checkpoint step %d committed at %s", step, path)
    barrier()
    return path


def load_checkpoint(info: CheckpointInfo, *, model: Any, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and RNG (every rank); returns trainer.json."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    load(state, checkpoint_id=str(info.path / "state"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(info.meta["scheduler"])
    rng = torch.load(info.path / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    return info.meta


class CheckpointStore(Protocol):
    def latest_step(self) -> int | None: ...

    def save(self, step: int, meta: dict[str, Any], *, keep: bool, hf_export: Callable[[Path], None]) -> Path: ...

    def load(self, step: int) -> dict[str, Any] | None: ...


class Checkpoints:
    """The learner's checkpoints (every rank): save with retention, load, find the newest."""

    def __init__(
        self, root: Path, *, trainer: Any, rank: int, keep_last: int, save_hf: bool, barrier: Callable[[], Any]
    ) -> None:
        self.root, self.trainer, self.rank = Path(root), trainer, rank
        self.keep_last, self.save_hf, self.barrier = keep_last, save_hf, barrier

    def latest_step(self) -> int | None:
        latest = latest_checkpoint(self.root)
        return None if latest is None else latest.step

    def save(self, step: int, meta: dict[str, Any], *, keep: bool, hf_export: Callable[[Path], None]) -> Path:
        t = self.trainer
        path = save_checkpoint(
            self.root, step, model=t.model, optimizer=t.optimizer, scheduler=t.scheduler, rank=self.rank, meta=meta,
            hf_export=hf_export if self.save_hf else None, barrier=self.barrier, keep=keep,
        )
        if self.rank == 0:
            removed = apply_retention(self.root, self.keep_last)
            if removed:
                log.info("retention removed checkpoints %s", removed)
        return path

    def load(self, step: int) -> dict[str, Any] | None:
        """trainer.json of checkpoint `step` after loading it, or None when it is gone."""
        info = get_checkpoint(self.root, step)
        if info is None:
            return None
        t = self.trainer
        return load_checkpoint(info, model=t.model, optimizer=t.optimizer, scheduler=t.scheduler)
