"""Replica generation speed with and without shared prefill (the transformers engine).

One replica's `generate` on the preset's own prompts and sampling settings, alternating the two
ways of computing a group's prompt in one process: expanded (each prompt repeated n times before
the forward pass, as `num_return_sequences` does) and shared (computed once, its key/value cache
repeated; `rollout/hf_engine.py`). Same seeds, so both sample the same tokens; tokens/s counts
the responses' tokens. The last line is the ratio shared / expanded.

    python bench/shared_prefill.py [--config configs/tiny.yaml] [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.results_file import save_result
from contracts.config import load_config
from contracts.data import encode_prompt, load_prompts
from rollout.hf_engine import HFEngine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--rounds", type=int, default=20, help="generate calls per side")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a replica's share)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    cfg = load_config(args.config)
    ro = cfg.rollout
    engine = HFEngine(cfg.model.path, seed=0)
    records = load_prompts(cfg.data.train_path)
    batches = [
        [
            encode_prompt(engine.tokenizer, r.messages, cfg.data.max_prompt_len, chat=cfg.data.chat)
            for r in records[i * ro.prompts_per_batch : (i + 1) * ro.prompts_per_batch]
        ]
        for i in range(args.rounds)
    ]
    seconds: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, int] = {True: 0, False: 0}
    for i, prompts in enumerate(batches):
        for shared in (i % 2 == 0, i % 2 != 0):  # alternate which side goes first
            engine.shared_prefill = shared
            t0 = time.perf_counter()
            groups = engine.generate(
                prompts,
                n=ro.group_size,
                max_tokens=ro.max_response_len,
                temperature=ro.temperature,
                top_p=ro.top_p,
                # the same per-sample seeds on both sides (`Engine.generate`): the same draws
                seeds=[
                    [(i * len(prompts) + p) * ro.group_size + j for j in range(ro.group_size)]
                    for p in range(len(prompts))
                ],
            )
            seconds[shared].append(time.perf_counter() - t0)
            tokens[shared] += sum(len(s.token_ids) for g in groups for s in g)

    rate = {side: tokens[side] / sum(seconds[side]) for side in (True, False)}
    prompt_len = statistics.mean(len(p) for b in batches for p in b)
    print(
        f"{args.config}: {ro.prompts_per_batch} prompts x {ro.group_size} responses, prompt "
        f"{prompt_len:.0f} tokens, up to {ro.max_response_len} response tokens, "
        f"{args.threads} thread(s), {args.rounds} calls a side"
    )
    for side, name in ((False, "expanded"), (True, "shared")):
        print(
            f"  {name:9s} {rate[side]:8.0f} response tokens/s, "
            f"median {statistics.median(seconds[side]) * 1000:.0f} ms a call"
        )
    speedup = rate[True] / rate[False]
    save_result(
        "shared_prefill",
        {
            "config": args.config,
            "threads": args.threads,
            "rounds": args.rounds,
            "prompt_tokens_mean": round(prompt_len, 1),
            "tokens_per_s_expanded": round(rate[False], 1),
            "tokens_per_s_shared": round(rate[True], 1),
            "speedup": round(speedup, 3),
        },
    )
    print(f"shared_prefill_speedup={speedup:.2f}")


if __name__ == "__main__":
    main()
