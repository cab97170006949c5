"""The files users have (issue 42), read by `contracts.data`: GSM8K's jsonl (`question`, a worked
`answer` ending `#### N`), verl's parquet (`prompt` as chat messages, `reward_model.ground_truth`,
a `data_source` per row) and a chat jsonl (`messages`, its last assistant turn the reply); a
malformed row is refused with a reason naming the row, its line and the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from contracts.data import REPLY_COLUMN, ColumnMap, DataError, load_prompts, scan_rows, write_rows

GSM8K = [
    {
        "question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
        "answer": "In May she sold 48/2 = <<48/2=24>>24.\n48+24 = <<48+24=72>>72\n#### 72",
    },
    {"question": "What is 1,000 + 234?", "answer": "1000 + 234 = 1234\n#### 1,234"},
]
VERL = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "What is 2 + 2?"}],
        "ability": "math",
        "reward_model": {"ground_truth": "4", "style": "rule"},
        "extra_info": {"index": 7, "split": "train"},
    },
    {
        "data_source": "lighteval/MATH",
        "prompt": [
            {"role": "system", "content": "Box your answer."},
            {"role": "user", "content": "Simplify 2/4."},
        ],
        "ability": "math",
        "reward_model": {"ground_truth": "\\frac{1}{2}", "style": "rule"},
        "extra_info": {"index": 8, "split": "train"},
    },
]
CHAT = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "2 + 3 = 5\n#### 5"},
        ]
    },
    {"messages": [{"role": "user", "content": "What is 7 * 6?"}], "answer": "42"},
]


def jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_gsm8k_jsonl(tmp_path: Path) -> None:
    records = load_prompts(jsonl(tmp_path / "gsm8k.jsonl", GSM8K))
    assert [r.ground_truth for r in records] == ["72", "1234"]  # the #### line, commas dropped
    assert records[0].messages == [{"role": "user", "content": GSM8K[0]["question"]}]
    assert {r.data_source for r in records} == {"gsm8k"}  # the file's name


def test_verl_parquet_keeps_each_rows_source(tmp_path: Path) -> None:
    records = load_prompts(write_rows(tmp_path / "mixed.parquet", VERL))
    assert [r.data_source for r in records] == ["openai/gsm8k", "lighteval/MATH"]
    assert [r.ground_truth for r in records] == ["4", "\\frac{1}{2}"]
    assert records[1].messages[0] == {"role": "system", "content": "Box your answer."}
    assert [r.index for r in records] == [7, 8] and records[0].extra_info["split"] == "train"


def test_chat_jsonl_prompts_end_before_the_reply(tmp_path: Path) -> None:
    first, second = load_prompts(jsonl(tmp_path / "chat.jsonl", CHAT))
    assert [m["role"] for m in first.messages] == ["system", "user"]  # the reply is not prompt
    assert first.ground_truth == "5"  # the reply's #### line, no answer column
    assert second.ground_truth == "42" and len(second.messages) == 1
    rows = list(scan_rows(tmp_path / "chat.jsonl"))
    assert REPLY_COLUMN == "messages[-1].content" and all(
        not isinstance(r, DataError) for _, r in rows
    )


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"question": "no answer here"}, "field 'reward_model.ground_truth' is missing"),
        ({"question": "", "answer": "1"}, "field 'question' is empty"),
        ({"prompt": [{"role": "user"}], "answer": "1"}, "'prompt[0].content' is missing"),
        ({"prompt": "p", "answer": ["1"]}, "field 'answer' must be a string or a number"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "holds only an assistant turn"),
        ({"prompt": "p", "answer": "1", "extra_info": [1]}, "'extra_info' must be an object"),
        ("not json at all", "invalid JSON"),
    ],
)
def test_a_malformed_row_is_refused_with_its_reason(tmp_path: Path, row: Any, reason: str) -> None:
    path = jsonl(tmp_path / "bad.jsonl", [GSM8K[0], row, GSM8K[1]])
    with pytest.raises(DataError) as info:  # training stops at it, naming it
        load_prompts(path)
    assert "row 1 (line 2)" in str(info.value) and reason in str(info.value)
    outcomes = [outcome for _, outcome in scan_rows(path)]  # inspection reads on past it
    assert isinstance(outcomes[1], DataError) and reason in str(outcomes[1])
    assert [o.ground_truth for o in outcomes if not isinstance(o, DataError)] == ["72", "1234"]


def test_a_named_answer_column_is_required_even_for_a_chat_row(tmp_path: Path) -> None:
    path = jsonl(tmp_path / "chat.jsonl", CHAT[:1])
    with pytest.raises(DataError, match="'final' is missing"):
        load_prompts(path, columns=ColumnMap(answer_key="final"))
