"""The in-process floor: the tiny preset's DAPO in one process, synchronously, no Redis, no weight
transfer. What the service system is measured against (`bench/time_to_target.py`).

Same model, data, prompt rendering, verifier, overlong shaping, dynamic sampling, batch assembly,
trainer and settings as `configs/tiny.yaml`; only the plumbing differs. Each step samples
`rollout.prompts_per_batch` prompts at a time with the transformers engine until
`train_batch_groups` groups with mixed accuracy are in hand (dynamic sampling, generation
batches of the same size as a replica's), takes one DAPO step, and copies the new weights into
the engine (a memory copy, not a transfer). Both cores serve whichever phase runs. Every
`eval.every_steps` steps it evaluates avg@k on the eval set's distinct problems (the same
`dapo eval` code), with the clock stopped: RL seconds count generation, scoring and training only.

    .venv/bin/python bench/inprocess_floor.py [--steps 300] [--json out.json] [overrides...]

Last line: `floor_seconds_to_plus25=<RL seconds to +25 points of eval accuracy>` (nan if never).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def seconds_to_gain(history: list[list[float]], gain: float) -> float:
    """RL seconds of the first evaluation at least `gain` above the first one (nan if none)."""
    if not history:
        return math.nan
    base = history[0][1]
    return next((rl for _, acc, rl in history if acc >= base + gain - 1e-9), math.nan)


def run(steps: int, overrides: list[str]) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer

    from learner.batch import build_batch
    from learner.service import init_distributed
    from learner.trainer import Trainer
    from reward.service import score_group
    from reward.verifiers import make_scorer
    from rollout.hf_engine import HFEngine
    from services.contracts.config import load_config
    from services.contracts.data import encode_prompt, load_prompts
    from services.contracts.schemas import PromptJob, Response, RolloutGroup
    from services.gatekeeper import group_metric, keep_group
    from services.shell.evaluation import eval_prompts, evaluate
    from services.shell.launcher import prepare

    cfg = load_config(REPO / "configs" / "tiny.yaml", [f"learner.total_steps={steps}", *overrides])
    prepare(cfg)
    torch.set_num_threads(2)  # one process: both cores for whichever phase runs
    init_distributed(cfg)
    trainer = Trainer(cfg, rank=0, world_size=1, backend="gloo")
    engine = HFEngine(cfg.model.path, dtype=cfg.model.dtype, seed=cfg.rollout.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    scorer = make_scorer(cfg.reward.verifier, timeout_s=cfg.reward.timeout_s, workers=cfg.reward.sandbox_workers)
    records = load_prompts(cfg.data.train_path)
    order = list(range(len(records)))
    random.Random(cfg.data.seed).shuffle(order)
    eval_records, eval_ids = eval_prompts(cfg, tokenizer)
    ro, alg = cfg.rollout, cfg.algorithm
    history: list[list[float]] = []
    rl_seconds, cursor, generated, kept_total = 0.0, 0, 0, 0
    train_seconds, train_tokens = 0.0, 0.0

    def evaluate_now(step: int) -> None:
        result = evaluate(engine, tokenizer, eval_records, eval_ids, cfg)
        history.append([step, result["eval/acc"], round(rl_seconds, 2)])
        print(f"step {step}: eval {result['eval/acc']:.3f} at {rl_seconds:.1f} RL seconds", flush=True)

    def sample_groups() -> list[RolloutGroup]:
        nonlocal cursor, generated
        recs = [records[order[(cursor + i) % len(records)]] for i in range(ro.prompts_per_batch)]
        cursor += ro.prompts_per_batch
        prompts = [encode_prompt(tokenizer, r.messages, cfg.data.max_prompt_len) for r in recs]
        outs = engine.generate(prompts, n=ro.group_size, max_tokens=ro.max_response_len, temperature=ro.temperature, top_p=ro.top_p)
        groups = []
        for rec, ids, samples in zip(recs, prompts, outs, strict=True):
            job = PromptJob(group_id=f"floor-{generated}", prompt_index=rec.index, prompt_ids=ids, ground_truth=rec.ground_truth,
                            policy_version=0, issued_at=0.0)
            generated += 1
            group = RolloutGroup(
                job=job, policy_version=0, replica_id="floor",
                responses=[Response(token_ids=s.token_ids, logprobs=s.logprobs, finish_reason=s.finish_reason) for s in samples],  # type: ignore[arg-type]
            )
            score_group(group, tokenizer, scorer, cfg)  # the reward worker's own scoring
            groups.append(group)
        return groups

    evaluate_now(0)
    for step in range(1, steps + 1):
        start = time.monotonic()
        kept: list[RolloutGroup] = []
        while len(kept) < alg.train_batch_groups:  # dynamic sampling, synchronous
            kept += [g for g in sample_groups() if not alg.gatekeeper or keep_group(group_metric(g, alg.gatekeeper_metric))]
        kept_total += alg.train_batch_groups
        batch = build_batch(kept[: alg.train_batch_groups], pad_id=0, norm_by_std=alg.norm_by_std,
                            overlong_filter=cfg.reward.overlong.filter)
        trained_at = time.monotonic()
        trainer.train_step(batch, policy_version=0)  # every row on-policy: no behaviour correction
        train_seconds += time.monotonic() - trained_at
        train_tokens += float(batch.response_mask.sum())
        engine.update_weights(trainer.named_full_params())
        rl_seconds += time.monotonic() - start
        if step % cfg.eval.every_steps == 0 or step == steps:
            evaluate_now(step)
    scorer.close()
    return {"eval_history": history, "rl_seconds": rl_seconds, "steps": steps, "groups_generated": generated,
            "groups_trained": kept_total, "seconds_to_plus25": seconds_to_gain(history, 0.25),
            "train_tokens_per_s": train_tokens / train_seconds if train_seconds else 0.0, "train_seconds": train_seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("overrides", nargs="*", help="config overrides, dotted.key=value")
    args = parser.parse_args()
    result = run(args.steps, args.overrides)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"{result['steps']} steps in {result['rl_seconds']:.0f} RL seconds; eval {result['eval_history'][0][1]:.3f} -> "
          f"{result['eval_history'][-1][1]:.3f}; {result['groups_generated']} groups generated for {result['groups_trained']} trained")
    print(f"floor_seconds_to_plus25={result['seconds_to_plus25']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
