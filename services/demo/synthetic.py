"""The synthetic arithmetic task of the CPU demo, in the DAPO-Math-17K schema (`dapo data synth`).

`synth_rows` makes word problems with integer answers, for runs that must learn within minutes
on a CPU. Its `difficulty` knob (see `DIFFICULTY_LEVELS`) sets how hard the arithmetic is.
Demo-only: the product reads any DAPO-Math-17K-style file through `contracts.data`.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Literal, get_args

from contracts.config import SynthTemplate as Template

SYNTH_DATA_SOURCE = "synth_arith"

# The DAPO-Math-17K prompt template (docs/algorithm.md s7). The data set's rows hold the instruction
# as one line; the paper wraps it only for display.
DAPO_PROMPT_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
    "\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)

DIFFICULTY_LEVELS: dict[int, str] = {
    0: "a + b, two 1-digit numbers (1-9): the real-model preset's task (configs/smollm2-135m.yaml)",
    1: "a + b, two 2-digit numbers (10-99)",
    2: "a + b - c, three 2-digit numbers; the result is never negative",
    3: "a * k + b, 3-digit a and b (100-999) and a 1-digit multiplier k (2-9)",
    4: "a * k + b - c, 3-digit a, b, c and a 1-digit k; the result is never negative",
    5: "a * b + c, 2-digit a and b and a 3-digit c",
    6: "a sum of 2 to 4 two-digit numbers, solved step by step: each row has a worked `solution` "
    "(one running sum per line, then `Answer: N`), so useful responses are long (the ablation "
    "task)",
    7: "a * b, a 3-digit and a 2-digit number: too hard for a tiny model's head, easy with the "
    "calculator tool (the tool-use demo, configs/tiny-tools.yaml); `tool_traces` of the rows "
    "carry a `solution` that calls it",
    8: "a + b, two 3-digit numbers (100-999): the real model's never-trained set",
}
"""What each `difficulty` of `synth_rows` asks. Level 1 is what a ~1M-parameter model learns
in about a minute on 2 CPU cores (ENVIRONMENT.md); each level above adds terms or digits. Level 0
is for SmolLM2-135M-Instruct (a 4-bit copy de-quantised): it gets 0% of level 1 right and about
15-40% of level 0, the band where most groups have mixed outcomes for DAPO to learn from."""

ANSWER_INSTRUCTION = 'End your reply with a line of the form "Answer: <number>".'
"""The last line of every `one-shot` prompt turn: the format the verifier reads."""

# The `one-shot` template's worked example. Its answer (19) is outside level 0's answers (2-18),
# so a reply that copies the example's answer line never scores.
ONE_SHOT_EXAMPLE = (
    "Jo has 12 hats and gets 7 more. How many hats does Jo have?",
    "Jo starts with 12 hats and gets 7 more, so 12 + 7 = 19.\nAnswer: 19",
)

PYTHON_INSTRUCTION = (
    "You may run Python: write <python>code</python> and its output comes back as "
    "<result>output</result>."
)
"""The extra line of every `one-shot-python` user turn: the `python` tool's call format."""
ONE_SHOT_PYTHON_SOLUTION = "<python>print(12 + 7)</python><result>19\n</result>\nAnswer: 19"
"""The `one-shot-python` example's reply: a call, the output the tool returned, the answer."""

TEMPLATES: tuple[Template, ...] = get_args(Template)
"""How `synth_rows` puts a problem to the model:

- short: the bare problem and "\\n", for tiny models without a chat template;
- dapo: the DAPO-Math-17K instruction around the problem (docs/algorithm.md s7);
- one-shot: a chat conversation, one worked example (user, assistant) and then the problem, each
  user turn ending in `ANSWER_INSTRUCTION`. A small instruct model writes the `Answer:` line in
  24-31% of replies when only told to and in 78-96% after one example (200 problems x 4 samples,
  bench/results/2026-12-03-real-model.md), so its reward measures arithmetic, not format luck;
- one-shot-python: the same, each user turn also saying how to run Python (`PYTHON_INSTRUCTION`)
  and the example's reply calling it (`ONE_SHOT_PYTHON_SOLUTION`): the real model's tool run;
- few-shot: for a model used as a completer (`data.prompt_format: completion`), no words and no
  chat: three solved "Q: What is a + b?" / "A: sum" pairs, then the question (`few_shot_prompt`);
  sums only (levels 0, 1 and 8). The real-model preset's task.
"""

