"""End to end with LoRA (`learner.lora`): `dapo run` on the tiny preset, the learner training
adapters only and the replicas receiving adapters only; then `--resume` from the adapter
checkpoint. Learning is measured by `bench/lora.py`, not here; two ranks taking the same LoRA
step as one is `tests/learner/test_multirank.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from contracts.lora import ADAPTER_CONFIG, read_adapter
from tests.e2e.test_tiny_run import REPO, run_dapo

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("tiny_cache")]

LORA = ["learner.lora.enabled=true", "learner.lora.rank=8", "learner.lr=1.0e-3"]


def test_lora_run_trains_syncs_and_resumes_adapters_only(tmp_path: Path) -> None:
    out = tmp_path / "run"
    common = [*LORA, "eval.every_steps=0", "checkpoint.every_steps=3"]
    summary = run_dapo(out, *common, "learner.total_steps=6")
    assert summary["steps"] == 6 and summary["learner_exit_code"] == 0
    ledger = summary["ledger"]
    assert ledger["balanced"] and ledger["in_flight"] == 0 and ledger["trained"] == 6 * 16
    assert set(summary["replica_final_versions"].values()) == {6}
    assert summary["counters"].get("weight_sync_failures", 0) == 0

    # The export is a peft adapter: no base weights, every adapter trained (B left zero).
    final = out / "final_model"
    assert (final / ADAPTER_CONFIG).is_file() and not (final / "model.safetensors").exists()
    adapters = read_adapter(final)
    assert adapters and all(t.any() for n, t in adapters.items() if ".lora_B." in n)
    # A checkpoint holds the adapters and their optimizer state, not the 1.2M-parameter base.
    base_bytes = (REPO / "runs/cache/tiny-qwen2-arith-v3/model.safetensors").stat().st_size
    state = out / "checkpoints" / "step_6" / "state"
    assert sum(f.stat().st_size for f in state.iterdir()) < base_bytes / 2

    resumed = run_dapo(out, *common, "learner.total_steps=8", "--resume")
    assert resumed["steps"] == 8 and resumed["ledger"]["balanced"]
    # (the first run's replica keeps its final record, at 6, in the run's Redis)
    assert max(resumed["replica_final_versions"].values()) == 8
    after = load_file(final / "adapter_model.safetensors")
    before = load_file(out / "checkpoints" / "step_6" / "hf" / "adapter_model.safetensors")
    assert set(after) == set(before) and any(not torch.equal(after[k], before[k]) for k in after)
