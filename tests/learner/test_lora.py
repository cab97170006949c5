"""LoRA (`learner.lora`) on the FSDP2 trainer, one gloo rank: only the adapters train and are
published; the transformers engine, given the published adapters, samples with the learner's
log-probs; checkpoints hold the adapters and their optimizer state, and restore them; the export
is a `peft` adapter that peft, the engines and the merge all read as the learner's policy."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import learner.trainer as learner_trainer
from contracts.bus import StreamBus, connect
from contracts.keys import Keys
from contracts.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, is_adapter_param, read_adapter
from contracts.schemas import PromptJob, Response, ScoredGroup
from learner.batch import TrainBatch, build_batch
from learner.checkpoint import load_checkpoint, save_checkpoint
from learner.dcp_reader import SafeMetadataReader
from learner.export import HFExporter, merge_adapter
from learner.trainer import Trainer
from rollout.engine import make_engine
from rollout.hf_engine import HFEngine
from tests.contracts.test_weight_sync import sent_to_a_replica, stop_replicas
from tests.learner.test_trainer import config, make_groups

LORA = ["learner.lora.enabled=true", "learner.lora.rank=4", "learner.lora.alpha=8"]


@pytest.fixture(scope="module", autouse=True)
def process_group(one_rank_group: None) -> None:
    """Every test here builds a trainer: one gloo rank for the module."""


def lora_trainer(model_dir: Path, *overrides: str) -> Trainer:
    torch.manual_seed(0)
    trainer = Trainer(config(model_dir, *LORA, *overrides), rank=0, world_size=1, backend="gloo")
    trainer.rng = random.Random(0)
    return trainer


def published(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in trainer.named_full_params()}


def test_only_the_adapters_train_and_are_published(tiny_model_dir: Path) -> None:
    trainer = lora_trainer(tiny_model_dir)
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    before = published(trainer)
    assert before and all(is_adapter_param(n) for n in before)
    assert [n for n, _ in trainer.param_shapes()] == list(before)
    # B starts at zero: the adapted model is the base model.
    assert all(not t.any() for n, t in before.items() if ".lora_B." in n)

    trainer.train_step(build_batch(make_groups(4, 4), pad_id=0), policy_version=0)
    after = published(trainer)
    assert all(not torch.equal(before[n], after[n]) for n in before)
    for name, param in trainer.model.named_parameters():
        if not is_adapter_param(name):
            assert torch.equal(param.detach(), frozen[name]), name
    # AdamW's state exists for the adapters alone.
    adapters = {id(p) for n, p in trainer.model.named_parameters() if is_adapter_param(n)}
    assert {id(p) for p in trainer.optimizer.state} == adapters


def test_a_weight_sync_moves_the_adapters_alone(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path
) -> None:
    """`weight_sync/bytes` (issue 39) of a LoRA run: what the adapters hold, not the model."""
    trainer = lora_trainer(tiny_model_dir)
    sizes = {n: p.numel() * p.element_size() for n, p in trainer.model.named_parameters()}
    adapters = sum(size for name, size in sizes.items() if is_adapter_param(name))
    bus = StreamBus(connect(redis_url), Keys(f"lora-{time.monotonic_ns()}"), consumer="c1")
    try:
        pub = sent_to_a_replica(bus, tmp_path, list(trainer.named_full_params()))
    finally:
        stop_replicas()
    assert pub.last_publication.nbytes == adapters < sum(sizes.values())
    assert pub.last_publication.replicas == 1


def test_packed_and_row_layouts_take_the_same_lora_step(tiny_model_dir: Path) -> None:
    batch = build_batch(make_groups(4, 4, seed=2), pad_id=0)
    results = []
    for share in ("never", "always"):
        trainer = lora_trainer(tiny_model_dir, f"learner.share_prompts={share}")
        trainer.train_step(batch, policy_version=0)
        results.append(published(trainer))
    for name, tensor in results[0].items():
        torch.testing.assert_close(results[1][name], tensor, rtol=1e-4, atol=5e-5)


def groups_from_samples(prompts: list[list[int]], groups: list[list]) -> list[ScoredGroup]:
    out = []
    for i, (prompt, samples) in enumerate(zip(prompts, groups, strict=True)):
        rewards = [1.0 if k % 2 else -1.0 for k in range(len(samples))]
        out.append(
            ScoredGroup(
                job=PromptJob(
                    group_id=f"g{i}",
                    prompt_index=i,
                    prompt_ids=prompt,
                    ground_truth="1",
                    issued_version=1,
                    issued_at=0.0,
                ),
                policy_version=1,
                replica_id="r",
                responses=[
                    Response(token_ids=s.token_ids, logprobs=s.logprobs, finish_reason="stop")
                    for s in samples
                ],
                scores=rewards,
                acc=[r > 0 for r in rewards],
                rewards=rewards,
                preds=[""] * len(samples),
            )
        )
    return out


def test_engine_samples_with_the_learners_log_probs_for_the_same_adapters(
    tiny_model_dir: Path,
) -> None:
    trainer = lora_trainer(tiny_model_dir)
    trainer.train_step(build_batch(make_groups(4, 4), pad_id=0), policy_version=0)
    cfg = trainer.cfg
    engine = HFEngine(str(tiny_model_dir), seed=0, lora=cfg.learner.lora)
    engine.update_weights(trainer.named_full_params())
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (5, 9, 7)]
    samples = engine.generate(prompts, n=4, max_tokens=8, temperature=1.0, top_p=1.0)
    batch = build_batch(groups_from_samples(prompts, samples), pad_id=0)
    trainer.model.eval()
    with torch.no_grad():
        learner_logp, _ = trainer._forward(batch, entropy=False)
    mask = batch.response_mask.bool()
    gap = (learner_logp - batch.behaviour_log_prob).abs()[mask].max().item()
    assert gap < 1e-4
    # The adapters matter: the base model's log-probs of the same tokens are not these.
    engine.load_weights_from_dir(str(tiny_model_dir))  # the base folder: adapters reset
    torch.manual_seed(1)
    base = engine.generate(prompts, n=4, max_tokens=8, temperature=1.0, top_p=1.0)
    base_batch = build_batch(groups_from_samples(prompts, base), pad_id=0)
    with torch.no_grad():
        adapted, _ = trainer._forward(base_batch, entropy=False)
    base_mask = base_batch.response_mask.bool()
    assert (adapted - base_batch.behaviour_log_prob).abs()[base_mask].max().item() > 1e-3


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's shape family (tied input and output embeddings), shrunk."""
    from tests.learner.test_tied_embeddings import tied_llama

    out = tmp_path_factory.mktemp("tied-llama")
    tied_llama(415).save_pretrained(out)
    return out


