"""Writing and loading the learner's training state in the checkpoint store.

The layout, listing, retention and manifest are the store's (`contracts/checkpoint_store.py`).
Saving (every rank): everything goes to `.tmp-step_<N>/` — each rank's model and optimizer shards
(torch.distributed.checkpoint) and RNG states, and from rank 0 trainer.json, the Hugging Face export
and the `keep` marker when asked. After a barrier the ranks hash the files (a share each, fsyncing
what they hash); rank 0 writes the manifest and the COMMITTED marker, fsyncs the directories and
renames the directory to `step_<N>`; then retention.

Loading (every rank) verifies the manifest first: each rank hashes a share of the files, the
verdicts are gathered, and a checkpoint with no manifest or any file that does not match it is
refused on every rank (CheckpointRefused, naming the files) before anything is unpickled. Then
torch.distributed.checkpoint reads the files with its pickled `state/.metadata` through an
allow-list and its other items with `weights_only=True` (`learner/dcp_reader.py`), so even a
manifest rewritten along with the files runs no code; the RNG states need no such trust
(safetensors tensors and JSON; no unrestricted `torch.load` anywhere).
A load that succeeded then moves the steps newer than it aside (`retire_newer`): a restore
abandons the line that continued from it, which must not be resumed at the next restart.

Cost: verification reads every byte of the checkpoint once more. SHA-256 ran at about 550 MiB/s
per thread on the 2-core development machine (CPUs with SHA extensions are faster; not measured
here); the tiny preset's 14 MB checkpoint verifies in 0.06 s (its save takes 0.9 s). Files are
hashed in HASH_THREADS threads per rank and split over the ranks by size, so a 32B model with
AdamW state (about 400 GB in fp32) over 8 ranks is about 50 GB per rank: about 90 s at that rate,
less with faster hashing, more when the disk does not keep up. One large file is hashed by one
thread (SHA-256 is sequential). Saving hashes the same way (and fsyncs as it hashes).
What this does NOT guarantee: see the store's docstring (a writer with full access to the store
can write a consistent manifest; a file swapped between verification and loading is not caught).
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
from typing import Any, Protocol, TypeVar

from contracts.checkpoint_store import (
    HASH_THREADS,
    HF_EXPORT,
    KEEP,
    MARKER,
    CheckpointInfo,
    CheckpointRefused,
    FileDigest,
    apply_retention,
    assign,
    check_listing,
    clean_stale,
    commit_dir,
    describe_problems,
    file_digest,
    fsync_path,
    fsync_tree,
    get_checkpoint,
    hashed_files,
    latest_checkpoint,
    read_manifest,
    retire_newer,
    step_dir,
    temp_step_dir,
    verify_files,
    write_durable,
    write_manifest,
)
from learner.trainer import TrainState

log = logging.getLogger(__name__)

T = TypeVar("T")


# --- ranks ----------------------------------------------------------------------------------------
def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _all_gather(value: T) -> list[T]:
    """`value` from every rank, in rank order, over the default process group (the learner's own,
    the one torch.distributed.checkpoint uses too); `[value]` without one."""
    import torch.distributed as dist

    if _world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


# --- RNG states: safetensors + JSON, nothing pickled ----------------------------------------------
def rng_file(path: Path, rank: int) -> Path:
    return path / "rng" / f"rank_{rank}.safetensors"


def _state_json(state: tuple[Any, ...]) -> str:
    version, internal, gauss = state
    return json.dumps([version, list(internal), gauss])


def _state_from_json(text: str) -> tuple[Any, ...]:
    version, internal, gauss = json.loads(text)
    return version, tuple(internal), gauss


def save_rng(out: Path, shuffle: random.Random) -> None:
    """This rank's torch CPU and CUDA generator states (uint8 tensors), python `random`'s state and
    the trainer's mini-batch `shuffle` generator's (JSON in the file's metadata). numpy's global
    generator is not saved: the learner does not use it."""
    import torch
    from safetensors.torch import save_file

    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["torch_cuda"] = torch.cuda.get_rng_state()  # the current device: one per rank
    metadata = {
        "python": _state_json(random.getstate()),
        "shuffle": _state_json(shuffle.getstate()),
    }
    save_file(tensors, str(out), metadata=metadata)
    fsync_path(out)


def load_rng(path: Path, shuffle: random.Random) -> None:
    """Restore what `save_rng` saved; `shuffle` takes the saved mini-batch generator's state."""
    import torch
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has keys(), no iteration)
    torch.set_rng_state(tensors["torch_cpu"])
    if "torch_cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["torch_cuda"])
    random.setstate(_state_from_json(metadata["python"]))
    if "shuffle" in metadata:
        shuffle.setstate(_state_from_json(metadata["shuffle"]))
    else:  # saved before the shuffle generator was: it goes on from where this process has it
        log.warning(
            "%s holds no mini-batch shuffle state; the resumed run's mini-batches "
            "differ from the uninterrupted run's",
            path,
        )


