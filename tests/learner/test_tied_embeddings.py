"""Tied input/output embeddings (SmolLM2, Qwen2.5-0.5B, Llama-3.2-1B tie them): one matrix is
both the token embedding and the output projection. Through the learner's fused chunked head
its gradient must be the sum of both uses, as in the plain model; FSDP2 must keep the two names
one parameter when it shards, loads, steps and gathers; and the export must load as a tied model
with the trained matrix; and a learner restarted from a checkpoint must resume it exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from contracts.config import load_config
from learner.batch import build_batch
from learner.checkpoint import Checkpoints
from learner.export import HFExporter
from learner.response_head import ResponseHead
from learner.trainer import Trainer
from services.demo.synthetic import synth_rows
from services.demo.tiny_base import train_tokenizer
from tests.learner.test_trainer import make_groups

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def tied_llama(vocab_size: int) -> LlamaForCausalLM:
    """SmolLM2-135M's shape family, shrunk: Llama, grouped-query attention (3 heads sharing one
    key/value head), head_dim 32, tied embeddings."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tied-llama")
    rows = synth_rows(200, seed=0)
    tok = train_tokenizer([r["prompt"][0]["content"] + "Answer: 123" for r in rows], vocab_size=300)
    model = tied_llama(len(tok))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module", autouse=True)
def process_group(one_rank_group: None) -> None:
    """Every test here builds a trainer: one gloo rank for the module."""


def test_the_chunked_head_gives_the_tied_matrix_the_plain_models_gradient() -> None:
    """The fused head computes the output projection in several chunks inside a custom autograd
    function; the tied matrix's gradient (embedding use + projection use) equals the plain
    model's, computed from full logits."""
    torch.manual_seed(1)
    fused, plain = tied_llama(300), tied_llama(300)
    ids = torch.randint(1, 300, (3, 12))  # (B, T)
    labels = ids[:, 6:]  # (B, R): the last 6 tokens, scored from positions 5..10
    temperature = 0.7

    head = ResponseHead(fused.get_output_embeddings(), temperature)
    head.chunk_rows = 4  # 18 scored rows: several chunks
    with head.scoring(labels):
        out = fused(input_ids=ids[:, :-1], logits_to_keep=6).logits  # (B, R, 2)
    (-out[..., 0].sum()).backward()

    logits = plain(input_ids=ids[:, :-1]).logits[:, -6:].float() / temperature  # (B, R, V)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, labels[..., None])[..., 0]
    (-logp.sum()).backward()

    torch.testing.assert_close(out[..., 0], logp, rtol=1e-5, atol=1e-5)
    grad, ref = fused.model.embed_tokens.weight.grad, plain.model.embed_tokens.weight.grad
    assert grad is not None and ref is not None
    torch.testing.assert_close(grad, ref, rtol=1e-4, atol=1e-6)
    # Both uses reach it: the projection's part alone is not the whole gradient.
    assert float(ref[ids[:, :-1].unique()].abs().sum()) > 0


def test_fsdp_keeps_the_tie_through_load_step_and_export(
    tied_model_dir: Path, tmp_path: Path
) -> None:
    cfg = load_config(
        CONFIG,
        [
            f"model.path={tied_model_dir}",
            "learner.lr=1e-3",
            "learner.warmup_steps=0",
            "algorithm.train_batch_groups=4",
            "algorithm.mini_batch_groups=2",
        ],
    )
    trainer = Trainer(cfg, rank=0, world_size=1, backend="gloo")
    model = trainer.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    saved: Any = AutoModelForCausalLM.from_pretrained(tied_model_dir)
    before = {n: t.clone() for n, t in trainer.named_full_params()}  # views of the shards
    assert "lm_head.weight" not in before  # one parameter, one name
    torch.testing.assert_close(
        before["model.embed_tokens.weight"], saved.model.embed_tokens.weight.detach()
    )

    trainer.train_step(build_batch(make_groups(4, 4, seed=3), pad_id=0), policy_version=0)

    assert model.lm_head.weight is model.model.embed_tokens.weight
    after = dict(trainer.named_full_params())
    assert not torch.equal(after["model.embed_tokens.weight"], before["model.embed_tokens.weight"])

    HFExporter(str(tied_model_dir)).export(iter(after.items()), tmp_path / "hf")
    exported: Any = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert exported.config.tie_word_embeddings
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    torch.testing.assert_close(exported.lm_head.weight.detach(), after["model.embed_tokens.weight"])
    ids = torch.tensor([[5, 17, 42, 8]])
    with torch.no_grad():  # the trained model and its export compute the same logits
        trainer.head.labels = None
        torch.testing.assert_close(
            model(input_ids=ids).logits, exported(input_ids=ids).logits, rtol=1e-5, atol=1e-5
        )


def test_a_learner_restarted_from_a_checkpoint_takes_the_step_it_would_have_taken(
    tied_model_dir: Path, tmp_path: Path
) -> None:
    """Checkpoint, kill, resume on the tied model: a fresh learner loading step 1 takes step 2
    exactly as the uninterrupted one did, and the loaded matrix is still both uses."""
    overrides = [
        f"model.path={tied_model_dir}",
        "learner.lr=1e-3",
        "learner.warmup_steps=0",
        "algorithm.train_batch_groups=4",
        "algorithm.mini_batch_groups=2",
    ]
    cfg = load_config(CONFIG, overrides)
    batches = [build_batch(make_groups(4, 4, seed=s), pad_id=0) for s in (3, 4)]

    def checkpoints(trainer: Trainer) -> Checkpoints:
        return Checkpoints(
            tmp_path / "ckpt",
            trainer=trainer,
            rank=0,
            keep_last=2,
            save_hf=False,
            barrier=lambda: None,
        )

    first = Trainer(cfg, rank=0, world_size=1, backend="gloo")
    first.train_step(batches[0], policy_version=0)
    checkpoints(first).save(1, {"policy_version": 1}, keep=False, hf_export=lambda out: None)
    first.train_step(batches[1], policy_version=1)
    uninterrupted = {n: t.clone() for n, t in first.named_full_params()}
    del first  # the killed learner

    resumed = Trainer(cfg, rank=0, world_size=1, backend="gloo")
    meta = checkpoints(resumed).load(1)
    assert meta is not None and meta["policy_version"] == 1
    model = resumed.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    resumed.train_step(batches[1], policy_version=1)
    after = dict(resumed.named_full_params())
    assert after.keys() == uninterrupted.keys()
    for name, value in after.items():
        torch.testing.assert_close(value, uninterrupted[name], rtol=0, atol=1e-6, msg=name)
