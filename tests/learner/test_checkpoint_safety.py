"""Checkpoints load without executing anything and are atomic and durable.

- A checkpoint with a planted pickle (RNG file, torch.distributed.checkpoint's `.metadata`, an
  added file) or a tampered, truncated or missing file is refused, naming the file, and the
  payload never runs; no saved file needs `torch.load(weights_only=False)`.
- Every file and directory of a step is fsynced before the rename that commits it, and the
  store directory after it (the rename itself is durable).
- A save interrupted before its rename leaves no `step_N`; a crash in the middle of a deletion
  (retention, or replacing a step saved twice) never leaves a half-deleted `step_N`; a restart
  removes the leftovers.
- A restore of step K moves the newer steps aside and K is the newest afterwards.
- Two gloo ranks (real FSDP2 trainer on the tiny model, under torch.distributed.run) write one
  checkpoint together, load it back exactly (each rank's own RNG stream), and both refuse a
  checkpoint whose rank-1 shard was changed.

Single-process tests use a two-layer model: fast, and the same torch.distributed.checkpoint code.
The multi-rank part is run by pytest; the same file is the script each rank runs."""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import re
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from bench.multirank_check import launch_ranks
from contracts.checkpoint_store import (
    ABANDONED,
    MANIFEST,
    MARKER,
    CheckpointRefused,
    list_checkpoints,
    step_dir,
    temp_step_dir,
)
from learner import checkpoint as ckpt_mod
from learner.checkpoint import Checkpoints, load_checkpoint, rng_file, verify_checkpoint

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Payload:
    """Unpickling this creates `marker`: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


def tiny_trainer(seed: int = 0) -> SimpleNamespace:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    train(SimpleNamespace(model=model, optimizer=optimizer, scheduler=scheduler))
    return SimpleNamespace(
        model=model, optimizer=optimizer, scheduler=scheduler, rng=random.Random(seed)
    )


def train(t: SimpleNamespace) -> None:
    t.model(torch.randn(3, 4)).square().sum().backward()
    t.optimizer.step()
    t.optimizer.zero_grad()
    t.scheduler.step()


def store(root: Path, trainer: SimpleNamespace, *, keep_last: int = 5) -> Checkpoints:
    return Checkpoints(
        root, trainer=trainer, rank=0, keep_last=keep_last, save_hf=True, barrier=lambda: None
    )


def export(out: Path) -> None:
    """A stand-in for the Hugging Face export: a folder of files the manifest must cover."""
    out.mkdir()
    (out / "config.json").write_text("{}")


def save(ckpt: Checkpoints, step: int, **meta: Any) -> Path:
    return ckpt.save(
        step,
        {"policy_version": step, "data_cursor": 10 * step, **meta},
        keep=False,
        hf_export=export,
    )


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


# --- loading executes nothing ---------------------------------------------------------------------
def test_saved_files_load_without_pickle_and_restore_the_rng_streams(tmp_path: Path) -> None:
    from safetensors import safe_open

    t = tiny_trainer()
    ckpt = store(tmp_path, t)
    random.seed(5)
    path = save(ckpt, 1)
    expected = (torch.rand(4), random.random(), params(t.model))
    train(t)
    files = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert files == [
        MARKER,
        "hf/config.json",
        MANIFEST,
        "rng/rank_0.safetensors",
        "state/.metadata",
        "state/__0_0.distcp",
        "trainer.json",
    ]  # no rng.pt, nothing else pickled but DCP's .metadata
    with safe_open(str(rng_file(path, 0)), framework="pt") as f:
        assert f.get_tensor("torch_cpu").dtype == torch.uint8
        assert json.loads(f.metadata()["python"])[0] == 3  # random.getstate()'s version, as JSON
    manifest = json.loads((path / MANIFEST).read_text())["files"]
    assert sorted(manifest) == [f for f in files if f not in (MARKER, MANIFEST)]

    meta = ckpt.load(1)
    assert meta is not None and meta["step"] == 1 and meta["data_cursor"] == 10
    assert torch.equal(torch.rand(4), expected[0]) and random.random() == expected[1]
    assert all(torch.equal(v, expected[2][k]) for k, v in params(t.model).items())
    assert t.scheduler.last_epoch == 1


def shuffled(rng: random.Random) -> list[int]:
    """The next permutation of 32 groups, drawn as `Trainer._mini_batches` draws it."""
    order = list(range(32))
    rng.shuffle(order)
    return order


def test_a_restored_learner_draws_the_mini_batch_shuffle_an_uninterrupted_one_would(
    tmp_path: Path,
) -> None:
    """The trainer's mini-batch generator is saved with the RNG states (JSON, no pickle): after
    a restore the next shuffle is the one the run would have drawn had it never stopped (the
    two-rank test below checks the same with the real trainer)."""
    t = tiny_trainer()
    ckpt = store(tmp_path, t)
    for _ in range(3):  # the mini-batches of a few steps
        shuffled(t.rng)
    save(ckpt, 1)
    uninterrupted = shuffled(t.rng)
    resumed = tiny_trainer()  # a fresh learner: its generator starts from the seed again
    store(tmp_path, resumed).load(1)
    assert shuffled(resumed.rng) == uninterrupted


def test_no_code_loads_with_weights_only_false() -> None:
    offenders = [
        str(p.relative_to(REPO))
        for pkg in ("learner", "services", "rollout", "reward")
        for p in (REPO / pkg).rglob("*.py")
        if "weights_only=False" in p.read_text()
    ]
    assert offenders == []


def plant_pickle(path: Path, marker: Path) -> None:
    path.write_bytes(pickle.dumps(Payload(marker)))


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


TAMPERING = {
    "pickle in the RNG file": ("rng/rank_0.safetensors", plant_pickle, "rng/rank_0.safetensors"),
    "pickle as DCP metadata": ("state/.metadata", plant_pickle, "state/.metadata"),
    "pickle added as rng.pt": ("rng.pt", plant_pickle, "rng.pt is not in manifest.json"),
    "shard truncated": (
        "state/__0_0.distcp",
        lambda p, _: p.write_bytes(p.read_bytes()[:100]),
        "state/__0_0.distcp has 100 bytes",
    ),
    "shard byte flipped": (
        "state/__0_0.distcp",
        lambda p, _: flip_a_byte(p),
        "state/__0_0.distcp does not match its SHA-256",
    ),
    "export file swapped for a link": (
        "hf/config.json",
        lambda p, _: (p.unlink(), p.symlink_to(REPO / "pyproject.toml")),
        "hf/config.json is not a regular file",
    ),
    "manifest removed": (MANIFEST, lambda p, _: p.unlink(), "manifest.json is missing"),
}


@pytest.mark.parametrize("case", list(TAMPERING))
def test_a_tampered_checkpoint_is_refused_naming_the_file_and_nothing_runs(
    tmp_path: Path, case: str
) -> None:
    target, tamper, named = TAMPERING[case]
    marker = tmp_path / "payload-ran"
    live = tmp_path / "payload-is-live"
    pickle.loads(pickle.dumps(Payload(live)))  # the payload does run when unpickled
    assert live.exists()

    t = tiny_trainer()
    ckpt = store(tmp_path / "ckpt", t)
    save(ckpt, 1)
    save(ckpt, 2)
    tamper(step_dir(ckpt.root, 1) / target, marker)
    before = params(t.model)
    with pytest.raises(CheckpointRefused, match=named.replace(".", r"\.")) as err:
        ckpt.load(1)
    assert str(step_dir(ckpt.root, 1)) in str(err.value)
    assert not marker.exists()
    assert all(torch.equal(v, before[k]) for k, v in params(t.model).items())  # nothing was loaded
    assert ckpt.latest_step() == 2  # a refused restore abandons nothing


def test_planted_metadata_runs_no_code_even_with_a_manifest_rewritten_to_match(
    tmp_path: Path,
) -> None:
    """A writer with full access to the store can plant a pickle and a manifest that agrees with
    it; the manifest check passes, and DCP's metadata reader is what stands between the pickle
    and the learner: it refuses the global the pickle names before looking it up."""
    from contracts.checkpoint_store import file_digest, hashed_files, write_manifest

    marker = tmp_path / "payload-ran"
    t = tiny_trainer()
    ckpt = store(tmp_path / "ckpt", t)
    path = save(ckpt, 1)
    plant_pickle(path / "state" / ".metadata", marker)
    (path / MANIFEST).unlink()
    sizes, problems = hashed_files(path)
    assert not problems
    write_manifest(path, 1, {name: file_digest(path / name) for name in sizes})
    before = params(t.model)
    with pytest.raises(CheckpointRefused, match=r"metadata names io\.open, which no checkpoint"):
        ckpt.load(1)
    assert not marker.exists()
    assert all(torch.equal(v, before[k]) for k, v in params(t.model).items())


METADATA_ATTACKS = {
    # A dotted name inside an allowed module reaches anything that module imports (os, operator).
    "a dotted name into an allowed module": (
        b"\x80\x04ctorch.distributed.checkpoint.filesystem\nos.system\n.",
        "names",
    ),
    "a global outside the list": (b"\x80\x04cbuiltins\neval\n.", "names builtins.eval"),
    # BUILD on a class object sets class attributes for the whole process.
    "state applied to a class": (
        b"\x80\x04ctorch.distributed.checkpoint.metadata\nMetadata\nN}\x8c\x01xK\x01s\x86b.",
        "sets attributes on the class Metadata",
    ),
    # BUILD on a function: `_get_layout.cache` is torch's layout table for the whole process.
    "state applied to torch's layout cache": (
        b"\x80\x04ctorch.serialization\n_get_layout\n}\x8c\x05cache}sb.",
        "sets state on a function, which is not a DCP record",
    ),
    # BUILD on an enum member, reached through getattr: every later checkpoint would differ.
    "state applied to an enum member": (
        b"\x80\x04cbuiltins\ngetattr\nctorch.distributed.checkpoint.metadata\n"
        b"_MEM_FORMAT_ENCODING\n\x8c\x13TORCH_CHANNELS_LAST\x86R}\x8c\x07_value_K\x09sb.",
        "sets state on a _MEM_FORMAT_ENCODING, which is not a DCP record",
    ),
    # Every other failure to unpickle is a refusal (exit 4), not a crash a retry repeats.
    "a truncated file": (b"\x80\x04ctorch\nSize\n", "does not unpickle (EOFError"),
    "an unknown opcode": (b"\x80\x04\xff.", "does not unpickle (KeyError: 255"),
    "a constructor called with garbage": (
        b"\x80\x04ctorch\nSize\n\x8c\x01x\x85\x85R.",
        "does not unpickle (TypeError",
    ),
}


class MemberByName:
    """Pickles an enum member the way Debian 12's Python 3.11 does: getattr(EnumClass, "NAME")."""

    def __init__(self, cls: Any, name: str) -> None:
        self.cls, self.name = cls, name

    def __reduce__(self) -> tuple[Any, tuple[Any, str]]:
        return (getattr, (self.cls, self.name))


