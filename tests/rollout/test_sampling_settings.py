"""Only the configured sampling settings shape what a replica samples: the model's own
`generation_config.json` (a repetition penalty, top-k...) is not applied, since the learner's
log-probs know nothing of it, and training rollouts refuse a nucleus the learner does not
compute."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GenerationConfig

from contracts.config import ConfigError, build_config
from rollout.generation_config import ignored_settings
from rollout.hf_engine import HFEngine


@pytest.fixture()
def opinionated_model_dir(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The tiny model with a generation config that would change the sampling distribution."""
    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir, path)
    opinions = GenerationConfig(eos_token_id=0, do_sample=True, repetition_penalty=1.5, top_k=3)
    opinions.save_pretrained(path)
    return path


def test_the_models_generation_config_does_not_shape_sampling(
    opinionated_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    temperature = 0.8
    with caplog.at_level(logging.INFO, logger="rollout.generation_config"):
        engine = HFEngine(str(opinionated_model_dir), seed=0)
    assert "repetition_penalty" in caplog.text and "top_k" in caplog.text  # said once, at start
    generated: dict[str, Any] = {}
    real_generate = engine.model.generate

    def keep_scores(**kwargs: Any) -> Any:  # the scores generate() actually sampled from
        generated["out"] = real_generate(**kwargs, output_scores=True)
        return generated["out"]

    monkeypatch.setattr(engine.model, "generate", keep_scores)
    prompt = [5, 6, 7, 5, 6, 7]  # repeated tokens: a repetition penalty would lower them
    [group] = engine.generate([prompt], n=4, max_tokens=8, temperature=temperature, top_p=1.0)

    out = generated["out"]
    for step, (scores, logits) in enumerate(zip(out.scores, out.logits, strict=True)):
        # Nothing but the temperature between the model's logits and the sampling distribution.
        torch.testing.assert_close(scores, logits / temperature, msg=f"step {step}")
    outside_top3 = 0
    for s in group:
        ids = torch.tensor([prompt + s.token_ids])
        with torch.no_grad():
            logits = engine.model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
        sampled = torch.tensor(s.token_ids)[:, None]
        expected = torch.log_softmax(logits, -1).gather(-1, sampled).squeeze(-1)
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-4, rtol=1e-4)
        top3 = logits.topk(3, dim=-1).indices
        outside_top3 += sum(t not in row for t, row in zip(s.token_ids, top3.tolist(), strict=True))
    assert outside_top3 > 0  # top_k=3 would never sample these


def test_the_ignored_settings_are_named(opinionated_model_dir: Path, tmp_path: Path) -> None:
    ignored = ignored_settings(str(opinionated_model_dir))
    assert ignored == {"do_sample": True, "repetition_penalty": 1.5, "top_k": 3}  # eos is kept
    assert ignored_settings(str(tmp_path)) == {}  # no generation config


def _config(**rollout: object) -> dict[str, object]:
    return {"model": {"path": "m"}, "data": {"train_path": "t.jsonl"}, "rollout": rollout}


def test_training_rollouts_refuse_a_nucleus_the_learner_does_not_compute() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.top_p.*whole softmax"):
        build_config(_config(top_p=0.9))
    cfg = build_config(_config(top_p=1.0), ["eval.top_p=0.7"])  # evaluation trains nothing
    assert (cfg.rollout.top_p, cfg.eval.top_p) == (1.0, 0.7)