@pytest.mark.parametrize("model", ["untied", "tied"])
def test_checkpoint_keeps_the_adapters_and_their_optimizer_state(
    model: str, tiny_model_dir: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    model_dir = tiny_model_dir if model == "untied" else request.getfixturevalue("tied_model_dir")
    trainer = lora_trainer(model_dir)
    trainer.train_step(build_batch(make_groups(4, 4), pad_id=0), policy_version=0)

    def save(t: Trainer, root: Path) -> Path:
        return save_checkpoint(
            root,
            1,
            model=t.model,
            optimizer=t.optimizer,
            scheduler=t.scheduler,
            shuffle=t.rng,
            rank=0,
            meta={"policy_version": 1},
            hf_export=None,
            barrier=lambda: None,
        )

    path = save(trainer, tmp_path / "ckpt")
    reader = SafeMetadataReader(str(path / "state"))
    keys = list(reader.read_metadata().state_dict_metadata)
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(is_adapter_param(k) for k in model_keys)  # no base weight saved
    assert any(k.startswith("optim.state.") and "exp_avg" in k for k in keys)

    restored = lora_trainer(model_dir, "learner.seed=7")  # other fresh adapters
    assert any(
        not torch.equal(a, b)
        for a, b in zip(published(restored).values(), published(trainer).values(), strict=True)
    )
    load_checkpoint(
        path,
        rank=0,
        model=restored.model,
        optimizer=restored.optimizer,
        scheduler=restored.scheduler,
        shuffle=restored.rng,
    )
    for name, tensor in published(trainer).items():
        assert torch.equal(published(restored)[name], tensor), name
    moments = [s["exp_avg"] for s in trainer.optimizer.state.values()]
    restored_moments = [s["exp_avg"] for s in restored.optimizer.state.values()]
    assert len(moments) == len(restored_moments) > 0
    for a, b in zip(moments, restored_moments, strict=True):
        torch.testing.assert_close(a.full_tensor(), b.full_tensor())


def test_export_is_a_peft_adapter_that_serves_and_merges_as_the_learners_policy(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer = lora_trainer(tiny_model_dir)
    trainer.train_step(build_batch(make_groups(4, 4), pad_id=0), policy_version=0)
    out = tmp_path / "adapter"
    HFExporter(str(tiny_model_dir), lora=trainer.cfg.learner.lora).export(
        trainer.named_full_params(), out
    )
    assert (out / ADAPTER_CONFIG).is_file() and (out / ADAPTER_WEIGHTS).is_file()
    assert not (out / "model.safetensors").exists()  # the base is not copied
    assert set(read_adapter(out)) == set(published(trainer))

    ids = torch.tensor([[5, 17, 33, 9, 41, 2, 8]])
    trainer.model.eval()
    with torch.no_grad():
        want = trainer.model(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        peft_logits = PeftModel.from_pretrained(base, str(out)).eval()(input_ids=ids).logits
        torch.testing.assert_close(peft_logits, want, rtol=1e-4, atol=1e-5)
        # `dapo eval` and a replica take the adapter folder through make_engine, with a config
        # that never turned LoRA on: the adapter's own config shapes the engine.
        plain = config(tiny_model_dir)
        engine = make_engine(plain, str(out))
        assert isinstance(engine, HFEngine)
        engine_logits = engine.model(input_ids=ids).logits
        torch.testing.assert_close(engine_logits, want, rtol=1e-4, atol=1e-5)
        merged = merge_adapter(out, tmp_path / "merged", base_model=str(tiny_model_dir))
        merged_model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
        torch.testing.assert_close(merged_model(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)


def test_under_bf16_the_frozen_base_is_kept_in_bf16(tiny_model_dir: Path) -> None:
    """`learner.mixed_precision=bf16` (the GPU default): the base is stored in the dtype it is
    computed in (no fp32 master copy of weights that never step), the adapters in fp32."""
    trainer = lora_trainer(tiny_model_dir, "learner.mixed_precision=bf16")
    dtypes = {(p.requires_grad, p.dtype) for p in trainer.model.parameters()}
    assert dtypes == {(True, torch.float32), (False, torch.bfloat16)}
    before = published(trainer)
    metrics = trainer.train_step(build_batch(make_groups(4, 4), pad_id=0), policy_version=0)
    assert metrics["actor/updates"] == 2.0 and metrics["actor/skipped_updates"] == 0
    assert all(not torch.equal(before[n], t) for n, t in published(trainer).items())


def test_with_adapter_dropout_pi_old_is_the_eval_pass_and_only_training_drops(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`learner.lora.dropout > 0`: pi_old of every mini-batch, the first included, is the
    eval-mode pass the replicas sample with (docs/algorithm.md s10); the training pass drops."""
    assert not lora_trainer(tiny_model_dir).dropout  # the default, 0: no extra pass
    trainer = lora_trainer(
        tiny_model_dir, "learner.lora.dropout=0.5", "learner.micro_batch_size=64"
    )
    assert trainer.dropout
    batch = build_batch(make_groups(4, 4, seed=3), pad_id=0)
    trainer.train_step(batch, policy_version=0)  # B leaves zero, so dropout changes log-probs
    plan = trainer._plan(batch)[1]
    eval_pass = trainer._old_log_probs(batch, plan)
    assert torch.equal(eval_pass, trainer._old_log_probs(batch, plan))

    selected: list[list[int]] = []
    seen: list[tuple[list[int], torch.Tensor, torch.Tensor, bool]] = []
    select, loss = trainer._select, learner_trainer.policy_loss

    def recording_select(b: TrainBatch, rows: list[int]) -> TrainBatch:
        selected.append(rows)
        return select(b, rows)

    def spy(log_prob: torch.Tensor, old_log_prob: torch.Tensor, *args: Any, **kw: Any) -> Any:
        seen.append((selected[-1], log_prob.detach(), old_log_prob, trainer.model.training))
        return loss(log_prob, old_log_prob, *args, **kw)

    monkeypatch.setattr(trainer, "_select", recording_select)
    monkeypatch.setattr(learner_trainer, "policy_loss", spy)
    trainer.train_step(batch, policy_version=0)
    assert len(seen) == 2  # two mini-batches of one micro-batch each
    for rows, _, old, training in seen:
        assert training
        assert torch.equal(old, eval_pass[rows])
    # The first mini-batch trains on the weights pi_old was computed with: only dropout differs.
    rows, logp, old, _ = seen[0]
    mask = batch.response_mask[rows].bool()
    assert (logp - old)[mask].abs().max() > 1e-4
