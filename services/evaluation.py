"""`dapo eval`: avg@k of a model directory on the eval set (docs/algorithm.md s7: AIME 2024 avg@32 =
mean accuracy over 32 samples per distinct problem), with the configured engine (vLLM on a GPU)
and verifier, in this process.

A training run does not use this: its evaluations travel the prompt stream to the rollout
replicas (`learner/evaluation.py`). Both evaluate the distinct problems of the eval file with the
eval sampling settings, so their numbers compare.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import time
from typing import Any

from contracts.config import DapoConfig
from contracts.data import PromptRecord, encode_prompt, load_eval_problems
from contracts.model_source import with_local_model
from reward.service import open_scorer
from rollout.engine import Engine
from rollout.tool_use import ToolBox, generate_with_tools

log = logging.getLogger(__name__)


def eval_prompts(cfg: DapoConfig, tokenizer: Any) -> tuple[list[PromptRecord], list[list[int]]]:
    if not cfg.data.eval_path:
        return [], []
    records = load_eval_problems(
        cfg.data.eval_path, cfg.eval.max_problems, columns=cfg.data.columns
    )
    return records, [encode_prompt(tokenizer, r.messages, cfg.data.max_prompt_len) for r in records]


def evaluate(
    engine: Engine,
    tokenizer: Any,
    records: list[PromptRecord],
    prompts: list[list[int]],
    cfg: DapoConfig,
    *,
    batch: int = 64,
    tools: ToolBox | None = None,
) -> dict[str, float]:
    """avg@k accuracy and mean response length over the eval set (with `tools`, responses may
    call them, as the replicas' evaluation does under `rollout.tools`)."""
    if not records:
        return {}
    k, start = cfg.eval.samples_per_problem, time.monotonic()
    scorer = open_scorer(cfg.reward)  # the verifier, or reward.function
    correct = lengths = total = 0
    generate = (
        engine.generate if tools is None else functools.partial(generate_with_tools, engine, tools)
    )
    try:
        for lo in range(0, len(prompts), batch):
            outs = generate(
                prompts[lo : lo + batch],
                n=k,
                max_tokens=cfg.rollout.max_response_len,
                temperature=cfg.eval.temperature,
                top_p=cfg.eval.top_p,
            )
            for rec, samples in zip(records[lo : lo + batch], outs, strict=True):
                texts = tokenizer.batch_decode(
                    [s.token_ids for s in samples], skip_special_tokens=True
                )
                results = scorer.score_many(
                    [(t, rec.ground_truth) for t in texts], [rec.extra_info] * len(texts)
                )
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


def main(cfg: DapoConfig, model_dir: str | None = None) -> int:
    from transformers import AutoTokenizer

    from rollout.engine import make_engine

    cfg = with_local_model(cfg)  # also the base a LoRA adapter folder is served on
    path = model_dir or cfg.model.path
    tokenizer = AutoTokenizer.from_pretrained(path)
    records, prompts = eval_prompts(cfg, tokenizer)
    if not records:
        raise SystemExit("dapo eval: data.eval_path is not set")
    engine = make_engine(cfg, path)
    tools = ToolBox(cfg.rollout.tools, tokenizer) if cfg.rollout.tools.enabled else None
    try:
        result = evaluate(engine, tokenizer, records, prompts, cfg, tools=tools)
    finally:
        engine.close()
        if tools is not None:
            tools.close()
    sys.stdout.write(json.dumps({"model": path, **result}) + "\n")
    return 0