def test_enum_members_pickled_by_name_load_and_nothing_else_through_getattr() -> None:
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, Metadata

    from learner.dcp_reader import MetadataUnpickler

    member = MetadataUnpickler(
        io.BytesIO(pickle.dumps(MemberByName(_MEM_FORMAT_ENCODING, "TORCH_CHANNELS_LAST")))
    ).load()
    assert member is _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST
    for cls, name in ((Metadata, "__init__"), (_MEM_FORMAT_ENCODING, "__class__")):
        with pytest.raises(CheckpointRefused, match="looks up"):
            MetadataUnpickler(io.BytesIO(pickle.dumps(MemberByName(cls, name)))).load()


@pytest.mark.parametrize("attack", list(METADATA_ATTACKS))
def test_the_metadata_unpickler_refuses_what_no_checkpoint_holds(attack: str) -> None:
    from learner.dcp_reader import MetadataUnpickler

    payload, named = METADATA_ATTACKS[attack]
    with pytest.raises(CheckpointRefused, match=re.escape(named)):
        MetadataUnpickler(io.BytesIO(payload)).load()


def test_storage_files_outside_the_state_directory_and_unsafe_items_are_refused(
    tmp_path: Path,
) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    from learner.dcp_reader import SafeLoadPlanner, _check_storage_files

    for path in ("../../etc/passwd", "/etc/passwd", "..", "sub/__0_0.distcp"):
        with pytest.raises(CheckpointRefused, match="points at the storage file"):
            _check_storage_files(
                Metadata(
                    state_dict_metadata={},
                    storage_data={MetadataIndex("w"): _StorageInfo(path, 0, 1)},
                )
            )
    _check_storage_files(
        Metadata(
            state_dict_metadata={},
            storage_data={MetadataIndex("w"): _StorageInfo("__0_0.distcp", 0, 1)},
        )
    )

    # A non-tensor item (how DCP stores optimizer hyper-parameters) that is not a plain value.
    marker = tmp_path / "payload-ran"
    buf = io.BytesIO()
    torch.save({"lr": Payload(marker)}, buf)
    buf.seek(0)
    item = SimpleNamespace(dest_index=SimpleNamespace(fqn="optim.param_groups.0.lr"))
    with pytest.raises(CheckpointRefused, match=re.escape("optim.param_groups.0.lr")):
        SafeLoadPlanner().load_bytes(item, buf)  # type: ignore[arg-type]
    assert not marker.exists()


