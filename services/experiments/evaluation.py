"""`dapo eval`: avg@k of a model directory on the eval set (docs/algorithm.md s7: AIME 2024 avg@32 =
mean accuracy over 32 samples per distinct problem), with the configured engine (vLLM on a GPU)
and verifier, in this process.

A training run does not use this: its evaluations travel the prompt stream to the rollout
replicas (`learner/evaluation.py`). Both evaluate the distinct problems of the eval file with the
eval sampling settings and draw sample j of problem i with the seed of (`eval.seed`, i, j)
(`rollout.engine.eval_seeds`), so the same weights give the same number here and in the run's
round (tests/e2e/test_tiny_run.py). `--samples` overrides k (a base figure measured once
with many samples, `bench/base_figure.py`). `--run DIR` evaluates a finished run's checkpoints
instead, each credited to the RL seconds at which its weights were published: the run's curve
when it had no rounds of its own (`eval.in_run: false`).
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from contracts.checkpoint_store import HF_EXPORT, list_checkpoints
from contracts.config import DapoConfig
from contracts.data import PromptRecord, encode_prompt
from contracts.eval_stats import Round, accuracy_interval
from contracts.model_source import with_local_model
from contracts.tasks import eval_task_metrics, task_label
from learner.evaluation import eval_problems
from reward.service import open_scorer
from reward.text import model_token_ids
from rollout.engine import Engine, Sample, eval_seeds
from rollout.tool_use import ToolBox, generate_with_tools

log = logging.getLogger(__name__)


def eval_prompts(cfg: DapoConfig, tokenizer: Any) -> tuple[list[PromptRecord], list[list[int]]]:
    if not cfg.data.eval_path:
        return [], []
    records, _ = eval_problems(cfg)
    return records, [
        encode_prompt(tokenizer, r.messages, cfg.data.max_prompt_len, chat=cfg.data.chat)
        for r in records
    ]


def graded_ids(sample: Sample, cfg: DapoConfig) -> list[int]:
    """The tokens the verifier reads: the model's own (tool results left out) unless
    `reward.grade_tool_results`, as `reward.service.score_group` grades them."""
    if cfg.reward.grade_tool_results:
        return list(sample.token_ids)
    return model_token_ids(sample.token_ids, sample.tool_spans)


def evaluate(
    engine: Engine,
    tokenizer: Any,
    records: list[PromptRecord],
    prompts: list[list[int]],
    cfg: DapoConfig,
    *,
    batch: int = 64,
    tools: ToolBox | None = None,
) -> tuple[dict[str, float], list[float]]:
    """(avg@k accuracy with its bootstrap 95% interval, the mean response length and each task's
    accuracy (`task/<name>/eval_acc`, by `data_source`) over the eval set, each problem's
    accuracy in order). With `tools`, responses may call them, as the
    replicas' evaluation does under `rollout.tools`."""
    if not records:
        return {}, []
    k, start = cfg.eval.samples_per_problem, time.monotonic()
    scorer = open_scorer(cfg.reward, gym=cfg.data.gym is not None)  # each row's verifier
    correct = lengths = total = 0
    per_problem: list[float] = []
    by_task: dict[str, tuple[int, int]] = {}
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
                seeds=[
                    eval_seeds(cfg.eval.seed, i, k)
                    for i in range(lo, min(lo + batch, len(prompts)))
                ],
                stop=cfg.rollout.stop,
            )
            for rec, samples in zip(records[lo : lo + batch], outs, strict=True):
                texts = tokenizer.batch_decode(  # what the model wrote, as the reward stage grades
                    [graded_ids(s, cfg) for s in samples], skip_special_tokens=True
                )
                results = scorer.score_many(
                    [(t, rec.ground_truth) for t in texts],
                    [rec.extra_info] * len(texts),
                    [rec.data_source] * len(texts),
                )
                correct += sum(r.acc for r in results)
                task = task_label(rec.data_source)
                right, seen = by_task.get(task, (0, 0))
                by_task[task] = (right + sum(r.acc for r in results), seen + len(results))
                per_problem.append(sum(r.acc for r in results) / len(results))
                lengths += sum(len(s.token_ids) for s in samples)
                total += len(samples)
    finally:
        scorer.close()
    low, high = accuracy_interval(per_problem)
    return {
        "eval/acc": correct / total,
        "eval/acc_ci_low": low,
        "eval/acc_ci_high": high,
        "eval/response_length": lengths / total,
        "eval/problems": float(len(records)),
        "eval/samples_per_problem": float(k),
        "eval/seconds": time.monotonic() - start,
    } | eval_task_metrics(by_task), per_problem