# --- saving ---------------------------------------------------------------------------------------
def state_options(model: Any) -> Any:
    """What a checkpoint holds of the model: every parameter, or, when some are frozen (LoRA,
    `learner.lora`), the trainable ones only. The frozen base is the base model's files, read
    again at start, so a LoRA checkpoint is the adapters and their optimizer state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def trainable_state(model: Any, model_sd: dict[str, Any]) -> dict[str, Any]:
    """`model_sd` without frozen parameters. `ignore_frozen_params` alone keeps a tied output
    head (`lm_head.weight`, the frozen input embedding under a second name): 113 MB of base
    weights in every SmolLM2 LoRA checkpoint."""
    if all(p.requires_grad for p in model.parameters()):
        return model_sd
    trainable = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    return {k: v for k, v in model_sd.items() if k in trainable}


def save_checkpoint(
    root: Path,
    step: int,
    *,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    shuffle: random.Random,
    rank: int,
    meta: dict[str, Any],
    hf_export: Callable[[Path], None] | None,
    barrier: Callable[[], Any],
    keep: bool = False,
) -> Path:
    """Write step_<step>/ on every rank (all call this); rank 0 commits. `hf_export(dir)` runs on
    rank 0 only.

    `shuffle` is the trainer's mini-batch generator (saved with the RNG states).
    `barrier()` synchronises the learner ranks (torch.distributed.barrier); `keep` exempts the
    checkpoint from retention. Until rank 0's rename nothing named step_<step> exists (an earlier
    checkpoint of the same step stays whole until then).
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    tmp = temp_step_dir(root, step)
    if rank == 0:
        if tmp.exists():  # a crashed attempt at this step
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer, options=state_options(model))
    model_sd = trainable_state(model, model_sd)
    save(
        {"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "state")
    )  # fsyncs its files
    rng_file(tmp, rank).parent.mkdir(exist_ok=True)
    save_rng(rng_file(tmp, rank), shuffle)
    if rank == 0:
        full_meta = {
            **meta,
            "step": step,
            "scheduler": scheduler.state_dict(),
            "saved_at": time.time(),
        }
        write_durable(tmp / "trainer.json", json.dumps(full_meta, indent=1).encode())
        if hf_export is not None:
            hf_export(tmp / HF_EXPORT)
        if keep:
            write_durable(tmp / KEEP, b"")
    barrier()
    digests = _hash_for_manifest(tmp, rank)
    if rank == 0:
        write_manifest(tmp, step, digests)
        write_durable(tmp / MARKER, str(time.time()).encode())
        fsync_tree(tmp)
        commit_dir(tmp, step_dir(root, step))
        log.info("checkpoint step %d committed at %s", step, step_dir(root, step))
    barrier()
    return step_dir(root, step)


def _hash_for_manifest(tmp: Path, rank: int) -> dict[str, FileDigest]:
    """Every rank hashes (and fsyncs) its share of the files; rank 0 gets them all, and hashes
    itself any file its own listing shows that no rank hashed (listings that differ for a moment
    on a shared filesystem). Only rank 0's result is complete."""
    sizes, problems = hashed_files(tmp)
    if problems and rank == 0:  # never written by this module; refused at load, so not committed
        raise CheckpointRefused(f"not committing {tmp}: " + "; ".join(problems))
    mine = assign(sizes, _world_size())[rank]
    digests = dict(zip(mine, _digests(tmp, mine), strict=True))
    merged: dict[str, FileDigest] = {}
    for part in _all_gather(digests):
        merged |= part
    if rank == 0:
        missed = sorted(sizes.keys() - merged.keys())
        merged |= dict(zip(missed, _digests(tmp, missed), strict=True))
    return merged


def _digests(path: Path, names: list[str]) -> list[FileDigest]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        return list(pool.map(lambda n: file_digest(path / n, sync=True), names))


# --- loading --------------------------------------------------------------------------------------
def verify_checkpoint(path: Path, rank: int) -> None:
    """Every rank: check `path` against its manifest before anything in it is loaded; raises
    CheckpointRefused on every rank, naming the files, when it has no manifest or any file differs.

    Reads each file once (hashing it), split over the ranks by size; the ranks also check that
    they read the same manifest."""
    try:
        manifest, manifest_sha = read_manifest(path)
    except CheckpointRefused as exc:
        problems, manifest_sha = [str(exc)], ""
    else:
        problems, sizes = check_listing(path, manifest)
        mine = assign(sizes, _world_size())[rank]
        problems += verify_files(path, manifest, mine, threads=HASH_THREADS)
    verdicts = _all_gather((manifest_sha, problems))
    found = list(dict.fromkeys(p for _, ps in verdicts for p in ps))  # in order, once each
    if len({sha for sha, _ in verdicts}) > 1:
        found.append("the ranks read different manifest.json files")
    if found:
        raise CheckpointRefused(f"refusing checkpoint {path}: {describe_problems(found)}")


def load_checkpoint(
    path: Path, *, rank: int, model: Any, optimizer: Any, scheduler: Any, shuffle: random.Random
) -> dict[str, Any]:
    """Verify, then restore model, optimizer, scheduler and RNG, the mini-batch `shuffle`
    generator's included (every rank); returns trainer.json.

    A rank with no RNG file of its own (the run resumed on more ranks than it saved)
    takes rank 0's."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    from learner.dcp_reader import SafeLoadPlanner, SafeMetadataReader

    verify_checkpoint(path, rank)
    meta = read_trainer_state(path, scheduler.state_dict())
    options = state_options(model)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state: dict[str, Any] = {"model": trainable_state(model, model_sd), "optim": optim_sd}
    reader = SafeMetadataReader(
        str(path / "state")
    )  # nothing in the files can run code (learner/dcp_reader.py)
    reader.read_metadata()  # first on its own: DCP's load would wrap a refusal in its own exception
    load(state, storage_reader=reader, planner=SafeLoadPlanner())
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=options,
    )
    scheduler.load_state_dict(meta["scheduler"])
    own = rng_file(path, rank)
    load_rng(own if own.exists() else rng_file(path, 0), shuffle)
    return meta


def _kind(value: object) -> str:
    """The JSON kind of a value, numbers as one (a float saved as 0.0 may come back as 0)."""
    if isinstance(value, bool) or value is None:
        return type(value).__name__
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, list):
        return "list[" + ",".join(sorted({_kind(v) for v in value})) + "]"
    return type(value).__name__


def read_trainer_state(path: Path, scheduler_state: dict[str, Any]) -> dict[str, Any]:
    """trainer.json of a verified checkpoint, refused (CheckpointRefused, naming the file) unless
    it is an object whose `scheduler` has only keys of this scheduler's own state, each with the
    same kind of value: a scheduler's `load_state_dict` sets every key it is given as an
    attribute, so a planted one (its optimizer, a method) would reach training. A key it lacks
    (a state saved by another torch version) keeps this scheduler's value."""
    where = path / "trainer.json"
    try:
        meta = json.loads(where.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointRefused(f"{where} does not read as JSON ({exc}): refused") from None
    got = meta.get("scheduler") if isinstance(meta, dict) else None
    if not isinstance(got, dict):
        raise CheckpointRefused(f"{where} holds no scheduler state: refused")
    foreign = sorted(set(got) - set(scheduler_state))
    if foreign:
        raise CheckpointRefused(
            f"{where}: the scheduler state has keys {foreign}, which this scheduler's has not: "
            "refused"
        )
    for key, value in scheduler_state.items():
        if key in got and _kind(got[key]) != _kind(value) and None not in (value, got[key]):
            raise CheckpointRefused(
                f"{where}: the scheduler's {key} is a {_kind(got[key])}, not a {_kind(value)}: "
                "refused"
            )
    result: dict[str, Any] = meta
    return result


class CheckpointStore(Protocol):
    def latest_step(self) -> int | None: ...

    def save(
        self, step: int, meta: dict[str, Any], *, keep: bool, hf_export: Callable[[Path], None]
    ) -> Path: ...

    def load(self, step: int) -> dict[str, Any] | None: ...


class Checkpoints:
    """The learner's checkpoints (every rank): save with retention, load, find the newest.

    At its first use (the loop's start asks for the newest step) rank 0 removes what a crashed
    learner left half written or half deleted. Not in the constructor: the learner builds this
    before rank 0 takes the learner lease, and a learner that then finds another one running must
    not have deleted that one's `.tmp-` directory. Other ranks write only after a save's barrier."""

    def __init__(
        self,
        root: Path,
        *,
        trainer: TrainState,
        rank: int,
        keep_last: int,
        save_hf: bool,
        barrier: Callable[[], Any],
    ) -> None:
        self.root, self.trainer, self.rank = Path(root), trainer, rank
        self.keep_last, self.save_hf, self.barrier = keep_last, save_hf, barrier
        self._cleaned = rank != 0

    def _clean_once(self) -> None:
        if not self._cleaned:
            self._cleaned = True
            if stale := clean_stale(self.root):
                log.warning("removed checkpoint directories a crashed learner left: %s", stale)

    def latest_step(self) -> int | None:
        self._clean_once()
        latest = latest_checkpoint(self.root)
        return None if latest is None else latest.step

    def save(
        self, step: int, meta: dict[str, Any], *, keep: bool, hf_export: Callable[[Path], None]
    ) -> Path:
        self._clean_once()
        t = self.trainer
        path = save_checkpoint(
            self.root,
            step,
            model=t.model,
            optimizer=t.optimizer,
            scheduler=t.scheduler,
            shuffle=t.rng,
            rank=self.rank,
            meta=meta,
            hf_export=hf_export if self.save_hf else None,
            barrier=self.barrier,
            keep=keep,
        )
        if self.rank == 0:
            removed = apply_retention(self.root, self.keep_last)
            if removed:
                log.info("retention removed checkpoints %s", removed)
        return path

    def load(self, step: int) -> dict[str, Any] | None:
        """trainer.json of checkpoint `step` after loading it, or None when it is gone; raises
        CheckpointRefused when its files do not match its manifest. The steps newer than `step`
        are then moved to the store's `abandoned/` (a restore's abandoned line; none at a resume
        from the newest). A crash between the load and that move resumes the newest step again."""
        self._clean_once()
        info: CheckpointInfo | None = get_checkpoint(self.root, step)
        if info is None:
            return None
        t = self.trainer
        meta = load_checkpoint(
            info.path,
            rank=self.rank,
            model=t.model,
            optimizer=t.optimizer,
            scheduler=t.scheduler,
            shuffle=t.rng,
        )
        if self.rank == 0 and (retired := retire_newer(self.root, step)):
            log.warning(
                "restored step %d: moved the newer steps %s to %s/abandoned/",
                step,
                retired,
                self.root,
            )
        return meta
