"""Learner memory per rank for 1, 2 and 4 gloo ranks: the sharded part must shrink with the ranks.

Builds a Qwen2-shaped model of about 134M parameters from a config (random weights saved as
safetensors), then for each world size starts that many learner ranks under
torch.distributed.run. Each rank records its resident memory before the model exists (torch,
transformers, the process group: the fixed part) and its peak after building the sharded model
from the files and taking one DAPO step (parameters, gradients and AdamW state: the sharded
part). Then every rank gathers the full weights for a publication and rank 0 stages them in its
host buckets as the learner does after each step; rank 0's extra peak during that (its peak
reset first) must stay within the host copy (in the model's dtype) plus two buckets. Nothing is
asserted; figures only.

    .venv/bin/python bench/learner_memory.py [--world-sizes 1,2,4] [--out bench/results]

Last line: `shard_ratio=<sharded peak per rank at W=2 / at W=1>` (ideal 0.5).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.multirank_check import launch_ranks, make_groups  # noqa: E402  (a script beside this one)
from bench.results_file import save_result  # noqa: E402  (a module beside this script)

MODEL = {
    "vocab_size": 32000,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def build_model(out: Path) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**MODEL))
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def peak_since_reset_mib() -> float:
    """VmHWM: the peak resident memory since the last `reset_peak()` (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def publication_extra_mib(trainer: Any, cfg: Any, rank: int) -> dict[str, float]:
    """Rank 0's extra peak memory while one publication's weights are gathered and staged."""
    from learner.weight_publisher import WeightPublisher

    publisher = None
    if rank == 0:  # staging needs no Redis; publish() (not called here) does
        publisher = WeightPublisher(
            run_state=None,
            telemetry=None,
            host="127.0.0.1",
            backend="gloo",
            timeout_s=60,  # type: ignore[arg-type]
            bucket_mb=cfg.learner.broadcast_bucket_mb,
            dtype=cfg.model.dtype,
            key=b"not-published",
        )
    before = current_rss_mib()
    reset_peak()
    named = trainer.named_full_params()
    if publisher is None:
        for _ in named:  # the other ranks take part in every gather
            pass
        return {}
    publisher.stage(1, named, trainer.param_shapes())
    extra = peak_since_reset_mib() - before
    host = sum(flat.numel() * flat.element_size() for flat in publisher.flat) / 2**20
    return {
        "publish_extra_mib": extra,
        "host_copy_mib": host,
        "bucket_mib": float(cfg.learner.broadcast_bucket_mb),
    }


def worker(model_dir: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from contracts.config import load_config
    from learner.batch import build_batch
    from learner.trainer import Trainer

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    cfg = load_config(
        REPO / "configs" / "tiny.yaml",
        [
            f"model.path={model_dir}",
            "learner.micro_batch_size=2",
            "algorithm.train_batch_groups=4",
            "algorithm.mini_batch_groups=4",
        ],
    )
    batch = build_batch(make_groups(), pad_id=0)
    fixed = current_rss_mib()
    trainer = Trainer(cfg, rank=rank, world_size=world, backend="gloo")
    built = current_rss_mib()
    trainer.train_step(batch, policy_version=1)
    stepped = current_rss_mib()
    figures = {
        "rank": rank,
        "world": world,
        "fixed_mib": fixed,
        "after_build_mib": built,
        "after_step_mib": stepped,
        "peak_mib": peak_rss_mib(),
        **publication_extra_mib(trainer, cfg, rank),
    }
    Path(out_dir, f"w{world}-r{rank}.json").write_text(json.dumps(figures))
    dist.barrier()  # no rank leaves (closing its sockets) while another still talks to it
    dist.destroy_process_group()


def run_world(model_dir: Path, world: int, out_dir: Path) -> list[dict[str, Any]]:
    # glibc keeps freed heap memory, so the peak RSS would count FSDP's transient all-gather and
    # reduce-scatter buffers long after they are freed; serving every allocation of 64 KiB or more
    # with its own mmap returns it on free, so the peak RSS is the peak of live memory.
    launch_ranks(
        str(Path(__file__).resolve()),
        world,
        str(model_dir),
        str(out_dir),
        env={"MALLOC_MMAP_THRESHOLD_": "65536"},
        timeout_s=1200,
    )
    return [json.loads(Path(out_dir, f"w{world}-r{r}.json").read_text()) for r in range(world)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="1,2,4")
    parser.add_argument(
        "--out", default=str(REPO / "bench" / "results"), help="where the results file goes"
    )
    parser.add_argument(
        "--worker", nargs=2, metavar=("MODEL_DIR", "OUT_DIR"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    worlds = [int(w) for w in args.world_sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        n_params = build_model(Path(tmp) / "model")
        rows = {w: run_world(Path(tmp) / "model", w, Path(tmp)) for w in worlds}
    print(
        f"model: Qwen2-shaped, {n_params / 1e6:.1f}M parameters (fp32 weights + grads + AdamW = "
        f"{16 * n_params / 2**20:.0f} MiB unsharded)"
    )
    print(f"{'ranks':>5} {'rank':>4} {'fixed MiB':>10} {'peak MiB':>9} {'sharded peak MiB':>17}")
    sharded = {}
    for w in worlds:
        for r in rows[w]:
            print(
                f"{w:>5} {r['rank']:>4} {r['fixed_mib']:>10.0f} {r['peak_mib']:>9.0f} "
                f"{r['peak_mib'] - r['fixed_mib']:>17.0f}"
            )
        sharded[w] = max(r["peak_mib"] - r["fixed_mib"] for r in rows[w])
    for w in worlds:
        r0 = rows[w][0]
        bound = r0["host_copy_mib"] + 2 * r0["bucket_mib"]
        print(
            f"publication, {w} rank(s): rank 0 extra peak {r0['publish_extra_mib']:.0f} MiB; "
            f"bound = host copy {r0['host_copy_mib']:.0f} + 2 x {r0['bucket_mib']:.0f} MiB buckets "
            f"= {bound:.0f} MiB ({'within' if r0['publish_extra_mib'] <= bound else 'OVER'})"
        )
    ratio = sharded[2] / sharded[1] if 1 in sharded and 2 in sharded else float("nan")
    save_result(
        "learner_memory",
        {"params": n_params, "per_rank": rows, "sharded_peak_mib": sharded, "shard_ratio": ratio},
        args.out,
    )
    print(f"shard_ratio={ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