def test_verification_runs_before_the_pickled_metadata_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The order matters more than the hashes: verification must come before DCP's reader."""
    t = tiny_trainer()
    ckpt = store(tmp_path, t)
    path = save(ckpt, 1)
    from learner.dcp_reader import SafeMetadataReader as FileSystemReader

    calls: list[str] = []
    real_verify, real_read = ckpt_mod.verify_checkpoint, FileSystemReader.read_metadata

    def verify(path: Path, rank: int) -> None:
        calls.append("verify")
        real_verify(path, rank)

    def read_metadata(self: FileSystemReader, *args: Any, **kwargs: Any) -> Any:
        calls.append("read_metadata")
        return real_read(self, *args, **kwargs)

    monkeypatch.setattr(ckpt_mod, "verify_checkpoint", verify)
    from learner.dcp_reader import MetadataUnpickler

    real_unpickle = MetadataUnpickler.load

    def unpickle(self: MetadataUnpickler) -> Any:
        calls.append("unpickle")
        return real_unpickle(self)

    monkeypatch.setattr(FileSystemReader, "read_metadata", read_metadata)
    monkeypatch.setattr(MetadataUnpickler, "load", unpickle)
    load_checkpoint(
        path, rank=0, model=t.model, optimizer=t.optimizer, scheduler=t.scheduler, shuffle=t.rng
    )
    assert calls[:3] == ["verify", "read_metadata", "unpickle"]
    assert calls.count("unpickle") == 1 < calls.count("read_metadata")  # read twice, unpickled once


