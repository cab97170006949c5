"""Verifier throughput: responses scored per second on one core, per verifier.

Responses are shaped like a math model's: a few sentences of reasoning, then `Answer: N` (or a
boxed answer), half of them right. The `dapo` and `strict-box` verifiers run in this process;
`math-verify` (when installed) runs in its sandboxed worker pool with one worker, so its figure
includes the inter-process hop. Nothing is asserted.

    .venv/bin/python bench/verifier_throughput.py [--responses 20000]

Last line: `verifier_responses_per_s=<the dapo verifier's responses per second>`.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.results_file import save_result  # noqa: E402  (a module beside this script)


def responses(n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        truth = a + b if rng.random() < 0.5 else a + b + rng.randint(1, 9)
        reasoning = (
            f"First add the tens and units of {a} and {b}. Carry where needed. "
            f"So the total is {a + b}. "
        ) * rng.randint(1, 4)
        answer = f"Answer: {truth}" if rng.random() < 0.5 else f"The answer is \\boxed{{{truth}}}"
        out.append((reasoning + answer, str(a + b)))
    return out


def measure(name: str, pairs: list[tuple[str, str]]) -> float:
    from reward.verifiers import make_scorer

    with make_scorer(name, workers=1) as scorer:
        scorer.score_many(pairs[:100])  # warm-up (a sandbox worker starts)
        start = time.perf_counter()
        for i in range(0, len(pairs), 256):
            scorer.score_many(pairs[i : i + 256])
        return len(pairs) / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--responses", type=int, default=20000)
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = parser.parse_args()
    pairs = responses(args.responses)
    rates = {}
    for name in ("dapo", "strict-box", "math-verify"):
        try:
            rates[name] = measure(
                name, pairs if name != "math-verify" else pairs[: args.responses // 10]
            )
        except (ImportError, ValueError) as exc:
            print(f"{name}: skipped ({exc})")
            continue
        print(f"{name:>12}: {rates[name]:9.0f} responses/s on one core")
    save_result("verifier_throughput", {"responses_per_s": rates}, args.out)
    print(f"verifier_responses_per_s={rates['dapo']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