FEW_SHOT_EXAMPLES = ((12, 31), (57, 18), (61, 27))
"""The `few-shot` template's worked examples: training-side facts of level 1 (`fact_split`), one
with a carry, so no evaluation fact appears in any prompt."""


def few_shot_prompt(a: int, b: int) -> str:
    """The `few-shot` completion prompt: three solved questions, then this one; a completer
    continues with " <sum>" and a newline.

    >>> print(few_shot_prompt(40, 2))
    Q: What is 12 + 31?
    A: 43
    <BLANKLINE>
    Q: What is 57 + 18?
    A: 75
    <BLANKLINE>
    Q: What is 61 + 27?
    A: 88
    <BLANKLINE>
    Q: What is 40 + 2?
    A:
    """
    shots = "".join(f"Q: What is {x} + {y}?\nA: {x + y}\n\n" for x, y in FEW_SHOT_EXAMPLES)
    return f"{shots}Q: What is {a} + {b}?\nA:"


_NAMES = ("Tom", "Anna", "Ravi", "Mei", "Lucas", "Sara", "Omar", "Ines", "Kofi", "Lena")
_ITEMS = ("apples", "marbles", "stickers", "books", "coins", "pencils", "shells", "cards")

# One list of sentence templates per level. Placeholders: {name}, {item} and the numbers
# a, b, c, k in the order of the level's expression.
_TEMPLATES: dict[int, tuple[str, ...]] = {
    1: (
        "{name} has {a} {item} and buys {b} more. How many {item} does {name} have?",
        "{name} picked {a} {item} in the morning and {b} {item} in the afternoon. "
        "How many {item} did {name} pick in total?",
        "A basket holds {a} {item}. {name} adds {b} more. How many {item} are in the basket now?",
        "There are {a} {item} on one shelf and {b} {item} on another. "
        "How many {item} are there altogether?",
    ),
    2: (
        "{name} has {a} {item}, buys {b} more and then gives {c} to a friend. "
        "How many {item} does {name} have now?",
        "A shop had {a} {item}. It received {b} more and sold {c}. "
        "How many {item} does the shop have left?",
        "{name} collected {a} {item} on Monday and {b} on Tuesday, then lost {c}. "
        "How many {item} does {name} have?",
    ),
    3: (
        "{name} buys {k} boxes with {a} {item} in each and already had {b} {item}. "
        "How many {item} does {name} have?",
        "A farm packs {k} crates of {a} {item} and has {b} {item} left over. "
        "How many {item} does the farm have in total?",
    ),
    4: (
        "{name} buys {k} boxes with {a} {item} in each, already had {b} {item} "
        "and gives away {c}. How many {item} does {name} have left?",
        "A warehouse receives {k} shipments of {a} {item} each. It had {b} {item} before "
        "and then sends out {c}. How many {item} are in the warehouse now?",
    ),
    5: (
        "{name} lays out {item} in {a} rows of {b} and keeps {c} more in a bag. "
        "How many {item} does {name} have?",
        "A club orders {a} packs of {b} {item} and already owns {c} {item}. "
        "How many {item} does the club have?",
    ),
    7: (
        "{name} packs {b} boxes with {a} {item} in each. How many {item} does {name} pack?",
        "A shop sells {a} {item} a day for {b} days. How many {item} does it sell?",
        "{name} stacks {a} {item} on each of {b} shelves. How many {item} are on the shelves?",
    ),
    6: (
        "{name} counts {item} in {count} boxes: {numbers}. How many {item} are there in total?",
        "{name} collects {item} on {count} days: {numbers}. How many {item} does {name} collect?",
    ),
}

EVAL_FACT_SHARE = 0.2
"""The share of facts (`fact_key`) held out for evaluation: training rows never hold them."""

Split = Literal["train", "eval"]


def fact_key(numbers: list[int]) -> tuple[int, ...]:
    """What a model could memorise about a problem: its operands as a multiset (a + b and b + a
    are one fact; the wording around them is not part of it). Sorting also merges a few problems
    of levels 2-5 that are not the same fact: harmless, it only holds out more."""
    return tuple(sorted(numbers))


def fact_split(difficulty: int, numbers: list[int]) -> Split:
    """Which side of the held-out split a fact is on: a hash of the fact alone, so the training
    and evaluation files agree however many rows each has and whatever seeds drew them."""
    text = f"fact:{difficulty}:{','.join(map(str, fact_key(numbers)))}"
    bucket = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") / 2**64
    return "eval" if bucket < EVAL_FACT_SHARE else "train"


