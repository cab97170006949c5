"""One table of the bench suite's headline figures (`bench/run_all.sh`), from the newest result
file of each bench in bench/results/; printed and written to bench/results/RESULTS.md with the
date, commit and machine.

    .venv/bin/python bench/results_table.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.results_file import RESULTS, provenance  # noqa: E402  (a module beside this script)

HOPS_PER_JOB = 4
"""prompts -> rollouts -> scored -> train -> trained (a filtered group stops one hop earlier)."""


def newest(name: str) -> dict[str, Any] | None:
    files = sorted(RESULTS.glob(f"*-{name}.json"))
    return json.loads(files[-1].read_text()) if files else None


def rows() -> list[tuple[str, str, str]]:
    """(figure, value, how it was measured)."""
    out: list[tuple[str, str, str]] = []
    a = newest("async_vs_sync")
    if a:
        out.append(
            (
                "async / sync speed-up",
                f"{a['measured_speedup']:.2f}x of an ideal {a['ideal_speedup']:.2f}x "
                f"(efficiency {a['efficiency']:.2f})",
                f"`async_vs_sync.py`: steps/hour with max_staleness 1 vs 0, {a['steps']} steps "
                f"each; ideal = perfect overlap of generation ({a['t_gen_s']:.2f} s) and training "
                f"({a['t_train_s']:.2f} s)",
            )
        )
    s = newest("sync_latency")
    if s:
        out.append(
            (
                "weight sync vs a bare broadcast",
                f"{s['mean_sync_s'] * 1e3:.1f} ms vs {s['flat_broadcast_s'] * 1e3:.1f} ms "
                f"({s['sync_over_flat']:.2f}x)",
                f"`sync_latency.py`: rollout slowed {s['slowdown']:g}x, in-flight updates; "
                f"{s['bytes'] / 2**20:.1f} MiB",
            )
        )
    h = newest("stream_hops")
    if h and a:
        per_step = a["async"]["jobs_issued_per_step"] * HOPS_PER_JOB * h["hop_ms"] / 1e3
        step_s = 3600.0 / a["async"]["steps_per_hour"]
        out.append(
            (
                "Redis hops per step / step time",
                f"{per_step * 1e3:.1f} ms / {step_s * 1e3:.0f} ms ({per_step / step_s:.1%})",
                f"`stream_hops.py`: {h['hop_ms']:.3f} ms per atomic hop of a preset-sized group x "
                f"{HOPS_PER_JOB} hops x {a['async']['jobs_issued_per_step']:.1f} jobs per step "
                "(async run)",
            )
        )
    v = newest("verifier_throughput")
    if v:
        rates = ", ".join(f"{k} {r:,.0f}" for k, r in v["responses_per_s"].items())
        out.append(
            (
                "verifier responses/s per core",
                rates,
                "`verifier_throughput.py`: math-style responses, one core",
            )
        )
    ls, t = newest("learner_step"), newest("time_to_target")
    if ls:
        floor_tps = t["floor"].get("train_tokens_per_s") if t else None
        vs = (
            f" vs the floor's {floor_tps:,.0f} ({ls['tokens_per_s'] / floor_tps:.2f}x)"
            if floor_tps
            else ""
        )
        out.append(
            (
                "learner tokens/s",
                f"{ls['tokens_per_s']:,.0f}{vs}",
                "`learner_step.py`: one rank, the preset's threads and batch shape; the floor "
                "trains with both cores",
            )
        )
    if t:
        out.append(
            (
                "RL seconds to +25 points",
                f"service {t['service_seconds_to_plus25']:.0f} s vs floor "
                f"{t['floor_seconds_to_plus25']:.0f} s (service_over_floor "
                f"{t['service_over_floor']:.2f}"
                + (
                    f"; whole run {t['service_over_floor_whole_run']:.2f}"
                    if "service_over_floor_whole_run" in t
                    else ""
                )
                + ")",
                f"`time_to_target.py`: {t['steps']} steps each, evaluation excluded on both sides",
            )
        )
    return out


def main() -> int:
    p = provenance()
    head = f"{p['date']}, commit {p['commit']}, {p['machine']}, tiny preset"
    table = [
        "| figure | value | measured by |",
        "|---|---|---|",
        *(f"| {a} | {b} | {c} |" for a, b, c in rows()),
    ]
    text = "\n".join([f"# Bench results\n\n{head}\n", *table, ""])
    (RESULTS / "RESULTS.md").write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
