"""The learner's achieved FLOP/s on a training step, as a fraction of a plain matmul's.

In one process: times a 2048 x 2048 matmul in fp32 and in bf16 on the learner's threads (the
CPU's practical peak, measured in the same run), then `Trainer.train_step` on batches shaped like
the preset's (`bench/learner_step.py`'s: prompts of 50-75% of `data.max_prompt_len`, responses of
3 to `rollout.max_response_len` tokens) for each variant: compute dtype (`learner.mixed_precision`
none = fp32, bf16) x layout (`learner.share_prompts`: `always` = each group's prompt once and its
responses packed behind it; `never` = one row per response, prompt and response padded). One
trainer per dtype, the layouts switched between steps; the variants take turns on every batch,
and each reports its best step (the least disturbed by other work on a shared machine; the
matmul is a best time too) and its mean. One update per step (`algorithm.mini_batch_groups` =
the step's groups, as the SmolLM2 preset runs), so no extra pass for old log-probs; one rank.

The work counted is what the step must do, the same for every variant, so padding and recomputed
prompts show up as a lower rate (formula, forward + backward = 3 x forward):

    FLOPs = 6 N_body T_ctx + 6 V H T_resp + 12 L H_attn A

N_body: parameters of the decoder layers (embedding lookups are no matmul); T_ctx: positions the
model must run, each group's prompt once plus every response token; V H: the output projection,
on the T_resp response positions only (the trainer's head scores nothing else); L layers,
H_attn = heads x head_dim, A = causal (query, key) pairs per layer within each response's
context (the prompt's pairs once per group, each response token's prompt + own prefix).

Also reported: |log pi_bf16 - log pi_fp32| over the response tokens of one batch (same weights,
eval mode): the behaviour/learner mismatch if generation stays fp32; and what the truncated
importance weight of docs/algorithm.md s9 makes of it, with the fp32 log-probs as the behaviour
policy: w = min(pi_bf16 / pi_fp32, is_clip), its mean and the share of tokens it truncates.

    .venv/bin/python bench/learner_flops.py [--config configs/tiny.yaml] [--groups 4]
        [--steps 2] [--variants fp32-packed,bf16-packed,...] [overrides]

One line per variant; last line `learner_bf16_fraction_of_matmul=<the bf16 packed variant's best
step's FLOP/s over the bf16 matmul's>`.
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.learner_step import preset_groups  # noqa: E402  (a script beside this one)
from bench.results_file import save_result  # noqa: E402

DTYPES = {"fp32": "none", "bf16": "bf16"}  # variant name -> learner.mixed_precision
LAYOUTS = {"packed": "always", "rows": "never"}  # variant name -> learner.share_prompts
VARIANTS = [f"{d}-{layout}" for d in DTYPES for layout in LAYOUTS]


def matmul_flops(dtype: Any, seconds: float = 1.5, n: int = 2048) -> float:
    """FLOP/s of an n x n matmul in `dtype`, best of repeated timings over about `seconds`."""
    import torch

    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b  # warm-up: kernel selection and packing buffers
    best, start = math.inf, time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def step_flops(batch: Any, model_config: Any, n_body: int) -> tuple[float, float]:
    """(FLOPs the step must do by the module docstring's formula, response tokens)."""
    P = batch.prompt_len
    prompt_lens, resp_lens = (
        batch.attention_mask[:, :P].sum(-1),
        batch.attention_mask[:, P:].sum(-1),
    )
    t_ctx = pairs = 0.0
    for group in batch.group_index.unique().tolist():
        rows = (batch.group_index == group).nonzero().squeeze(-1)
        p = float(prompt_lens[rows[0]])
        t_ctx += p + float(resp_lens[rows].sum())
        pairs += p * (p + 1) / 2
        pairs += sum(n * p + n * (n + 1) / 2 for n in resp_lens[rows].tolist())
    t_resp = float(resp_lens.sum())
    c = model_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    h_attn = c.num_attention_heads * head_dim
    flops = (
        6 * n_body * t_ctx
        + 6 * c.vocab_size * c.hidden_size * t_resp
        + 12 * c.num_hidden_layers * h_attn * pairs
    )
    return flops, t_resp


def body_params(model: Any) -> int:
    """Parameters of the decoder layers (full sizes: FSDP shards are DTensors of the full
    shape)."""
    return sum(p.numel() for p in model.model.layers.parameters())


def probe_log_probs(trainer: Any, batch: Any) -> Any:
    """Eval-mode log-probs of `batch`'s response tokens, packed layout."""
    import torch

    trainer.model.eval()
    trainer.share_prompts = True
    with torch.no_grad():
        logp, _ = trainer._forward(batch, entropy=False)
    return logp


def time_variants(
    trainers: dict[str, Any], variants: list[str], batches: list[Any], warmup: int
) -> dict[str, list[float]]:
    """Seconds of each variant's `train_step` on each timed batch. The variants take turns on
    every batch, so a busy spell of a shared machine slows them alike, not one of them."""
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    for i, batch in enumerate(batches):
        for variant in variants:
            dtype, layout = variant.split("-")
            trainer = trainers[dtype]
            trainer.cfg.learner.share_prompts = LAYOUTS[layout]
            t0 = time.perf_counter()
            trainer.train_step(batch, policy_version=i)
            if i >= warmup:
                seconds[variant].append(time.perf_counter() - t0)
    return seconds


def summarise(seconds: list[float], work: list[tuple[float, float]], peak: float) -> dict[str, Any]:
    """A variant's figures from its step times and the (FLOPs, response tokens) of each step:
    the best step (least disturbed by other work on the machine) and the mean."""
    rates = [f / s for s, (f, _) in zip(seconds, work, strict=True)]
    best = max(range(len(rates)), key=rates.__getitem__)
    flops, tokens = sum(f for f, _ in work), sum(t for _, t in work)
    return {
        "s_per_step_best": seconds[best],
        "s_per_step_mean": sum(seconds) / len(seconds),
        "flops_per_s": rates[best],
        "flops_per_s_mean": flops / sum(seconds),
        "response_tokens_per_s": work[best][1] / seconds[best],
        "response_tokens_per_s_mean": tokens / sum(seconds),
        "fraction_of_matmul": rates[best] / peak,
    }


def mismatch(lp32: Any, lp16: Any, mask: Any, is_clip: float) -> dict[str, float]:
    """bf16 learner vs fp32 behaviour log-probs on the same tokens, and the truncated importance
    weight they give (docs/algorithm.md s9)."""
    diff = (lp16 - lp32)[mask]
    ratio = diff.exp()
    return {
        "logp_abs_diff_mean": float(diff.abs().mean()),
        "logp_abs_diff_max": float(diff.abs().max()),
        "is_ratio_min": float(ratio.min()),
        "is_ratio_max": float(ratio.max()),
        "is_weight_mean": float(ratio.clamp(max=is_clip).mean()),
        "is_clipfrac": float((ratio > is_clip).float().mean()),
        "ratio_outside_ppo_clip": float(((ratio < 0.8) | (ratio > 1.28)).float().mean()),
        "tokens": float(mask.sum()),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from contracts.config import load_config
    from contracts.model_source import with_local_model
    from learner.batch import build_batch
    from learner.service import init_distributed
    from learner.trainer import Trainer
    from services.data.prepare import prepare

    base = load_config(REPO / args.config, args.overrides)
    groups = args.groups or base.algorithm.train_batch_groups
    shape = [f"algorithm.train_batch_groups={groups}", f"algorithm.mini_batch_groups={groups}"]
    base = load_config(REPO / args.config, [*args.overrides, *shape])
    prepare(base)  # the cached base model and data
    threads = base.learner.torch_threads or 1
    torch.set_num_threads(threads)
    peak = {"fp32": matmul_flops(torch.float32), "bf16": matmul_flops(torch.bfloat16)}
    for name, value in peak.items():
        print(f"matmul 2048^2 {name}, {threads} threads: {value / 1e9:.1f} GFLOP/s", flush=True)
    init_distributed(base)
    rng = random.Random(0)
    batches = [
        build_batch(preset_groups(rng, base, version=i), pad_id=0)
        for i in range(args.warmup + args.steps)
    ]
    variants = args.variants.split(",")
    trainers, probes = {}, {}
    for dtype in dict.fromkeys(v.split("-")[0] for v in variants):
        cfg = with_local_model(
            load_config(
                REPO / args.config,
                [*args.overrides, *shape, f"learner.mixed_precision={DTYPES[dtype]}"],
            )
        )
        torch.manual_seed(0)
        trainers[dtype] = Trainer(cfg, rank=0, world_size=1, backend="gloo")
        probes[dtype] = probe_log_probs(trainers[dtype], batches[0])
    n_body = body_params(next(iter(trainers.values())).model)
    model_config = next(iter(trainers.values())).model.config
    work = [step_flops(b, model_config, n_body) for b in batches[args.warmup :]]
    seconds = time_variants(trainers, variants, batches, args.warmup)
    out: dict[str, Any] = {
        "matmul_gflops": {k: v / 1e9 for k, v in peak.items()},
        "threads": threads,
        "groups_per_step": groups,
        "group_size": base.rollout.group_size,
        "steps": args.steps,
        "gflop_per_step": [f / 1e9 for f, _ in work],
        "response_tokens_per_step": [t for _, t in work],
    }
    for variant in variants:
        dtype = variant.split("-")[0]
        r = summarise(seconds[variant], work, peak[dtype])
        r["seconds"] = seconds[variant]
        r["master_dtypes"] = sorted({str(p.dtype) for p in trainers[dtype].model.parameters()})
        out[variant] = r
        print(
            f"{variant:<12} best {r['s_per_step_best']:6.2f} s/step (mean "
            f"{r['s_per_step_mean']:6.2f})  {r['response_tokens_per_s']:7.1f} response tokens/s"
            f"  {r['flops_per_s'] / 1e9:6.1f} GFLOP/s = {r['fraction_of_matmul']:.3f} of the "
            f"{dtype} matmul  master weights {','.join(r['master_dtypes'])}",
            flush=True,
        )
    if "fp32" in probes and "bf16" in probes:
        mask = batches[0].response_mask.bool()
        out["mismatch"] = mismatch(probes["fp32"], probes["bf16"], mask, base.algorithm.is_clip)
    del trainers
    gc.collect()
    dist.destroy_process_group()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--groups", type=int, default=0, help="groups per step (0: the preset's)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per variant first")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("overrides", nargs="*", help="config overrides, dotted.key=value")
    args = parser.parse_args()
    figures = measure(args)
    m = figures.get("mismatch")
    if m:
        print(
            f"bf16 vs fp32 log-probs ({m['tokens']:.0f} tokens): |diff| mean "
            f"{m['logp_abs_diff_mean']:.2e} max {m['logp_abs_diff_max']:.2e}; as "
            f"pi_old/mu: ratio {m['is_ratio_min']:.3f}..{m['is_ratio_max']:.3f}, "
            f"truncated at is_clip on {m['is_clipfrac']:.2%} of tokens, outside the PPO "
            f"clip range on {m['ratio_outside_ppo_clip']:.2%}"
        )
    save_result(
        "learner_flops",
        {"config": args.config, "overrides": args.overrides, **figures},
        args.out,
    )
    headline = figures.get("bf16-packed", {}).get("fraction_of_matmul")
    if headline is not None:
        print(f"learner_bf16_fraction_of_matmul={headline:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
