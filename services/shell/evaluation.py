"""avg@k evaluation (docs/algorithm.md s7: AIME 2024 avg@32 = mean accuracy over 32 samples per
problem): `dapo eval` on a model directory, and the evaluator the shell injects into the learner.

The learner (a stage) never imports an inference engine or a verifier (other stages); it is
handed an `Evaluator` built here from the rollout stage's engine and the reward stage's scorer.
Departure from ARCHITECTURE.md, until evaluation travels the prompt stream to the rollout
replicas: rank 0 evaluates in its own process with the transformers engine, which suits the
tiny CPU preset, not a 32B model.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterable
from typing import Any

from torch import Tensor

from reward.verifiers import make_scorer
from rollout.engine import Engine
from services.contracts.config import DapoConfig
from services.contracts.data import PromptRecord, load_prompts, render_prompt

log = logging.getLogger(__name__)


def eval_prompts(cfg: DapoConfig, tokenizer: Any) -> tuple[list[PromptRecord], list[list[int]]]:
    if not cfg.data.eval_path:
        return [], []
    records = load_prompts(cfg.data.eval_path)[: cfg.eval.max_problems]
    prompts = [
        tokenizer.encode(render_prompt(tokenizer, r.messages), add_special_tokens=False)[-cfg.data.max_prompt_len :]
        for r in records
    ]
    return records, prompts


def evaluate(
    engine: Engine, tokenizer: Any, records: list[PromptRecord], prompts: list[list[int]], cfg: DapoConfig, *, batch: int = 64
) -> dict[str, float]:
    """avg@k accuracy and mean response length over the eval set."""
    if not records:
        return {}
    k, start = cfg.eval.samples_per_problem, time.monotonic()
    scorer = make_scorer(cfg.reward.verifier, timeout_s=cfg.reward.timeout_s, workers=cfg.reward.sandbox_workers)
    correct = lengths = total = 0
    try:
        for lo in range(0, len(prompts), batch):
            outs = engine.generate(
                prompts[lo : lo + batch], n=k, max_tokens=cfg.rollout.max_response_len,
                temperature=cfg.eval.temperature, top_p=cfg.eval.top_p,
            )
            for rec, samples in zip(records[lo : lo + batch], outs, strict=True):
                texts = tokenizer.batch_decode([s.token_ids for s in samples], skip_special_tokens=True)
                results = scorer.score_many([(t, rec.ground_truth) for t in texts])
                correct += sum(r.acc for r in results)
                lengths += sum(len(s.token_ids) for s in samples)
                total += len(samples)
    finally:
        scorer.close()
    return {
        "eval/acc": correct / total,
        "eval/response_length": lengths / total,
        "eval/problems": float(len(records)),
        "eval/samples_per_problem": float(k),
        "eval/seconds": time.monotonic() - start,
    }


class EngineEvaluator:
    """The learner's evaluator: the transformers engine on CPU, loaded once from `model.path`,
    handed the policy's weights before each evaluation."""

    def __init__(self, cfg: DapoConfig) -> None:
        from transformers import AutoTokenizer

        from rollout.hf_engine import HFEngine

        self.cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.records, self.prompts = eval_prompts(cfg, self.tokenizer)
        self.engine = HFEngine(cfg.model.path, seed=cfg.learner.seed) if self.records else None

    def evaluate(self, weights: Iterable[tuple[str, Tensor]], step: int) -> dict[str, float]:
        if self.engine is None:
            return {}
        self.engine.update_weights(weights)
        result = evaluate(self.engine, self.tokenizer, self.records, self.prompts, self.cfg)
        log.info("eval at step %d: avg@%d = %.3f", step, self.cfg.eval.samples_per_problem, result["eval/acc"])
        return result

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def make_evaluator(cfg: DapoConfig) -> EngineEvaluator:
    return EngineEvaluator(cfg)


def main(cfg: DapoConfig, model_dir: str | None = None) -> int:
    from transformers import AutoTokenizer

    from rollout.engine import make_engine

    path = model_dir or cfg.model.path
    tokenizer = AutoTokenizer.from_pretrained(path)
    records, prompts = eval_prompts(cfg, tokenizer)
    if not records:
        raise SystemExit("dapo eval: data.eval_path is not set")
    engine = make_engine(cfg, path)
    try:
        result = evaluate(engine, tokenizer, records, prompts, cfg)
    finally:
        engine.close()
    sys.stdout.write(json.dumps({"model": path, **result}) + "\n")
    return 0
