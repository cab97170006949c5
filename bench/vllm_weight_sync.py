"""Rollout engines side by side on the tiny model: start-up, generation, weight sync, memory.

Builds a random tiny Qwen2 (the CPU demo's shape: hidden 128, 4 layers, head_dim 32, untied) in
a temporary directory, then for the transformers engine (HFEngine) and the vLLM engine in turn:
start-up time, the first generate call (vLLM compiles its sampler kernels there), steady-state
generate tokens/s, and the wall time of weight syncs received over a real gloo side group with
this process as learner rank 0. RSS counts the engine's child processes too.

    .venv/bin/python bench/vllm_weight_sync.py [--prompts 8] [--n 8] [--max-tokens 32]
        [--model catalog://smollm2-135m-instruct | DIR]

`--model` measures a given model instead of the tiny one (a directory or a `catalog://` name),
with a bare broadcast of the same bytes to one receiving process beside the syncs.

Last line: `vllm_over_transformers=<vLLM generate tokens/s / transformers generate tokens/s>`.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

from contracts.config import DapoConfig, build_config
from contracts.weight_sync import (
    Announcement,
    WeightStream,
    broadcast_bucket,
    flat_broadcast_seconds,
    make_group_on_store,
    plan_buckets,
)
from rollout.engine import Engine, make_engine
from services.demo.tiny_base import tiny_qwen2_config, train_tokenizer

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.results_file import save_result  # noqa: E402  (a module beside this script)

TEXTS = ["What is 12 + 30? Answer: 42", "Compute 7 * 6. Answer: 42", "the quick brown fox"] * 20


def build_model(path: Path, vocab: int = 512, intermediate: int = 512) -> Qwen2ForCausalLM:
    tokenizer = train_tokenizer(TEXTS, vocab_size=vocab)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_qwen2_config(vocab, intermediate_size=intermediate)).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


def config(model_dir: Path, engine: str) -> DapoConfig:
    return build_config(
        {
            "model": {"path": str(model_dir)},
            "data": {"train_path": "unused.jsonl", "max_prompt_len": 256},
            "rollout": {"engine": engine, "max_response_len": 256, "cpu_kv_cache_gib": 1},
            "reward": {"overlong": {"buffer_len": 16}},
        }
    )


def rss_gib() -> float:
    """This process plus all its descendants (vLLM's engine core and workers)."""
    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):  # a child that just exited
            total += p.memory_info().rss
    return total / 2**30


def sync_once(engine: Engine, params: dict[str, torch.Tensor], version: int) -> float:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ann = Announcement(
        policy_version=version,
        membership_epoch=version,
        replicas=("replica-0",),
        store_host="127.0.0.1",
        store_port=store.port,
        backend="gloo",
        timeout_s=60.0,
        buckets=plan_buckets(list(params.items()), bucket_mb=256),
    )

    def learner() -> None:
        group = make_group_on_store(store, ann, 0)
        for bucket in ann.buckets:
            broadcast_bucket(group, torch.cat([params[p.name].reshape(-1) for p in bucket]), 60.0)

    thread = threading.Thread(target=learner, daemon=True)
    start = time.monotonic()
    thread.start()
    engine.update_weights(WeightStream(ann, rank=1))
    thread.join()
    return time.monotonic() - start


def bench(
    kind: str, model_dir: Path, params: dict[str, torch.Tensor], args: argparse.Namespace
) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (24,), generator=gen).tolist() for _ in range(args.prompts)]
    kw = {"n": args.n, "max_tokens": args.max_tokens, "temperature": 1.0, "top_p": 1.0}

    start = time.monotonic()
    engine = make_engine(config(model_dir, kind), str(model_dir))
    startup = time.monotonic() - start
    try:
        start = time.monotonic()
        engine.generate(prompts, **kw)
        first = time.monotonic() - start
        rates = []
        for _ in range(args.repeats):
            start = time.monotonic()
            groups = engine.generate(prompts, **kw)
            seconds = time.monotonic() - start
            rates.append(sum(len(s.token_ids) for g in groups for s in g) / seconds)
        syncs = [sync_once(engine, params, version=v) for v in range(1, args.syncs + 1)]
        rss = rss_gib()
    finally:
        engine.close()
    print(
        f"{kind:12s} startup {startup:6.1f}s  first generate {first:6.2f}s  "
        f"generate {statistics.median(rates):8.0f} tok/s  "
        f"weight sync median {statistics.median(syncs):.3f}s (max {max(syncs):.3f}s)  "
        f"RSS {rss:.2f} GiB"
    )
    return {
        "startup_s": startup,
        "first_generate_s": first,
        "generate_tokens_per_s": statistics.median(rates),
        "sync_median_s": statistics.median(syncs),
        "rss_gib": rss,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--engines", default="transformers,vllm")
    parser.add_argument("--model", help="a model directory or catalog://NAME (default: tiny)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model_dir = local_model(args.model)
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        else:
            model_dir = Path(tmp) / "tiny"
            model = build_model(model_dir)
        # named_parameters names a tied matrix once, as the learner's broadcast does.
        params = {k: v.detach() * 1.01 for k, v in model.named_parameters()}
        numel = sum(v.numel() for v in params.values())
        nbytes = sum(v.numel() * v.element_size() for v in params.values())
        print(
            f"{args.model or 'tiny Qwen2'}: {numel / 1e6:.2f}M parameters, "
            f"{args.prompts} prompts x n={args.n}"
        )
        figures = {kind: bench(kind, model_dir, params, args) for kind in args.engines.split(",")}
    flat = flat_broadcast_seconds(nbytes, replicas=1)
    print(f"bare broadcast of the same {nbytes / 2**20:.0f} MiB to 1 process: {flat:.3f}s")
    name = "engines" if not args.model else f"engines-{Path(str(model_dir)).name}"
    save_result(name, {"model": args.model, "bytes": nbytes, "flat_s": flat, **figures}, args.out)
    if {"vllm", "transformers"} <= set(figures):
        ratio = (
            figures["vllm"]["generate_tokens_per_s"]
            / figures["transformers"]["generate_tokens_per_s"]
        )
        print(f"vllm_over_transformers={ratio:.2f}")


def local_model(spec: str) -> Path:
    """The directory of `--model`: a `catalog://` model fetched into the cache, else `spec`."""
    from contracts.model_catalog import catalog_name, fetch_catalog_model

    name = catalog_name(spec)
    return Path(spec) if name is None else fetch_catalog_model(name)


if __name__ == "__main__":
    main()