# --- atomic and durable ---------------------------------------------------------------------------
def fail(*_: Any, **__: Any) -> None:
    raise OSError("simulated crash")


@pytest.mark.parametrize("where", ["while writing", "just before the rename"])
def test_an_interrupted_save_leaves_no_step_and_the_previous_stays_newest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    t = tiny_trainer()
    ckpt = store(tmp_path, t)
    save(ckpt, 1)
    with monkeypatch.context() as m:
        if where == "while writing":
            with pytest.raises(OSError, match="simulated"):
                ckpt.save(2, {"policy_version": 2, "data_cursor": 20}, keep=False, hf_export=fail)
        else:
            m.setattr(ckpt_mod, "commit_dir", fail)
            with pytest.raises(OSError, match="simulated"):
                save(ckpt, 2)
            assert (
                temp_step_dir(tmp_path, 2) / MARKER
            ).exists()  # complete, marker and all, yet not listed
    assert not step_dir(tmp_path, 2).exists()
    assert [c.step for c in list_checkpoints(tmp_path)] == [1] and ckpt.latest_step() == 1

    restarted = store(tmp_path, t)
    assert restarted.latest_step() == 1  # the learner's next start asks, and removes the leftover
    assert not temp_step_dir(tmp_path, 2).exists()
    save(restarted, 2)
    assert restarted.latest_step() == 2
    verify_checkpoint(step_dir(tmp_path, 2), 0)


