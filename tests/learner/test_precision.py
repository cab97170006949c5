"""The learner's compute dtype (`learner.mixed_precision`, issue 39): bf16 compute follows the
fp32 step, the master weights, optimizer state, checkpoints and published weights stay fp32, and
`native` / `auto` pick bf16 only where the device computes it natively."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import learner.precision
from learner.batch import TrainBatch, build_batch
from learner.checkpoint import save_checkpoint
from learner.dcp_reader import SafeMetadataReader
from learner.precision import mixed_precision
from learner.trainer import Trainer
from tests.learner.test_trainer import config, make_groups, params, record_gradients

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def process_group(one_rank_group: None) -> None:
    """Every test here builds a trainer: one gloo rank for the module."""


def trainer_with(model_dir: Path, setting: str, *overrides: str) -> Trainer:
    torch.manual_seed(0)
    trainer = Trainer(
        config(model_dir, f"learner.mixed_precision={setting}", *overrides),
        rank=0,
        world_size=1,
        backend="gloo",
    )
    trainer.rng = random.Random(0)
    return trainer


def flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.flatten() for t in tensors.values()])


def off_policy_batch(trainer: Trainer) -> TrainBatch:
    """Four groups generated one version back, with behaviour log-probs 0.3 nats under the fp32
    model's own: the importance weight (docs/algorithm.md s9) then depends on each dtype's
    pi_old, so the loss does too (an on-policy first update's loss is -A whatever the dtype)."""
    batch = build_batch(make_groups(4, 4, seed=2), pad_id=0)
    trainer.model.eval()
    with torch.no_grad():
        logp, _ = trainer._forward(batch, entropy=False)
    batch.behaviour_log_prob = (logp - 0.3) * batch.response_mask
    return batch


def test_a_bf16_step_follows_the_fp32_step(tiny_model_dir: Path) -> None:
    """One update on the same batch and weights in fp32 and in bf16. Tolerances: bf16 keeps 8
    mantissa bits (2^-9 relative rounding per operation), which the 4 layers and the backward
    pass compound to about 1% of the gradient (measured 0.9%; the loss 0.2%); AdamW's first step
    is about lr x sign(gradient), so elements whose gradient is near zero may flip: the update is
    compared by its direction (measured cosine 0.993). Each bound leaves a margin of about 5x."""
    overrides = ("algorithm.mini_batch_groups=4", "learner.lr=1e-4")
    fp32 = trainer_with(tiny_model_dir, "none", *overrides)
    batch = off_policy_batch(fp32)
    runs = []
    for trainer in (fp32, trainer_with(tiny_model_dir, "bf16", *overrides)):
        grads = record_gradients(trainer)
        before = params(trainer)
        metrics = trainer.train_step(batch, policy_version=1)
        update = flat(params(trainer)) - flat(before)
        runs.append((metrics, grads[0], update))
    (m32, g32, u32), (m16, g16, u16) = runs
    assert m16["actor/pg_loss"] == pytest.approx(m32["actor/pg_loss"], rel=0.01)
    assert m16["actor/is_weight_mean"] == pytest.approx(m32["actor/is_weight_mean"], rel=0.01)
    assert float((g16 - g32).norm() / g32.norm()) < 0.05
    assert float(torch.nn.functional.cosine_similarity(u16, u32, dim=0)) > 0.98
    assert float(u32.abs().max()) > 0.5e-4  # the update moved: a real step was compared


def test_the_engine_learner_mismatch_is_measured_on_on_policy_tokens(tiny_model_dir: Path) -> None:
    """`actor/mismatch_abs_mean`/`_max`: |learner log-prob - behaviour log-prob| over tokens the
    learner's current version generated (one policy, two sets of numerics). Behaviour 0.3 nats
    under the fp32 learner's own gives 0.3 exactly in fp32; the bf16 learner adds its rounding;
    off-policy tokens (a version behind) are left out, so a batch of them reports none."""
    fp32 = trainer_with(tiny_model_dir, "none", "algorithm.mini_batch_groups=4")
    batch = off_policy_batch(fp32)  # behaviour = the fp32 log-prob - 0.3
    m32 = fp32.train_step(batch, policy_version=0)  # every row on-policy
    assert m32["actor/mismatch_abs_mean"] == pytest.approx(0.3, abs=1e-4)
    assert m32["actor/mismatch_abs_max"] == pytest.approx(0.3, abs=1e-4)
    bf16 = trainer_with(tiny_model_dir, "bf16", "algorithm.mini_batch_groups=4")
    m16 = bf16.train_step(batch, policy_version=0)
    assert m16["actor/mismatch_abs_mean"] == pytest.approx(0.3, abs=0.05)
    assert m16["actor/mismatch_abs_max"] > 0.3 + 1e-3  # bf16 rounding on top (0.304 seen)
    behind = trainer_with(tiny_model_dir, "none", "algorithm.mini_batch_groups=4")
    assert "actor/mismatch_abs_mean" not in behind.train_step(batch, policy_version=1)


def test_bf16_compute_keeps_fp32_master_weights_state_checkpoints_and_published_weights(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    trainer = trainer_with(tiny_model_dir, "bf16")
    seen: list[torch.dtype] = []
    head = trainer.head.forward
    trainer.head.lm_head.forward = lambda hidden: seen.append(hidden.dtype) or head(hidden)
    metrics = trainer.train_step(build_batch(make_groups(4, 4), pad_id=0), policy_version=0)
    assert metrics["actor/updates"] == 2.0 and metrics["actor/skipped_updates"] == 0
    assert set(seen) == {torch.bfloat16}  # the model ran in bf16 ...
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}  # ... from fp32
    state = [t for s in trainer.optimizer.state.values() for t in s.values() if t.dim()]
    assert state and {t.dtype for t in state} == {torch.float32}
    assert {t.dtype for _, t in trainer.named_full_params()} == {torch.float32}
    path = save_checkpoint(
        tmp_path / "ckpt",
        1,
        model=trainer.model,
        optimizer=trainer.optimizer,
        scheduler=trainer.scheduler,
        shuffle=trainer.rng,
        rank=0,
        meta={"policy_version": 1},
        hf_export=None,
        barrier=lambda: None,
    )
    stored = SafeMetadataReader(str(path / "state")).read_metadata().state_dict_metadata
    tensors = {k: m.properties.dtype for k, m in stored.items() if hasattr(m, "properties")}
    assert any(k.startswith("model.") for k in tensors)
    assert set(tensors.values()) == {torch.float32}


def policy_dtype(policy: MixedPrecisionPolicy) -> torch.dtype | None:
    return policy.param_dtype


@pytest.mark.parametrize(
    ("capabilities", "native", "auto"),
    [
        ({"avx512_bf16": True}, torch.bfloat16, None),
        ({"amx_bf16": True}, torch.bfloat16, None),
        ({"bf16": True}, torch.bfloat16, None),  # Arm's BF16 extension
        ({"avx512_bf16": False, "avx2": True}, None, None),
        ({}, None, None),
    ],
    ids=["avx512-bf16", "amx-bf16", "arm-bf16", "avx2-only", "nothing-known"],
)
def test_native_picks_bf16_only_where_the_cpu_has_it_and_auto_keeps_cpus_in_fp32(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capabilities: dict[str, bool],
    native: torch.dtype | None,
    auto: torch.dtype | None,
) -> None:
    monkeypatch.setattr(learner.precision.torch.cpu, "get_capabilities", lambda: capabilities)
    with caplog.at_level(logging.INFO, logger="learner.precision"):
        assert policy_dtype(mixed_precision("native", CPU)) == native
    assert ("bf16, fp32 master weights" if native else "compute dtype: fp32") in caplog.text
    assert policy_dtype(mixed_precision("auto", CPU)) == auto
    assert policy_dtype(mixed_precision("none", CPU)) is None
    assert policy_dtype(mixed_precision("bf16", CPU)) == torch.bfloat16  # asked for: obeyed


def test_native_on_a_cpu_without_bf16_trains_in_fp32_as_none_does(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole trainer under `native` on a CPU reporting no bf16: the same step as fp32."""
    monkeypatch.setattr(learner.precision.torch.cpu, "get_capabilities", lambda: {"avx2": True})
    batch = build_batch(make_groups(4, 4, seed=3), pad_id=0)
    after = []
    for setting in ("native", "none"):
        trainer = trainer_with(tiny_model_dir, setting)
        trainer.train_step(batch, policy_version=0)
        after.append(params(trainer))
    for name, tensor in after[0].items():
        assert torch.equal(tensor, after[1][name]), name
