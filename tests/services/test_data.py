"""Tests for contracts.data: synthetic rows, loading, writing and prompt rendering."""

from __future__ import annotations

import ast
import json
import operator
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from contracts.data import (
    DataError,
    PromptRecord,
    load_prompts,
    parse_row,
    render_prompt,
    write_rows,
)
from services.demo.synthetic import (
    ANSWER_INSTRUCTION,
    DAPO_PROMPT_TEMPLATE,
    DIFFICULTY_LEVELS,
    FEW_SHOT_EXAMPLES,
    ONE_SHOT_EXAMPLE,
    fact_split,
    few_shot_prompt,
    synth_rows,
)

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _evaluate(expression: str) -> int:
    """Independent check of an arithmetic expression of +, -, * on integers."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return int(_OPS[type(node.op)](walk(node.left), walk(node.right)))
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise AssertionError(f"unexpected node {ast.dump(node)}")

    return walk(ast.parse(expression, mode="eval").body)


# ---------------------------------------------------------------------------------------------
# synth_rows


@pytest.mark.parametrize("difficulty", sorted(DIFFICULTY_LEVELS))
def test_synth_rows_schema_and_answers(difficulty: int) -> None:
    rows = synth_rows(50, difficulty=difficulty, seed=3, start_index=100)
    assert len(rows) == 50
    for i, row in enumerate(rows):
        assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        assert row["data_source"] == "synth_arith"
        assert row["reward_model"]["style"] == "rule"
        truth = row["reward_model"]["ground_truth"]
        assert isinstance(truth, str)
        info = row["extra_info"]
        assert info["index"] == 100 + i
        assert info["difficulty"] == difficulty
        # The expression is built from the stored numbers, in order.
        assert [int(x) for x in re.findall(r"\d+", info["expression"])] == info["numbers"]
        assert int(truth) == _evaluate(info["expression"])
        assert int(truth) >= 0
        (message,) = row["prompt"]
        assert message["role"] == "user"
        content = message["content"]
        assert content.endswith("?\n")
        # Every operand appears in the word problem, in the order the template uses.
        assert sorted(int(x) for x in re.findall(r"\d+", content)) == sorted(info["numbers"])


def test_level_6_rows_carry_a_worked_solution_whose_lines_add_up() -> None:
    rows = synth_rows(300, difficulty=6, seed=5)
    assert {len(r["extra_info"]["numbers"]) for r in rows} == {
        2,
        3,
        4,
    }  # easy and hard problems mixed
    for row in rows:
        numbers, solution = row["extra_info"]["numbers"], row["extra_info"]["solution"]
        *steps, answer = solution.split("\n")
        assert answer == f"Answer: {row['reward_model']['ground_truth']}"
        assert len(steps) == len(numbers) - 1
        running = numbers[0]
        for line, n in zip(steps, numbers[1:], strict=True):
            assert line == f"{running}+{n}={running + n}"
            running += n
        assert running == int(row["reward_model"]["ground_truth"])


def test_synth_rows_operand_ranges() -> None:
    for row in synth_rows(200, difficulty=1, seed=0):
        assert all(10 <= x <= 99 for x in row["extra_info"]["numbers"])
    for row in synth_rows(200, difficulty=3, seed=0):
        a, k, b = row["extra_info"]["numbers"]
        assert 100 <= a <= 999 and 2 <= k <= 9 and 100 <= b <= 999
        assert row["extra_info"]["expression"] == f"{a} * {k} + {b}"


def test_synth_rows_deterministic_and_seeded() -> None:
    assert synth_rows(30, seed=5) == synth_rows(30, seed=5)
    assert synth_rows(30, seed=5) != synth_rows(30, seed=6)
    # Word templates vary under one seed.
    firsts = {row["prompt"][0]["content"].split()[1] for row in synth_rows(100, seed=0)}
    assert len(firsts) > 2


def test_synth_rows_deterministic_across_processes() -> None:
    """No dependence on hash randomisation (PYTHONHASHSEED) or other process state."""
    code = (
        "import json; from services.demo.synthetic import synth_rows; "
        "print(json.dumps(synth_rows(5, seed=2, difficulty=4)))"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == synth_rows(5, seed=2, difficulty=4)


def test_synth_rows_dapo_template() -> None:
    short = synth_rows(3, seed=1)
    dapo = synth_rows(3, seed=1, template="dapo")
    for s, d in zip(short, dapo, strict=True):
        problem = s["prompt"][0]["content"].removesuffix("\n")
        content = d["prompt"][0]["content"]
        assert content == DAPO_PROMPT_TEMPLATE.format(problem=problem)
        assert content.startswith("Solve the following math problem step by step. The last line")
        assert content.endswith('Remember to put your answer on its own line after "Answer:".')
        assert s["reward_model"] == d["reward_model"]


def test_one_shot_template_puts_a_worked_example_before_the_problem() -> None:
    short = synth_rows(50, difficulty=0, seed=1)
    chat = synth_rows(50, difficulty=0, seed=1, template="one-shot")
    example, solution = ONE_SHOT_EXAMPLE
    for s, c in zip(short, chat, strict=True):
        problem = s["prompt"][0]["content"].removesuffix("\n")
        assert c["prompt"] == [
            {"role": "user", "content": f"{example}\n{ANSWER_INSTRUCTION}"},
            {"role": "assistant", "content": solution},
            {"role": "user", "content": f"{problem}\n{ANSWER_INSTRUCTION}"},
        ]
        # Copying the example's answer never scores: no level-0 answer is 19.
        assert c["reward_model"] == s["reward_model"] != {"ground_truth": "19", "style": "rule"}
        assert all(1 <= n <= 9 for n in c["extra_info"]["numbers"])
    assert solution.endswith("Answer: 19")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"difficulty": -1}, "difficulty"), ({"template": "long"}, "template"), ({"n": -1}, "n")],
)
def test_synth_rows_rejects_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"n": 1, **kwargs}
    n = args.pop("n")
    with pytest.raises(ValueError, match=match):
        synth_rows(n, **args)


# ---------------------------------------------------------------------------------------------
# write_rows + load_prompts


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl", ".json"])
def test_round_trip(tmp_path: Path, suffix: str) -> None:
    rows = synth_rows(20, difficulty=2, seed=4, start_index=7)
    path = write_rows(tmp_path / "nested" / "dir" / f"train{suffix}", rows)
    assert path.exists()
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp left
    records = load_prompts(path)
    assert len(records) == 20
    for rec, row in zip(records, rows, strict=True):
        assert isinstance(rec, PromptRecord)
        assert rec.index == row["extra_info"]["index"]
        assert rec.messages == row["prompt"]
        assert rec.ground_truth == row["reward_model"]["ground_truth"]
        assert rec.data_source == "synth_arith"
        assert rec.extra_info["numbers"] == row["extra_info"]["numbers"]
        assert rec.extra_info["expression"] == row["extra_info"]["expression"]


def test_load_accepts_str_path_and_json_array(tmp_path: Path) -> None:
    rows = synth_rows(3, seed=0)
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows))
    assert [r.ground_truth for r in load_prompts(str(path))] == [
        r["reward_model"]["ground_truth"] for r in rows
    ]


def test_integer_ground_truth_becomes_string(tmp_path: Path) -> None:
    row = {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": "What is 2+2?"}],
        "reward_model": {"ground_truth": 4, "style": "rule"},
        "extra_info": {"index": 12},
    }
    path = write_rows(tmp_path / "int.parquet", [row])
    (rec,) = load_prompts(path)
    assert rec.ground_truth == "4"
    assert rec.index == 12


def test_aime_style_rows(tmp_path: Path) -> None:
    rows = [
        {"prompt": "Find x if x + 1 = 3.", "answer": 2, "data_source": "aime"},
        {"problem": "Compute 7 * 6.", "answer": "42", "id": "2024-I-1"},
        {"problem": "Compute 5 * 5.", "answer": 25.0},
    ]
    path = tmp_path / "aime2024.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")  # trailing blank line
    recs = load_prompts(path)
    assert [r.messages for r in recs] == [
        [{"role": "user", "content": "Find x if x + 1 = 3."}],
        [{"role": "user", "content": "Compute 7 * 6."}],
        [{"role": "user", "content": "Compute 5 * 5."}],
    ]
    assert [r.ground_truth for r in recs] == ["2", "42", "25"]
    assert [r.index for r in recs] == [0, 1, 2]  # no extra_info.index: the row number
    assert [r.data_source for r in recs] == ["aime", "aime2024", "aime2024"]


def test_aime_style_parquet(tmp_path: Path) -> None:
    path = write_rows(
        tmp_path / "aime.parquet",
        [{"problem": f"Problem {i}", "answer": str(i * 3), "year": 2024} for i in range(4)],
    )
    recs = load_prompts(path)
    assert [r.ground_truth for r in recs] == ["0", "3", "6", "9"]
    assert recs[2].messages == [{"role": "user", "content": "Problem 2"}]


def test_non_integer_index_falls_back_to_row_number() -> None:
    row = synth_rows(1)[0]
    row["extra_info"] = {"index": "5f1e-uuid"}
    rec = parse_row(row, row_number=9)
    assert rec.index == 9
    assert rec.extra_info == {"index": "5f1e-uuid"}


# ---------------------------------------------------------------------------------------------
# errors


def _good() -> dict[str, Any]:
    return synth_rows(1, seed=0)[0]


def _drop_ground_truth(r: dict[str, Any]) -> None:
    del r["reward_model"]["ground_truth"]


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda r: r.pop("prompt"), "prompt"),
        (lambda r: r.update(prompt=[]), "prompt"),
        (lambda r: r.update(prompt=[{"role": "user"}]), "prompt[0].content"),
        (lambda r: r.update(prompt=[{"content": "hi"}]), "prompt[0].role"),
        (lambda r: r.update(prompt=["hi"]), "prompt[0]"),
        (lambda r: r.update(prompt=42), "prompt"),
        (_drop_ground_truth, "reward_model.ground_truth"),
        (lambda r: r.pop("reward_model"), "reward_model.ground_truth"),
        (lambda r: r.update(reward_model="x"), "reward_model"),
        (lambda r: r["reward_model"].update(ground_truth=[1]), "reward_model.ground_truth"),
        (lambda r: r["reward_model"].update(ground_truth=" "), "reward_model.ground_truth"),
        (lambda r: r["reward_model"].update(ground_truth=True), "reward_model.ground_truth"),
        (lambda r: r.update(extra_info=[1]), "extra_info"),
        (lambda r: r.update(data_source=3), "data_source"),
    ],
)
def test_bad_row_names_file_row_and_field(tmp_path: Path, mutate: Any, field: str) -> None:
    bad = _good()
    mutate(bad)
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [_good(), _good(), bad]) + "\n")
    with pytest.raises(DataError) as err:
        load_prompts(path)
    msg = str(err.value)
    assert str(path) in msg
    assert "row 2 (line 3)" in msg
    assert f"field {field!r}" in msg


def test_bad_parquet_row_names_row_and_field(tmp_path: Path) -> None:
    rows = [_good(), _good()]
    rows[1]["reward_model"]["ground_truth"] = None
    path = write_rows(tmp_path / "bad.parquet", rows)
    with pytest.raises(DataError, match=r"bad\.parquet: row 1: field 'reward_model\.ground_truth'"):
        load_prompts(path)


def test_data_error_is_value_error() -> None:
    assert issubclass(DataError, ValueError)


def test_invalid_json_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(_good()) + "\n{not json\n")
    with pytest.raises(DataError, match=r"row 1 \(line 2\): invalid JSON"):
        load_prompts(path)


def test_unknown_extension(tmp_path: Path) -> None:
    path = tmp_path / "rows.csv"
    path.write_text("a,b\n")
    with pytest.raises(DataError, match=r"unknown extension '\.csv'"):
        load_prompts(path)
    with pytest.raises(DataError, match="unknown extension"):
        write_rows(tmp_path / "rows.txt", [_good()])


def test_unreadable_parquet(tmp_path: Path) -> None:
    path = tmp_path / "junk.parquet"
    path.write_bytes(b"not a parquet file")
    with pytest.raises(DataError, match=r"junk\.parquet"):
        load_prompts(path)


# ---------------------------------------------------------------------------------------------
# render_prompt


class _NoTemplate:
    chat_template = None


class _WithTemplate:
    chat_template = "{{ messages }}"

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> str:
        self.calls.append(kwargs)
        return "<|im_start|>" + "|".join(m["content"] for m in messages) + "<|im_start|>assistant\n"


def test_render_prompt_without_template_joins_contents() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?\n"}]
    assert render_prompt(_NoTemplate(), messages) == "Be brief.\n1+1?\n"
    assert render_prompt(object(), messages[1:]) == "1+1?\n"


def test_render_prompt_uses_chat_template() -> None:
    tok = _WithTemplate()
    out = render_prompt(tok, [{"role": "user", "content": "hi"}])
    assert out == "<|im_start|>hi<|im_start|>assistant\n"
    assert tok.calls == [{"add_generation_prompt": True, "tokenize": False}]


def test_a_completion_prompt_is_the_text_as_it_is_even_with_a_chat_template() -> None:
    """`data.prompt_format: completion`: a model used as a completer continues the few-shot
    text itself; its chat template is not applied."""
    tok = _WithTemplate()
    text = few_shot_prompt(40, 2)
    assert render_prompt(tok, [{"role": "user", "content": text}], chat=False) == text
    assert tok.calls == []
    assert text.endswith("Q: What is 40 + 2?\nA:")


def test_the_few_shot_examples_hold_no_evaluation_fact() -> None:
    assert all(fact_split(1, list(pair)) == "train" for pair in FEW_SHOT_EXAMPLES)
    rows = synth_rows(5, difficulty=1, template="few-shot", split="eval")
    for row in rows:
        a, b = row["extra_info"]["numbers"]
        assert row["prompt"][0]["content"] == few_shot_prompt(a, b)
        assert row["reward_model"]["ground_truth"] == str(a + b)
    with pytest.raises(ValueError, match="sums"):
        synth_rows(1, difficulty=3, template="few-shot")


def test_render_prompt_with_real_tokenizer_template() -> None:
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=raw)
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    text = render_prompt(tok, [{"role": "user", "content": "2+2?"}])
    assert text == "<user>2+2?\n<assistant>"


def test_module_does_not_import_torch() -> None:
    code = "import sys, contracts.data; print('torch' in sys.modules, 'pyarrow' in sys.modules)"
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False", "False"]