CHAIN_TERMS = (2, 3, 4)
"""Level 6: how many numbers a problem adds, drawn uniformly. Two-term problems are easy (one
addition), four-term ones are three chained additions and the longest responses."""


# ---------------------------------------------------------------------------------------------
# Synthetic arithmetic


def synth_rows(
    n: int,
    *,
    difficulty: int = 1,
    seed: int = 0,
    template: Template = "short",
    start_index: int = 0,
    tool_traces: float = 0.0,
    split: Split | None = None,
) -> list[dict[str, Any]]:
    """Make `n` arithmetic word problems with integer answers, in the DAPO-Math-17K schema.

    Args:
        n: number of rows.
        difficulty: a key of `DIFFICULTY_LEVELS` (1 = 2-digit addition).
        seed: the rows are a function of (n, difficulty, seed, template, start_index).
        template: one of `TEMPLATES` (see there): "short" (the bare problem, far fewer tokens
            for a tiny CPU model), "dapo" or "one-shot" (a chat conversation with one worked
            example).
        start_index: `extra_info.index` of the first row.
        tool_traces: the share of rows whose `solution` calls the calculator
            (`tool_solution`); the tiny base learns the call format from them.
        split: "train" or "eval": only problems whose fact is on that side of the held-out
            split (`fact_split`), so an evaluation set shares no fact with any training set;
            "eval" also draws each fact once while unused ones remain. None: any problem.

    `extra_info` also holds `difficulty`, `expression` (e.g. "23 + 45") and `numbers` (the
    operands in the expression's order), so the answer can be checked independently; level 6
    adds `solution`, the worked solution the tiny base model is warm-started on.
    """
    if difficulty not in DIFFICULTY_LEVELS:
        raise ValueError(f"difficulty must be one of {sorted(DIFFICULTY_LEVELS)}, got {difficulty}")
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {list(TEMPLATES)}, got {template!r}")
    if template == "few-shot" and difficulty not in (0, 1, 8):
        raise ValueError(
            f"the few-shot template asks for sums: difficulty 0, 1 or 8, not {difficulty}"
        )
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not 0.0 <= tool_traces <= 1.0:
        raise ValueError(f"tool_traces must be a share in [0, 1], got {tool_traces}")
    rng = random.Random(f"synth_arith:{seed}:{difficulty}")
    traces = random.Random(f"synth_arith_traces:{seed}:{difficulty}")  # the problems stay put
    rows: list[dict[str, Any]] = []
    used: set[tuple[int, ...]] = set()  # facts drawn so far ("eval": each once while it can)
    for i in range(n):
        numbers, expression, answer = _draw_in_split(rng, difficulty, split, used)
        used.add(fact_key(numbers))
        problem = (
            few_shot_prompt(*numbers)
            if template == "few-shot"
            else _render_problem(rng, difficulty, numbers)
        )
        solution = worked_solution(numbers) if difficulty == 6 else None
        if tool_traces and traces.random() < tool_traces:
            solution = tool_solution(expression, answer)
        rows.append(
            {
                "data_source": SYNTH_DATA_SOURCE,
                "prompt": _messages(problem, template),
                "ability": "MATH",
                "reward_model": {"ground_truth": str(answer), "style": "rule"},
                "extra_info": {
                    "index": start_index + i,
                    "difficulty": difficulty,
                    "expression": expression,
                    "numbers": numbers,
                    **({"solution": solution} if solution is not None else {}),
                },
            }
        )
    return rows


MAX_DRAWS = 10_000
"""Draws tried for one row of a split before a fact already used may repeat (a small level
has few facts: level 0 has 45)."""


def _draw_in_split(
    rng: random.Random, difficulty: int, split: Split | None, used: set[tuple[int, ...]]
) -> tuple[list[int], str, int]:
    """A problem on `split`'s side of the held-out split; for "eval", of a fact not in `used`
    while one can be found."""
    if split is None:
        return _draw_problem(rng, difficulty)
    fallback = None
    for _ in range(MAX_DRAWS if split == "eval" else 1_000):
        drawn = _draw_problem(rng, difficulty)
        if fact_split(difficulty, drawn[0]) != split:
            continue
        if split == "train" or fact_key(drawn[0]) not in used:
            return drawn
        fallback = fallback or drawn
    if fallback is None:
        raise ValueError(f"no problem of difficulty {difficulty} falls in the {split} split")
    return fallback


