"""A rollout replica loads from the checkpoint store only an `hf/` export that matches its
checkpoint's manifest: a damaged newest checkpoint is refused (logged with its step and file,
counted once), and the replica loads the newest older one that verifies, else the base model.

Real transformers engine on a tiny model built from a config, checkpoints written with the
store's own manifest functions (those the learner commits with), a real Redis for the counters.
Each checkpoint's export holds the base weights plus its step number, so the weights the engine
holds after a load say which checkpoint it loaded.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from contracts.bus import StreamBus, connect
from contracts.checkpoint_store import (
    MANIFEST,
    MARKER,
    file_digest,
    hashed_files,
    verify_subtree,
    write_manifest,
)
from contracts.keys import Counter, Keys
from contracts.runtime import StopFlag
from rollout import weight_receiver
from rollout.hf_engine import HFEngine
from rollout.weight_receiver import WeightReceiver, model_param_shapes
from tests.helpers import WEIGHTS_KEY

WEIGHTS = "model.safetensors"


class RecordingEngine(HFEngine):
    """The transformers engine, noting each directory it loads."""

    def __init__(self, model_dir: str) -> None:
        super().__init__(model_dir, seed=0)
        self.loaded: list[str] = []

    def load_weights_from_dir(self, path: str) -> None:
        super().load_weights_from_dir(path)
        self.loaded.append(path)


@pytest.fixture()
def bus(redis_url: str) -> StreamBus:
    return StreamBus(connect(redis_url), Keys(f"verify-{time.monotonic_ns()}"), consumer="c1")


@pytest.fixture()
def engine(tiny_model_dir: Path) -> RecordingEngine:
    return RecordingEngine(str(tiny_model_dir))


def subscriber(bus: StreamBus, engine: RecordingEngine, store: Path, base: Path) -> WeightReceiver:
    return WeightReceiver(
        bus,
        engine,
        "r0",
        checkpoint_dir=store,
        base_model_path=str(base),
        lost_contact_s=0.0,
        max_staleness=1,
        stop=StopFlag(),
        key=WEIGHTS_KEY,
        expected=model_param_shapes(str(base)),
    )


def commit(store: Path, step: int, base: Path) -> Path:
    """Checkpoint `step` as the learner lays it out: an `hf/` export (the base model's config and
    tokenizer, its weights + `step`), trainer.json (policy version = step), a state file, the
    manifest of them all, then the COMMITTED marker."""
    path = store / f"step_{step}"
    shutil.copytree(base, path / "hf")
    save_file(
        {n: t + step for n, t in load_file(base / WEIGHTS).items()},
        path / "hf" / WEIGHTS,
        metadata={"format": "pt"},
    )
    (path / "trainer.json").write_text(json.dumps({"step": step, "policy_version": step}))
    (path / "state").mkdir()
    (path / "state" / "__0_0.distcp").write_bytes(bytes(range(256)))
    sizes, problems = hashed_files(path)
    assert not problems
    write_manifest(path, step, {name: file_digest(path / name) for name in sizes})
    (path / MARKER).write_text(str(time.time()))
    return path


def holds(engine: HFEngine, base: Path, shift: int) -> bool:
    """The engine's weights are the base model's + `shift` (0: the base model itself)."""
    state = engine.model.state_dict()
    return all(torch.allclose(state[n], t + shift) for n, t in load_file(base / WEIGHTS).items())


def flip_last_byte(path: Path) -> None:
    """A one-byte change in the tensor data: safetensors still loads it, silently wrong."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def symlink_to_a_copy(path: Path) -> None:
    """The same bytes, but reached through a symlink out of the checkpoint."""
    outside = path.parent.parent.parent / f"outside-{path.name}"
    shutil.copy(path, outside)
    path.unlink()
    path.symlink_to(outside)


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    # name: (what is done to the checkpoint's directory, the file the refusal must name)
    "one byte of the weights changed": (
        lambda p: flip_last_byte(p / "hf" / WEIGHTS),
        f"hf/{WEIGHTS}",
    ),
    "a byte appended to the weights": (
        lambda p: p.joinpath("hf", WEIGHTS).open("ab").write(b"\0"),
        f"hf/{WEIGHTS}",
    ),
    "a file added to hf/": (
        lambda p: (p / "hf" / "extra.safetensors").write_bytes(b"x"),
        "hf/extra.safetensors",
    ),
    "a file of hf/ missing": (
        lambda p: (p / "hf" / "generation_config.json").unlink(),
        "hf/generation_config.json",
    ),
    "a symlink in hf/": (lambda p: symlink_to_a_copy(p / "hf" / "config.json"), "hf/config.json"),
    "no manifest": (lambda p: (p / MANIFEST).unlink(), MANIFEST),
}


