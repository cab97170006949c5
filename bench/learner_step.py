"""Learner step throughput on a preset: trained response tokens per second.

Builds or fetches the preset's base model (default the tiny preset), makes batches shaped like
the preset's (its groups per step and group size; prompts of 50-75% of `data.max_prompt_len`
tokens and responses of 3 to `rollout.max_response_len` tokens), and times `Trainer.train_step`
plus the weight gather that follows every step (what the learner does per step apart from
waiting for data), after two warm-up steps. One learner rank, as the preset runs. Nothing is
asserted; figures only.

    .venv/bin/python bench/learner_step.py [--steps 20] [--config configs/tiny.yaml] [overrides]

Last line: `learner_tokens_per_s=<trained response tokens per second>`.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.results_file import save_result  # noqa: E402  (a module beside this script)


def preset_groups(rng: random.Random, cfg: Any, version: int) -> list[Any]:
    """One step's groups, shaped like the preset's (see the module's docstring)."""
    from contracts.schemas import PromptJob, Response, ScoredGroup

    ro, groups = cfg.rollout, []
    prompt_len = cfg.data.max_prompt_len
    for g in range(cfg.algorithm.train_batch_groups):
        job = PromptJob(
            group_id=f"g{g}",
            prompt_index=g,
            prompt_ids=[
                rng.randrange(3, 200)
                for _ in range(rng.randint(prompt_len // 2, prompt_len * 3 // 4))
            ],
            ground_truth="1",
            issued_version=version,
            issued_at=0.0,
        )
        responses = []
        for _ in range(ro.group_size):
            n = rng.randint(3, ro.max_response_len)
            responses.append(
                Response(
                    token_ids=[rng.randrange(3, 200) for _ in range(n)],
                    logprobs=[-2.0] * n,
                    finish_reason="length" if n == ro.max_response_len else "stop",
                )
            )
        rewards = [1.0, -1.0] + [rng.choice([1.0, -1.0]) for _ in range(ro.group_size - 2)]
        groups.append(
            ScoredGroup(
                job=job,
                policy_version=version,
                replica_id="r",
                responses=responses,
                scores=rewards,
                acc=[r > 0 for r in rewards],
                rewards=rewards,
                preds=[""] * ro.group_size,
            )
        )
    return groups


def measure(steps: int, config: str, overrides: list[str]) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from contracts.config import load_config
    from contracts.model_source import with_local_model
    from learner.batch import build_batch
    from learner.service import init_distributed
    from learner.trainer import Trainer
    from services.data.prepare import prepare

    cfg = load_config(REPO / config, overrides)
    prepare(cfg)  # the cached base model and data
    cfg = with_local_model(cfg)  # a catalog:// or hf:// model's local directory
    torch.set_num_threads(cfg.learner.torch_threads or 1)
    rank, world, backend = init_distributed(cfg)
    trainer = Trainer(cfg, rank=rank, world_size=world, backend=backend)
    rng = random.Random(0)
    batches = [build_batch(preset_groups(rng, cfg, version=i), pad_id=0) for i in range(steps + 2)]
    train_s = gather_s = 0.0
    tokens = 0.0
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        trainer.train_step(batch, policy_version=i)
        t1 = time.perf_counter()
        for _ in trainer.named_full_params():
            pass
        t2 = time.perf_counter()
        if i >= 2:  # warm-up excluded
            train_s, gather_s, tokens = (
                train_s + t1 - t0,
                gather_s + t2 - t1,
                tokens + float(batch.response_mask.sum()),
            )
    dist.destroy_process_group()
    return {
        "steps": steps,
        "train_s_per_step": train_s / steps,
        "gather_s_per_step": gather_s / steps,
        "tokens_per_step": tokens / steps,
        "tokens_per_s": tokens / (train_s + gather_s),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("overrides", nargs="*", help="config overrides, dotted.key=value")
    args = parser.parse_args()
    figures = measure(args.steps, args.config, args.overrides)
    save_result(
        "learner_step", {"config": args.config, "overrides": args.overrides, **figures}, args.out
    )
    print(
        f"{args.config}, 1 learner rank: {figures['tokens_per_step']:.0f} response tokens "
        f"per step; train_step {figures['train_s_per_step']:.3f} s, weight gather "
        f"{figures['gather_s_per_step']:.3f} s"
    )
    print(f"learner_tokens_per_s={figures['tokens_per_s']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