def _messages(problem: str, template: Template) -> list[dict[str, str]]:
    """The chat messages that put `problem` to the model under `template`."""
    if template == "dapo":
        return [{"role": "user", "content": DAPO_PROMPT_TEMPLATE.format(problem=problem)}]
    if template == "short":
        return [{"role": "user", "content": problem + "\n"}]
    if template == "few-shot":  # the completion prompt as it is (`data.prompt_format`)
        return [{"role": "user", "content": problem}]
    example, solution = ONE_SHOT_EXAMPLE
    instruction = ANSWER_INSTRUCTION
    if template == "one-shot-python":
        solution, instruction = ONE_SHOT_PYTHON_SOLUTION, f"{PYTHON_INSTRUCTION}\n{instruction}"
    return [
        {"role": "user", "content": f"{example}\n{instruction}"},
        {"role": "assistant", "content": solution},
        {"role": "user", "content": f"{problem}\n{instruction}"},
    ]


def _draw_problem(rng: random.Random, difficulty: int) -> tuple[list[int], str, int]:
    """(operands, expression, answer) for one problem of the given level."""
    if difficulty == 0:
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        return [a, b], f"{a} + {b}", a + b
    if difficulty == 1:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return [a, b], f"{a} + {b}", a + b
    if difficulty == 2:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        c = rng.randint(10, min(99, a + b))
        return [a, b, c], f"{a} + {b} - {c}", a + b - c
    if difficulty == 3:
        a, k, b = rng.randint(100, 999), rng.randint(2, 9), rng.randint(100, 999)
        return [a, k, b], f"{a} * {k} + {b}", a * k + b
    if difficulty == 4:
        a, k, b = rng.randint(100, 999), rng.randint(2, 9), rng.randint(100, 999)
        c = rng.randint(100, min(999, a * k + b))
        return [a, k, b, c], f"{a} * {k} + {b} - {c}", a * k + b - c
    if difficulty == 5:
        a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(100, 999)
        return [a, b, c], f"{a} * {b} + {c}", a * b + c
    if difficulty == 7:
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        return [a, b], f"{a} * {b}", a * b
    if difficulty == 8:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        return [a, b], f"{a} + {b}", a + b
    numbers = [rng.randint(10, 99) for _ in range(rng.choice(CHAIN_TERMS))]
    return numbers, " + ".join(map(str, numbers)), sum(numbers)


def worked_solution(numbers: list[int]) -> str:
    """Level 6's solution: one running sum per line, then the answer line the verifier reads.

    >>> print(worked_solution([23, 45, 17]))
    23+45=68
    68+17=85
    Answer: 85
    """
    lines, total = [], numbers[0]
    for n in numbers[1:]:
        lines.append(f"{total}+{n}={total + n}")
        total += n
    return "\n".join([*lines, f"Answer: {total}"])


def tool_solution(expression: str, answer: int) -> str:
    """A solution that calls the calculator (rollout/tool_use.py's tag format) and answers
    with its result.

    >>> print(tool_solution("123 * 45", 5535))
    <calculator>123*45</calculator><result>5535</result>
    Answer: 5535
    """
    call = expression.replace(" ", "")
    return f"<calculator>{call}</calculator><result>{answer}</result>\nAnswer: {answer}"


TOOL_TAGS = ("<calculator>", "</calculator>", "<result>", "</result>")
"""The calculator's tags: whole tokens in the tools demo's tokenizer (`build_tiny.added_tokens`),
so the tokens of an inserted result are those the base saw in its traces."""


def _render_problem(rng: random.Random, difficulty: int, numbers: list[int]) -> str:
    # Levels 0 and 8 are worded as level 1 (sums of two numbers).
    sentence = rng.choice(_TEMPLATES[1 if difficulty in (0, 8) else difficulty])
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    if difficulty == 6:
        listed = ", ".join(map(str, numbers[:-1])) + f" and {numbers[-1]}"
        count = {2: "two", 3: "three", 4: "four"}[
            len(numbers)
        ]  # in words: the only digits are the operands
        return sentence.format(name=name, item=item, count=count, numbers=listed)
    # Placeholder names in the order `_draw_problem` lists the operands.
    keys = {0: "ab", 1: "ab", 2: "abc", 3: "akb", 4: "akbc", 5: "abc", 7: "ab", 8: "ab"}[difficulty]
    return sentence.format(name=name, item=item, **dict(zip(keys, numbers, strict=True)))