class Crash(BaseException):
    """The process dying: nothing catches it (a SIGKILL would not even raise)."""


def crash_mid_delete(path: str | Path, *_: Any, **__: Any) -> None:
    """Delete part of a directory (DCP's metadata first), then crash."""
    (Path(path) / "state" / ".metadata").unlink()
    raise Crash


def fail_to_delete(path: str | Path, *_: Any, **__: Any) -> None:
    raise OSError("Directory not empty: a file held open on a network filesystem")


def test_retention_crashing_mid_delete_leaves_no_half_deleted_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = tiny_trainer()
    ckpt = store(tmp_path, t, keep_last=2)
    save(ckpt, 1)
    save(ckpt, 2)
    with monkeypatch.context() as m:
        m.setattr(shutil, "rmtree", crash_mid_delete)
        with pytest.raises(Crash):
            save(ckpt, 3)  # committed, then retention deletes step 1
    assert not step_dir(tmp_path, 1).exists()
    assert [c.step for c in list_checkpoints(tmp_path)] == [2, 3]
    for c in list_checkpoints(tmp_path):
        verify_checkpoint(c.path, 0)
    assert [p.name.split("-")[0] for p in tmp_path.iterdir() if p.name.startswith(".")] == [
        ".trash"
    ]

    assert store(tmp_path, t).latest_step() == 3  # a restart removes the half-deleted one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_3"]


def test_a_failed_deletion_does_not_fail_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint is committed and the old one out of the listing; what could not be deleted
    waits for the next start."""
    t = tiny_trainer()
    ckpt = store(tmp_path, t, keep_last=1)
    save(ckpt, 1)
    with monkeypatch.context() as m:
        m.setattr(shutil, "rmtree", fail_to_delete)
        save(ckpt, 2)
    assert [c.step for c in list_checkpoints(tmp_path)] == [2]
    store(tmp_path, t).latest_step()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2"]


def test_saving_a_step_again_never_deletes_the_committed_one_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same step saved twice (a periodic save, then an operator's) replaces it whole."""
    t = tiny_trainer()
    ckpt = store(tmp_path, t)
    save(ckpt, 2)
    with monkeypatch.context() as m:
        m.setattr(shutil, "rmtree", crash_mid_delete)
        with pytest.raises(Crash):
            save(
                ckpt, 2, data_cursor=21
            )  # the old copy is deleted only after the new one is in place
    verify_checkpoint(step_dir(tmp_path, 2), 0)
    meta = ckpt.load(2)
    assert meta is not None and meta["data_cursor"] == 21


