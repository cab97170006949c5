"""One DAPO step on the same batch with 1, 2 and 4 learner ranks (gloo, CPU): the results must agree.

Every `loss_agg` mode is run on one batch whose mini-batches do not divide evenly over the ranks
(some ranks get fewer rows and a padding micro-batch), with on- and off-policy rows. For each
world size it records the logged metrics, the gradient the optimizer steps with (after
clipping) and the parameters after the step, and compares them with one rank. The gradient is the
sensitive figure: AdamW's first step is nearly lr * sign(gradient), so a gradient off by a
constant factor barely moves the parameters. `grad_clip` is set so that some modes are clipped
and some are not with one rank, so a wrongly scaled gradient also clips differently.

    .venv/bin/python bench/multirank_check.py [--world-sizes 1,2,4] [--json OUT] [--tied] [--lora]

`--tied` runs a Llama whose output projection is its input embedding (SmolLM2's shape, scaled
down): under FSDP2 the one matrix gets both uses' gradients on every rank.

Prints a table and, as its last line, `max_abs_param_diff=<largest |param(W) - param(1)|>`.
"""  # noqa: E501 (the first line is the argparse description: __doc__.splitlines()[0])

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
N_GROUPS, GROUP_SIZE = 4, 3  # 12 rows; 2 mini-batches of 6 rows: 4 ranks get 2, 2, 1, 1


def build_model(out: Path, *, tied: bool = False) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape: dict[str, Any] = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128}
    shape |= {"num_hidden_layers": 2, "num_key_value_heads": 2, "max_position_embeddings": 64}
    if tied:  # grouped-query attention as in SmolLM2: 4 heads sharing 2 key/value heads
        cfg = LlamaConfig(**shape, num_attention_heads=4, tie_word_embeddings=True)
        LlamaForCausalLM(cfg).save_pretrained(out)
    else:
        cfg = Qwen2Config(**shape, num_attention_heads=2, tie_word_embeddings=False)
        Qwen2ForCausalLM(cfg).save_pretrained(out)


def make_groups() -> list[Any]:
    from contracts.schemas import PromptJob, Response, ScoredGroup

    rng = random.Random(7)
    groups = []
    for g in range(N_GROUPS):
        version = g % 2  # half on-policy (version 1), half one version old (behaviour correction)
        job = PromptJob(
            group_id=f"g{g}",
            prompt_index=g,
            prompt_ids=[rng.randrange(3, 90) for _ in range(rng.randint(3, 8))],
            ground_truth="1",
            issued_version=version,
            issued_at=0.0,
        )
        responses = []
        for _ in range(GROUP_SIZE):
            n = rng.randint(1, 6)
            responses.append(
                Response(
                    token_ids=[rng.randrange(3, 90) for _ in range(n)],
                    logprobs=[-4.5 + rng.uniform(-0.3, 0.3) for _ in range(n)],
                    finish_reason="stop",
                )
            )
        rewards = [1.0, -1.0] + [rng.choice([1.0, -1.0]) for _ in range(GROUP_SIZE - 2)]
        groups.append(
            ScoredGroup(
                job=job,
                policy_version=version,
                replica_id="r",
                responses=responses,
                scores=rewards,
                acc=[r > 0 for r in rewards],
                rewards=rewards,
                preds=[""] * GROUP_SIZE,
            )
        )
    return groups


def worker(model_dir: str, out: str) -> None:
    """One rank (under torch.distributed.run): every mode, one step each,
    results saved by rank 0."""
    import torch.distributed as dist

    from contracts.config import load_config
    from learner.batch import build_batch
    from learner.trainer import Trainer

    backend = os.environ.get(
        "DAPO_BENCH_BACKEND", "gloo"
    )  # nccl: one GPU per rank (bench/gpu_check.py)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    batch = build_batch(make_groups(), pad_id=0)
    results: dict[str, Any] = {}
    for mode in os.environ.get("DAPO_BENCH_MODES", ",".join(MODES)).split(","):
        cfg = load_config(
            REPO / "configs" / "tiny.yaml",
            [
                f"model.path={model_dir}",
                "learner.lr=1e-3",
                "learner.warmup_steps=0",
                "learner.micro_batch_size=1",
                "learner.grad_clip=5.0",
                f"algorithm.loss_agg={mode}",
                f"algorithm.train_batch_groups={N_GROUPS}",
                "algorithm.mini_batch_groups=2",
                "algorithm.entropy_coef=0.01",
                *(
                    ["learner.lora.enabled=true", "learner.lora.rank=4"]
                    if os.environ.get("DAPO_BENCH_LORA")
                    else []
                ),
            ],
        )
        trainer = Trainer(cfg, rank=rank, world_size=world, backend=backend)
        grads = record_clipped_gradients(trainer)
        metrics = trainer.train_step(batch, policy_version=1)
        params = {n: t.cpu().clone() for n, t in trainer.named_full_params()}
        results[mode] = {"metrics": metrics, "grads": grads, "params": params}
        # The sharded model holds the process group: free it now, while the interpreter is whole.
        # A trainer in a reference cycle would otherwise be collected during interpreter
        # finalization, tearing down gloo's threads there, which can abort the rank (SIGABRT,
        # "terminate called without an active exception") after its work is done.
        del trainer
        gc.collect()
    if rank == 0:
        torch.save(results, out)
    dist.barrier()  # no rank leaves (closing its sockets) while another still talks to it
    dist.destroy_process_group()
    gc.collect()