OFFLINE_ROUNDS_FILE = "eval_rounds_offline.jsonl"
"""In a run's output directory: the rounds `dapo eval --run` measured from its checkpoints, one
`contracts.eval_stats.Round` per line (`read_rounds` reads it)."""


def evaluate_checkpoints(
    engine: Engine,
    tokenizer: Any,
    records: list[PromptRecord],
    prompts: list[list[int]],
    cfg: DapoConfig,
    store: Path,
    *,
    tools: ToolBox | None = None,
) -> list[Round]:
    """A round for each committed checkpoint of `store`: its export evaluated with `cfg`'s
    evaluation settings and seeds (paired with the run's own rounds and with every other run's),
    credited to the step, policy version and RL seconds its trainer.json records."""
    rounds = []
    for ckpt in list_checkpoints(store):
        engine.load_weights_from_dir(str(ckpt.path / HF_EXPORT))
        metrics, per_problem = evaluate(engine, tokenizer, records, prompts, cfg, tools=tools)
        rounds.append(
            Round(
                step=ckpt.step,
                rl_seconds=float(ckpt.meta.get("rl_seconds", 0.0)),
                per_problem=tuple(per_problem),
                policy_version=int(ckpt.meta.get("policy_version", 0)),
                extra={"offline": True, "eval_seconds": metrics["eval/seconds"]},
            )
        )
        log.info("checkpoint step %d: avg@k %.4f", rounds[-1].step, rounds[-1].acc)
    return rounds


def main(
    cfg: DapoConfig,
    model_dir: str | None = None,
    *,
    samples: int | None = None,
    per_problem_to: str | None = None,
    run_dir: str | None = None,
) -> int:
    """Print the eval metrics of `model_dir` (default `model.path`) as one JSON line; `samples`
    overrides `eval.samples_per_problem`; `per_problem_to` also writes each problem's accuracy
    there (JSON: the list, with the metrics). With `run_dir`, evaluate that run's checkpoints
    instead: one line each, and their rounds in `run_dir/OFFLINE_ROUNDS_FILE`."""
    from transformers import AutoTokenizer

    from rollout.engine import make_engine
    from services.data.prepare import prepare_data

    cfg = with_local_model(cfg)  # also the base a LoRA adapter folder is served on
    prepare_data(cfg)  # a synthetic evaluation set is written on first use, as `dapo run` does
    if samples is not None:
        cfg = cfg.model_copy(
            update={"eval": cfg.eval.model_copy(update={"samples_per_problem": samples})}
        )
    # The run's checkpoint store, as the run found it (`checkpoint.dir`, else under its output).
    store = (
        None if run_dir is None else cfg.model_copy(update={"output_dir": run_dir}).checkpoint_dir
    )
    if store is not None and not list_checkpoints(store):
        raise SystemExit(f"dapo eval: {store} holds no committed checkpoint")
    path = model_dir or cfg.model.path
    tokenizer = AutoTokenizer.from_pretrained(path)
    records, prompts = eval_prompts(cfg, tokenizer)
    if not records:
        raise SystemExit("dapo eval: data.eval_path is not set")
    engine = make_engine(cfg, path)
    tools = ToolBox(cfg.rollout.tools, tokenizer) if cfg.rollout.tools.enabled else None
    try:
        if run_dir is not None and store is not None:
            rounds = evaluate_checkpoints(
                engine, tokenizer, records, prompts, cfg, store, tools=tools
            )
            (Path(run_dir) / OFFLINE_ROUNDS_FILE).write_text(
                "".join(json.dumps(r.to_json()) + "\n" for r in rounds)
            )
            for r in rounds:
                line = {"step": r.step, "rl_seconds": r.rl_seconds, "eval/acc": r.acc}
                sys.stdout.write(json.dumps(line) + "\n")
            return 0
        result, per_problem = evaluate(engine, tokenizer, records, prompts, cfg, tools=tools)
    finally:
        engine.close()
        if tools is not None:
            tools.close()
    if per_problem_to is not None:
        Path(per_problem_to).write_text(
            json.dumps({"model": path, **result, "per_problem": per_problem})
        )
    sys.stdout.write(json.dumps({"model": path, **result}) + "\n")
    return 0