def test_a_clean_newest_checkpoint_loads(
    bus: StreamBus, engine: RecordingEngine, tiny_model_dir: Path, tmp_path: Path
) -> None:
    store = tmp_path / "ckpt"
    commit(store, 1, tiny_model_dir)
    newest = commit(store, 2, tiny_model_dir)
    sub = subscriber(bus, engine, store, tiny_model_dir)
    sub.load_published()
    assert engine.loaded == [str(newest / "hf")] and sub.policy_version == 2
    assert holds(engine, tiny_model_dir, 2)
    assert Counter.REPLICA_REFUSED_CHECKPOINTS not in bus.counters()


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newest_checkpoint_is_refused_and_the_previous_one_loaded(
    bus: StreamBus,
    engine: RecordingEngine,
    tiny_model_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    damage: str,
) -> None:
    store = tmp_path / "ckpt"
    good = commit(store, 1, tiny_model_dir)
    spoil, named = DAMAGE[damage]
    spoil(commit(store, 2, tiny_model_dir))
    sub = subscriber(bus, engine, store, tiny_model_dir)
    with caplog.at_level(logging.ERROR):
        sub.load_published()
    assert engine.loaded == [str(good / "hf")] and sub.policy_version == 1
    assert holds(engine, tiny_model_dir, 1)
    assert bus.counters().get(Counter.REPLICA_REFUSED_CHECKPOINTS) == 1
    [refusal] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "checkpoint step 2" in refusal and named in refusal


def test_with_every_checkpoint_damaged_the_base_model_is_loaded(
    bus: StreamBus,
    engine: RecordingEngine,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    store = tmp_path / "ckpt"
    flip_last_byte(commit(store, 1, tiny_model_dir) / "hf" / WEIGHTS)
    (commit(store, 2, tiny_model_dir) / "hf" / "extra.json").write_text("{}")
    sub = subscriber(bus, engine, store, tiny_model_dir)
    engine.load_weights_from_dir(
        str(store / "step_2" / "hf")
    )  # held before a broadcast failed half-way
    sub.load_published()
    assert engine.loaded[-1] == str(tiny_model_dir) and sub.policy_version == 0
    assert holds(engine, tiny_model_dir, 0)
    assert bus.counters().get(Counter.REPLICA_REFUSED_CHECKPOINTS) == 2


def test_damage_outside_hf_does_not_stop_a_replica(
    bus: StreamBus, engine: RecordingEngine, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A replica verifies only what it reads; the learner verifies the rest before resuming."""
    store = tmp_path / "ckpt"
    newest = commit(store, 1, tiny_model_dir)
    flip_last_byte(newest / "state" / "__0_0.distcp")
    sub = subscriber(bus, engine, store, tiny_model_dir)
    sub.load_published()
    assert engine.loaded == [str(newest / "hf")] and holds(engine, tiny_model_dir, 1)
    assert Counter.REPLICA_REFUSED_CHECKPOINTS not in bus.counters()


def test_catch_up_skips_a_damaged_checkpoint_once_and_takes_the_next_good_one(
    bus: StreamBus,
    engine: RecordingEngine,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = tmp_path / "ckpt"
    commit(store, 1, tiny_model_dir)
    sub = subscriber(bus, engine, store, tiny_model_dir)
    sub.load_published()
    assert sub.policy_version == 1
    flip_last_byte(commit(store, 2, tiny_model_dir) / "hf" / WEIGHTS)
    bus.set_policy_version(9)  # the replica is out of contact and far behind

    # Never a regression: step 1 verifies but is what the replica already holds.
    assert not sub.catch_up()
    assert sub.policy_version == 1 and holds(engine, tiny_model_dir, 1) and len(engine.loaded) == 1
    assert bus.counters().get(Counter.REPLICA_REFUSED_CHECKPOINTS) == 1

    hashed: list[str] = []

    def recorded_verify(path: Path, under: str) -> list[str]:
        hashed.append(path.name)
        return verify_subtree(path, under)

    monkeypatch.setattr(weight_receiver, "verify_subtree", recorded_verify)
    assert not sub.catch_up()  # the refused step is neither hashed nor counted again
    assert hashed == [] and bus.counters().get(Counter.REPLICA_REFUSED_CHECKPOINTS) == 1

    newest = commit(store, 3, tiny_model_dir)
    assert sub.catch_up()
    assert (
        hashed == ["step_3"] and engine.loaded[-1] == str(newest / "hf") and sub.policy_version == 3
    )
    assert holds(engine, tiny_model_dir, 3)
    assert bus.counters().get(Counter.REPLICA_STORE_CATCH_UPS) == 1
    assert bus.counters().get(Counter.REPLICA_REFUSED_CHECKPOINTS) == 1


def test_a_checkpoint_retired_while_it_is_checked_sends_the_replica_to_the_newest_one(
    bus: StreamBus,
    engine: RecordingEngine,
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Retention (keep_last 1) deletes step 2 while the replica hashes it, just after the learner
    committed step 3: not damage, and not a reason to fall back to the base model; the store is
    listed again and step 3 loaded."""
    store = tmp_path / "ckpt"
    retired = commit(store, 2, tiny_model_dir)

    def check_while_retention_runs(path: Path, under: str) -> list[str]:
        if path == retired and retired.exists():
            commit(store, 3, tiny_model_dir)
            shutil.rmtree(retired)
            return [f"{under}/{WEIGHTS}: missing"]
        return verify_subtree(path, under)

    monkeypatch.setattr(weight_receiver, "verify_subtree", check_while_retention_runs)
    sub = subscriber(bus, engine, store, tiny_model_dir)
    sub.load_published()
    assert engine.loaded == [str(store / "step_3" / "hf")] and sub.policy_version == 3
    assert holds(engine, tiny_model_dir, 3)
    assert Counter.REPLICA_REFUSED_CHECKPOINTS not in bus.counters()
