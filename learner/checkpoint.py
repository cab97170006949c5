"""Writing and loading the learner's training state in the checkpoint store.

The layout, listing and retention are the store's (`services/contracts/checkpoint_store.py`);
this module fills a `step_<N>/` directory: sharded model and optimizer (every rank writes its
shards with torch.distributed.checkpoint), trainer.json and RNG states from rank 0, the Hugging
Face export, and last the COMMITTED marker.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from pathlib import Path
from typing import Any

from services.contracts.checkpoint_store import MARKER, CheckpointInfo, step_dir

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
