"""GPU check for a machine with one or more CUDA GPUs (prepared; run it when a GPU is lent).

1. Builds a small Qwen2 model from a config (no hub): hidden 512, 8 layers, head_dim 64, with a
   locally trained tokenizer and a short supervised warm start (CPU, about a minute).
2. Weight sync correctness: starts the CUDA vLLM engine, broadcasts perturbed weights to it from
   this process as rank 0 (NCCL from cuda:1 when there are two GPUs; gloo from host memory when
   there is one, because NCCL refuses two ranks on one device), and checks that the engine's
   weights equal the broadcast ones (parameter checksum) and that its log-probs match
   transformers with the new weights. Prints the sync time.
3. A short real DAPO run on the GPU: `dapo run` with the vLLM engine (bf16), the FSDP2 learner on
   NCCL with bf16 mixed precision and the fused log-prob head, and the weight group on gloo (one
   GPU: learner and replica share it) or NCCL (two or more: disjoint GPUs, as `--dry-run` prints
   first); evaluation rounds run on the vLLM replica. Prints tokens/s, sync time, the ledger, the
   evaluation history and the accuracy change.
4. With two or more GPUs: one DAPO step on 1 and 2 NCCL ranks must agree
   (`bench/multirank_check.py --backend nccl`).

    bash bench/gpu_check.sh            # the whole check; under 8 minutes on one H100/H200
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "runs" / "gpu-check"


def build_model() -> Path:
    from services.demo.synthetic import synth_rows
    from services.demo.tiny_base import ensure_tiny_base

    path = OUT / "model"
    info = ensure_tiny_base(
        path,
        train_rows=synth_rows(20000, seed=0),
        eval_rows=synth_rows(128, seed=1_000_003, start_index=10_000_000),
        model_kwargs={
            "hidden_size": 512,
            "num_layers": 8,
            "num_heads": 8,
            "num_kv_heads": 8,
            "intermediate_size": 1536,
        },
        max_sft_steps=800,
        progress=print,
    )
    print(f"model: {path} {json.dumps(info)}")
    return path


def check_sync(model_dir: Path) -> None:
    import torch.distributed as dist

    from contracts.config import load_config
    from contracts.runtime import free_port
    from contracts.weight_sync import (
        Announcement,
        WeightStream,
        broadcast_bucket,
        make_group_on_store,
        plan_buckets,
    )
    from rollout.vllm_engine import VLLMEngine

    two_gpus = torch.cuda.device_count() >= 2
    backend = "nccl" if two_gpus else "gloo"
    cfg = load_config(
        REPO / "configs" / "tiny.yaml",
        [
            f"model.path={model_dir}",
            "model.dtype=float32",
            "rollout.engine=vllm",
            "rollout.gpu_memory_utilization=0.3",
            "rollout.enforce_eager=true",
        ],
    )
    engine = VLLMEngine(cfg, str(model_dir))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    named = [
        (n, (p.detach() * 1.01 + 0.001 * torch.randn_like(p))) for n, p in model.named_parameters()
    ]
    device = torch.device("cuda", 1) if two_gpus else torch.device("cpu")
    if two_gpus:
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    buckets = plan_buckets(named, 64)
    ann = Announcement(
        policy_version=1,
        membership_epoch=1,
        replicas=("engine",),
        store_host="127.0.0.1",
        store_port=store.port,
        backend=backend,
        timeout_s=120.0,
        buckets=buckets,
    )
    tensors = dict(named)
    flats = [torch.cat([tensors[p.name].reshape(-1) for p in b]).to(device) for b in buckets]

    def root() -> None:
        group = make_group_on_store(store, ann, 0)
        for flat in flats:
            broadcast_bucket(group, flat, ann.timeout_s)

    thread = threading.Thread(target=root)
    start = time.monotonic()
    thread.start()
    engine.update_weights(WeightStream(ann, rank=1))
    thread.join()
    sync_s = time.monotonic() - start
    expected = sum(float(t.double().sum()) for _, t in named)
    got = engine.param_checksum()[0]
    print(
        f"weight sync over {backend}: {sum(f.numel() for f in flats) / 1e6:.1f}M params in "
        f"{sync_s:.3f}s; checksum engine {got:.6f} vs sent {expected:.6f}"
    )
    assert abs(got - expected) <= 1e-6 * max(1.0, abs(expected)), "weights differ after the sync"
    engine.close()


def short_run(model_dir: Path) -> None:
    weights = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    base = [
        sys.executable,
        "-m",
        "services.cli",
        "run",
        "--config",
        "configs/tiny.yaml",
        "--output-dir",
        str(OUT / "run"),
    ]
    cmd = [
        *base,
        f"model.path={model_dir}",
        "model.build_tiny=null",
        "model.dtype=bfloat16",
        "rollout.engine=vllm",
        "rollout.replicas=1",
        "rollout.gpu_memory_utilization=0.3",
        "rollout.torch_threads=null",
        "learner.backend=nccl",
        f"learner.weights_backend={weights}",
        "learner.torch_threads=null",
        "learner.total_steps=40",
        "eval.every_steps=20",
        "algorithm.train_batch_groups=64",
        "algorithm.mini_batch_groups=16",
        "checkpoint.every_steps=20",
    ]
    subprocess.run(
        [*cmd[: len(base)], "--dry-run", *cmd[len(base) :]], cwd=REPO, check=True, timeout=60
    )  # the placement
    start = time.monotonic()
    subprocess.run(cmd, cwd=REPO, check=True, timeout=360)
    summary = json.loads((OUT / "run" / "summary.json").read_text())
    print(
        f"short run: {summary['steps']} steps in {time.monotonic() - start:.0f}s; eval "
        f"{summary['base_eval_acc']:.3f} -> {summary['final_eval_acc']:.3f}; ledger "
        f"{summary['ledger']}; replicas {summary['replica_final_versions']}"
    )
    print(f"evaluation rounds (on the vLLM replica): {summary['eval_history']}")
    print(
        f"trained response tokens/s: {summary['train_tokens_per_s']:.0f}; mean weight sync "
        f"{summary['mean_sync_seconds']:.3f}s"
    )
    ledger = summary["ledger"]
    assert ledger["balanced"] and set(summary["replica_final_versions"].values()) == {
        summary["policy_version"]
    }
    assert ledger["evaluated"] == ledger["eval_issued"] > 0 and len(summary["eval_history"]) == 3


def multirank_nccl() -> None:
    if torch.cuda.device_count() < 2:
        print("multirank on NCCL: skipped (one GPU)")
        return
    subprocess.run(
        [sys.executable, "bench/multirank_check.py", "--backend", "nccl", "--world-sizes", "1,2"],
        cwd=REPO,
        check=True,
        timeout=240,
    )


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device")
    print(
        f"GPUs: {[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}; torch "
        f"{torch.__version__}"
    )
    model_dir = build_model()
    check_sync(model_dir)
    short_run(model_dir)
    multirank_nccl()
    print("gpu check passed")


if __name__ == "__main__":
    main()