def record_clipped_gradients(trainer: Any) -> list[torch.Tensor]:
    """Wrap the optimizer's step to keep the full gradient it receives, after clipping (gathering
    a sharded gradient is a collective, and every rank steps, so every rank takes part)."""
    grads: list[torch.Tensor] = []
    step = trainer.optimizer.step

    def recording_step(*args: Any, **kwargs: Any) -> Any:
        grads.append(torch.cat([_full(p.grad).reshape(-1) for p in trainer.trainable]).cpu())
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    return grads


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def launch_ranks(
    script: str, world: int, *args: str, env: dict[str, str] | None = None, timeout_s: int = 600
) -> None:
    """Run `script --worker ARGS` as `world` gloo ranks under torch.distributed.run (one thread
    each); raise with the output's tail when any rank fails."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        script,
        "--worker",
        *args,
    ]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(
        cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout_s
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{world} ranks failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def run_world(model_dir: Path, world: int, out: Path) -> dict[str, Any]:
    launch_ranks(str(Path(__file__).resolve()), world, str(model_dir), str(out))
    loaded: dict[str, Any] = torch.load(out, weights_only=True)
    return loaded


def compare(base: dict[str, Any], other: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per mode: the largest relative metric difference (relative to max(|value|, 1e-3)), and the
    largest absolute gradient and parameter differences."""
    out = {}
    for mode in base:
        a, b = base[mode], other[mode]
        metric_diff = max(
            abs(a["metrics"][k] - b["metrics"][k]) / max(abs(a["metrics"][k]), 1e-3)
            for k in a["metrics"]
        )
        grad_diff = max(
            float((x - y).abs().max()) for x, y in zip(a["grads"], b["grads"], strict=True)
        )
        grad_scale = max(float(x.abs().max()) for x in a["grads"])
        param_diff = max(float((a["params"][n] - b["params"][n]).abs().max()) for n in a["params"])
        out[mode] = {
            "metric_rel_diff": metric_diff,
            "grad_abs_diff": grad_diff,
            "grad_abs_max": grad_scale,
            "param_abs_diff": param_diff,
            "pg_loss": b["metrics"]["actor/pg_loss"],
            "grad_norm": b["metrics"]["actor/grad_norm"],
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="1,2,4")
    parser.add_argument("--json", help="also write the comparison here")
    parser.add_argument(
        "--backend", default="gloo", choices=["gloo", "nccl"], help="nccl: one GPU per rank"
    )
    parser.add_argument("--modes", default=",".join(MODES), help="loss_agg modes, comma-separated")
    parser.add_argument("--tied", action="store_true", help="a tied-embedding Llama")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (learner.lora)")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL_DIR", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    worlds = [int(w) for w in args.world_sizes.split(",")]
    os.environ["DAPO_BENCH_BACKEND"] = args.backend  # read by the ranks
    os.environ["DAPO_BENCH_MODES"] = args.modes
    if args.lora:
        os.environ["DAPO_BENCH_LORA"] = "1"
    modes = args.modes.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        build_model(model_dir, tied=args.tied)
        results = {w: run_world(model_dir, w, Path(tmp) / f"w{w}.pt") for w in worlds}
    base = results[worlds[0]]
    report = {w: compare(base, results[w]) for w in worlds[1:]}
    print(
        f"{'ranks':>5} {'loss_agg':<24} {'pg_loss':>10} {'grad_norm':>10} {'metric rel':>11} "
        f"{'grad abs':>10} {'param abs':>10}"
    )
    for mode in modes:
        m = base[mode]["metrics"]
        print(
            f"{worlds[0]:>5} {mode:<24} {m['actor/pg_loss']:>10.6f} {m['actor/grad_norm']:>10.6f}"
        )
        for w in worlds[1:]:
            r = report[w][mode]
            print(
                f"{w:>5} {mode:<24} {r['pg_loss']:>10.6f} {r['grad_norm']:>10.6f} "
                f"{r['metric_rel_diff']:>11.2e} {r['grad_abs_diff']:>10.2e} "
                f"{r['param_abs_diff']:>10.2e}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({str(w): r for w, r in report.items()}, indent=1))
    worst = max((r[mode]["param_abs_diff"] for r in report.values() for mode in modes), default=0.0)
    print(f"max_abs_param_diff={worst:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