class DiskJournal:
    """Wraps os.fsync, os.rename and os.replace (the real ones still run) and logs, in call order,
    ("fsync", path synced) and ("rename", source, destination); paths are absolute and resolved."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, ...]] = []
        real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

        def fsync(fd: Any) -> None:
            number = fd if isinstance(fd, int) else fd.fileno()
            self.events.append(("fsync", os.readlink(f"/proc/self/fd/{number}")))
            real_fsync(fd)

        def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            self.events.append(("rename", str(Path(src).resolve()), str(Path(dst).resolve())))
            real_rename(src, dst, *args, **kwargs)

        def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            self.events.append(("rename", str(Path(src).resolve()), str(Path(dst).resolve())))
            real_replace(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "rename", rename)
        monkeypatch.setattr(os, "replace", replace)

    @staticmethod
    def synced(events: list[tuple[str, ...]]) -> set[str]:
        return {e[1] for e in events if e[0] == "fsync"}


def test_every_file_and_directory_is_fsynced_before_the_rename_that_commits_the_step(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A power cut after the rename must not leave a listed `step_N` whose files or directory
    entries were still in the page cache: everything under `.tmp-step_N` reaches the disk first,
    then the store directory (holding the new name) right after the rename."""
    root = tmp_path.resolve()
    ckpt = store(root, tiny_trainer())
    journal = DiskJournal(monkeypatch)
    final = ckpt.save(1, {"policy_version": 1, "data_cursor": 10}, keep=True, hf_export=export)
    tmp = temp_step_dir(root, 1)
    commit = ("rename", str(tmp), str(final))
    assert journal.events.count(commit) == 1, journal.events
    at = journal.events.index(commit)
    before, after = journal.synced(journal.events[:at]), journal.synced(journal.events[at + 1 :])

    files = sorted(p.relative_to(final).as_posix() for p in final.rglob("*") if p.is_file())
    assert {
        MARKER,
        MANIFEST,
        "keep",
        "trainer.json",
        "hf/config.json",
        "rng/rank_0.safetensors",
        "state/.metadata",
    } <= set(files)
    dirs = sorted(p.relative_to(final).as_posix() for p in final.rglob("*") if p.is_dir())
    assert dirs == ["hf", "rng", "state"]
    assert [f for f in files if str(tmp / f) not in before] == []
    assert [d for d in dirs if str(tmp / d) not in before] == []
    assert str(tmp) in before  # the step directory's own entries (its files' names)
    assert str(root) in after  # the store directory: makes the new name `step_1` durable


# --- a restore abandons the newer line ------------------------------------------------------------
def test_a_second_learner_deletes_nothing_before_it_is_used(tmp_path: Path) -> None:
    """Constructed before the learner lease is taken: a learner refused the lease must not have
    removed the running learner's checkpoint in progress."""
    t = tiny_trainer()
    in_progress = temp_step_dir(tmp_path, 7)
    in_progress.mkdir(parents=True)
    store(tmp_path, t)
    assert in_progress.exists()


def test_a_restore_moves_the_newer_steps_aside(tmp_path: Path) -> None:
    t = tiny_trainer()
    ckpt = store(tmp_path, t)
    for step in (1, 2, 3):
        save(ckpt, step)
        train(t)
    meta = ckpt.load(1)
    assert meta is not None and meta["step"] == 1
    assert ckpt.latest_step() == 1
    assert store(tmp_path, t).latest_step() == 1  # the next restart resumes step 1, not 3
    [line] = (tmp_path / ABANDONED).iterdir()
    assert line.name.endswith("after-step_1")
    assert sorted(p.name for p in line.iterdir()) == ["step_2", "step_3"]  # moved, not deleted
    for p in line.iterdir():
        verify_checkpoint(p, 0)
    save(ckpt, 2)  # the new line's step 2 is its own
    assert [c.step for c in list_checkpoints(tmp_path)] == [1, 2]


