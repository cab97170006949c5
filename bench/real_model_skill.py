"""What a model can do on the real-model task, problem by problem: the skill report.

For a model directory (the base, or a run's `final_model`), on the preset's held-out two-digit
problems (`configs/smollm2-135m.yaml`: no (a, b) nor (b, a) of them in training) and on
three-digit sums it never trained on (`data.synth.difficulty` 8, the same few-shot prompt):

- greedy pass@1 (temperature 0);
- avg@8 at temperature 1.0 (the mean accuracy of 8 samples per problem, each seeded by its
  problem and index as the run's evaluation is: `eval.seed`), and pass@8 (at least one of the 8
  right);
- each graded strict (`first-line`: the first line is exactly the sum) and lenient
  (`first-number`: its first integer is), each split by problems with and without a carry.

Every figure carries a bootstrap 95% interval over problems. Whether training taught a skill or
sharpened one: if the trained model's avg@8 exceeds the base model's pass@8, it answers correctly
more often than the base could in 8 tries.

    .venv/bin/python bench/real_model_skill.py [--model-dir DIR] [--three-digit 400] [overrides]

Last line: `avg8_strict=<held-out avg@8, strict>`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.results_file import save_result  # noqa: E402  (a module beside this script)
from contracts.eval_stats import accuracy_interval  # noqa: E402

CONFIG = "configs/smollm2-135m.yaml"
SAMPLES = 8


def has_carry(numbers: list[int]) -> bool:
    """Whether adding the numbers column by column carries anywhere."""
    carry, a, b = 0, numbers[0], numbers[1]
    while a or b:
        carry = (a % 10 + b % 10 + carry) // 10
        if carry:
            return True
        a, b = a // 10, b // 10
    return False


def three_digit_rows(n: int, seed: int) -> list[dict[str, Any]]:
    from services.demo.synthetic import synth_rows

    return synth_rows(n, difficulty=8, seed=seed, template="few-shot", split="eval")


def _interval(values: list[float]) -> list[float]:
    mean = sum(values) / len(values) if values else float("nan")
    return [mean, *accuracy_interval(values)]


def report(engine: Any, tokenizer: Any, rows: list[dict[str, Any]], cfg: Any) -> dict[str, Any]:
    """The figures of one problem set (rows in the synthetic task's schema)."""
    from contracts.data import encode_prompt
    from reward.rules import verify_first_line, verify_first_number
    from rollout.seeds import eval_seeds

    prompts = [
        encode_prompt(tokenizer, r["prompt"], cfg.data.max_prompt_len, chat=cfg.data.chat)
        for r in rows
    ]
    kw = dict(max_tokens=cfg.rollout.max_response_len, top_p=1.0, stop=cfg.rollout.stop)
    greedy = engine.generate(prompts, n=1, temperature=0.0, **kw)
    sampled = engine.generate(
        prompts,
        n=SAMPLES,
        temperature=1.0,
        seeds=[eval_seeds(cfg.eval.seed, i, SAMPLES) for i in range(len(rows))],
        **kw,
    )
    per: dict[str, dict[str, list[float]]] = {}
    for row, [first], group in zip(rows, greedy, sampled, strict=True):
        truth = row["reward_model"]["ground_truth"]
        carry = "carry" if has_carry(row["extra_info"]["numbers"]) else "no_carry"
        texts = tokenizer.batch_decode([s.token_ids for s in group], skip_special_tokens=True)
        greedy_text = tokenizer.decode(first.token_ids, skip_special_tokens=True)
        for grade, rule in (("strict", verify_first_line), ("lenient", verify_first_number)):
            right = [rule(t, truth).acc for t in texts]
            greedy_right = rule(greedy_text, truth)
            values = {
                "greedy_pass1": float(greedy_right.acc),
                f"avg@{SAMPLES}": sum(right) / len(right),
                f"pass@{SAMPLES}": float(any(right)),
            }
            for split in ("all", carry):
                for name, value in values.items():
                    per.setdefault(f"{split}/{grade}/{name}", {}).setdefault("v", []).append(value)
    return {key: _interval(v["v"]) for key, v in sorted(per.items())}


def skill_report(model_dir: str | None, overrides: list[str], three_digit: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from contracts.config import load_config
    from learner.evaluation import eval_problems
    from rollout.engine import make_engine
    from services.data.prepare import prepare

    cfg = prepare(load_config(REPO / CONFIG, overrides)).cfg
    path = model_dir or cfg.model.path
    tokenizer = AutoTokenizer.from_pretrained(path)
    problems, overlap = eval_problems(cfg)
    heldout = [
        {
            "prompt": p.messages,
            "reward_model": {"ground_truth": p.ground_truth},
            "extra_info": p.extra_info,
        }
        for p in problems
    ]
    engine = make_engine(cfg, path)
    try:
        result = {
            "model": str(path),
            "eval_set": overlap.label,
            "two_digit_heldout": report(engine, tokenizer, heldout, cfg),
        }
        if three_digit:
            rows = three_digit_rows(three_digit, cfg.data.seed + 3_000_003)
            result["three_digit_never_trained"] = report(engine, tokenizer, rows, cfg)
    finally:
        engine.close()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", help="a model directory (default: the preset's base)")
    parser.add_argument("--three-digit", type=int, default=400, help="3-digit problems (0: none)")
    parser.add_argument("--label", default="base", help="what the model is, for the results")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("overrides", nargs="*", help="config overrides, dotted.key=value")
    args = parser.parse_args()
    result = skill_report(args.model_dir, args.overrides, args.three_digit)
    for name in ("two_digit_heldout", "three_digit_never_trained"):
        for key, (mean, low, high) in result.get(name, {}).items():
            print(f"{name} {key}: {mean:.4f} ({low:.4f}-{high:.4f})")
    save_result(f"real_model_skill_{args.label}", result, args.out)
    mean = result["two_digit_heldout"][f"all/strict/avg@{SAMPLES}"][0]
    print(f"avg8_strict={mean:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