# --- several ranks --------------------------------------------------------------------------------
def test_two_ranks_write_one_checkpoint_load_it_and_refuse_a_changed_shard(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    launch_ranks(
        __file__, 2, str(tiny_model_dir), str(tmp_path)
    )  # raises with the ranks' output if one fails
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    manifest = json.loads((tmp_path / "ckpt" / "step_1" / MANIFEST).read_text())["files"]
    assert {
        "state/__0_0.distcp",
        "state/__1_0.distcp",
        "rng/rank_0.safetensors",
        "rng/rank_1.safetensors",
    } <= set(manifest)
    for r in results:
        assert "state/__1_0.distcp does not match its SHA-256" in r["refused"]
        assert r["params_restored"] and r["rng_restored"] and r["latest_after_restore"] == 1
        assert r["shuffle_restored"]  # the trainer's mini-batch generator too
    assert results[0]["rng_draw"] != results[1]["rng_draw"]  # each rank resumed its own stream
    assert not (tmp_path / "ckpt" / "step_2").exists()


def _rank_main(model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from contracts.config import load_config
    from learner.trainer import Trainer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    cfg = load_config(REPO / "configs" / "tiny.yaml", [f"model.path={model_dir}"])
    trainer = Trainer(cfg, rank=rank, world_size=dist.get_world_size(), backend="gloo")
    root = Path(out) / "ckpt"
    ckpt = Checkpoints(
        root, trainer=trainer, rank=rank, keep_last=3, save_hf=False, barrier=dist.barrier
    )

    def step_params() -> dict[str, torch.Tensor]:
        for p in trainer.model.parameters():
            p.grad = torch.ones_like(p)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad()
        return {n: t.clone() for n, t in trainer.named_full_params()}

    saved = step_params()
    shuffled(trainer.rng)
    ckpt.save(1, {"policy_version": 1, "data_cursor": 10}, keep=False, hf_export=export)
    draw, next_shuffle = torch.rand(3), shuffled(trainer.rng)
    step_params()
    ckpt.save(2, {"policy_version": 2, "data_cursor": 20}, keep=False, hf_export=export)
    if rank == 0:
        flip_a_byte(root / "step_2" / "state" / "__1_0.distcp")
    dist.barrier()
    try:
        ckpt.load(2)
        refused = ""
    except CheckpointRefused as exc:
        refused = str(exc)
    ckpt.load(1)
    restored = {n: t for n, t in trainer.named_full_params()}
    result = {
        "refused": refused,
        "latest_after_restore": ckpt.latest_step(),
        "rng_draw": draw.tolist(),
        "rng_restored": torch.equal(torch.rand(3), draw),
        "shuffle_restored": shuffled(trainer.rng) == next_shuffle,
        "params_restored": all(torch.equal(restored[n], saved[n]) for n in saved),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # no rank leaves (closing its sockets) while another still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":  # one rank, under launch_ranks: --worker MODEL_DIR OUT
    _rank_main(sys.argv[2], sys.argv[3])


def test_a_planted_trainer_json_is_refused_naming_it(tmp_path: Path) -> None:
    """trainer.json reaches the scheduler's `load_state_dict`, which sets every key as an
    attribute: an insider who rewrote it (and the manifest) cannot plant one, change a value's
    kind, or get past the refusal with a file that is not JSON."""
    import torch

    from contracts.checkpoint_store import CheckpointRefused
    from learner.checkpoint import read_trainer_state

    model = torch.nn.Linear(2, 2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        torch.optim.AdamW(model.parameters()), lambda step: 1.0
    )
    state = scheduler.state_dict()
    path = tmp_path / "trainer.json"

    def refused(text: str) -> str:
        path.write_text(text)
        with pytest.raises(CheckpointRefused) as caught:
            read_trainer_state(tmp_path, state)
        assert str(path) in str(caught.value)
        return str(caught.value)

    good = {"step": 3, "scheduler": json.loads(json.dumps(state))}
    path.write_text(json.dumps(good))
    assert read_trainer_state(tmp_path, state)["step"] == 3
    assert "does not read as JSON" in refused("{not json")
    assert "holds no scheduler state" in refused(json.dumps({"step": 3}))
    planted = {**good["scheduler"], "optimizer": {"param_groups": []}}
    assert "keys ['optimizer']" in refused(json.dumps({**good, "scheduler": planted}))
    retyped = {**good["scheduler"], "base_lrs": "1e9"}
    assert "base_lrs is a str, not a list[number]" in refused(
        json.dumps({**good, "scheduler": retyped})
    )
