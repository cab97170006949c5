"""Your own data: every source format, the verl and flat schemas, column mapping, `hf://` ids and
the errors a wrong column or a missing `datasets` library gives (contracts.data)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from contracts.config import ConfigError, build_config
from contracts.data import (
    DAPO_PROMPT_TEMPLATE,
    ColumnMap,
    DataError,
    HubDataset,
    load_prompts,
    parse_hub_id,
    to_row,
    write_rows,
)
from contracts.heldout import load_eval_problems
from services.demo.synthetic import DAPO_PROMPT_TEMPLATE as SYNTH_TEMPLATE

ROOT = Path(__file__).resolve().parents[2]
PROBLEMS = [
    ("What is 2 + 3?", "5"),
    ("Compute $\\frac{1}{2} + \\frac{1}{2}$.", "1"),
    ("Name 7 * 6.", "42"),
]
EXPECTED = [([{"role": "user", "content": text}], answer) for text, answer in PROBLEMS]


def _verl(i: int, text: str, answer: str) -> dict[str, Any]:
    """A row as DAPO-Math-17K and the DAPO authors' AIME-2024 publish them (UUID indexes)."""
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": text}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule"},
        "extra_info": {"index": f"9c1f-{i}-uuid"},
    }


SCHEMAS: dict[str, Callable[[int, str, str], dict[str, Any]]] = {
    "verl": _verl,
    "problem/answer": lambda i, t, a: {"problem": t, "answer": a, "level": i},
    "question/answer": lambda i, t, a: {"question": t, "answer": f"Work it out.\n#### {a}"},
    "prompt/answer": lambda i, t, a: {"prompt": t, "answer": int(a)},
}


def _write_json_array(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps(rows))
    return path


def _write_dataset_dir(path: Path, rows: list[dict[str, Any]]) -> Path:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


WRITERS: dict[str, Callable[[Path, list[dict[str, Any]]], Path]] = {
    "parquet": lambda d, rows: write_rows(d / "set.parquet", rows),
    "jsonl": lambda d, rows: write_rows(d / "set.jsonl", rows),
    "json": lambda d, rows: _write_json_array(d / "set.json", rows),
    "datasets-dir": lambda d, rows: _write_dataset_dir(d / "set", rows),
}


# ---------------------------------------------------------------------------------------------
# formats x schemas


@pytest.mark.parametrize("schema", sorted(SCHEMAS))
@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_every_format_and_schema_loads_the_same_prompts(
    tmp_path: Path, fmt: str, schema: str
) -> None:
    rows = [SCHEMAS[schema](i, text, answer) for i, (text, answer) in enumerate(PROBLEMS)]
    path = WRITERS[fmt](tmp_path, rows)
    records = load_prompts(path)
    assert [(r.messages, r.ground_truth) for r in records] == EXPECTED
    assert [r.index for r in records] == [0, 1, 2]  # UUID or no index: the row number
    if schema == "verl":
        assert {r.data_source for r in records} == {"math_dapo"}
        assert records[1].extra_info == {"index": "9c1f-1-uuid"}
    else:
        assert {r.data_source for r in records} == {"set"}  # the file or directory name


def test_verl_rows_with_many_parquet_batches(tmp_path: Path) -> None:
    """Parquet is read in batches; rows keep their numbers across batch boundaries."""
    rows = [_verl(i, f"Problem {i}", str(i)) for i in range(20_000)]
    rows[17_000]["reward_model"]["ground_truth"] = None
    path = write_rows(tmp_path / "big.parquet", rows)
    with pytest.raises(
        DataError, match=r"big\.parquet: row 17000: field 'reward_model\.ground_truth'"
    ):
        load_prompts(path)


def test_gsm8k_final_answer_line_is_the_ground_truth(tmp_path: Path) -> None:
    rows = [
        {"question": "q1", "answer": "Half of 2,468 is 1,234.\n#### 1,234"},
        {"question": "q2", "answer": "#### -7"},
        {"question": "q3", "answer": "a #### in the middle\nstays"},
        {"question": "q4", "answer": "12,345"},  # no #### line: kept as written (may be a list)
    ]
    path = write_rows(tmp_path / "gsm.jsonl", rows)
    assert [r.ground_truth for r in load_prompts(path)] == [
        "1234",
        "-7",
        "a #### in the middle\nstays",
        "12,345",
    ]


def test_to_row_round_trips(tmp_path: Path) -> None:
    flat = write_rows(tmp_path / "flat.jsonl", [{"problem": t, "answer": a} for t, a in PROBLEMS])
    records = load_prompts(flat)
    verl = write_rows(tmp_path / "verl.parquet", [to_row(r) for r in records])
    again = load_prompts(verl)
    assert [(r.index, r.messages, r.ground_truth, r.data_source) for r in again] == [
        (r.index, r.messages, r.ground_truth, "flat") for r in records
    ]
    assert [r.extra_info for r in again] == [{"index": 0}, {"index": 1}, {"index": 2}]
    assert set(to_row(again[0])) == {
        "data_source",
        "prompt",
        "ability",
        "reward_model",
        "extra_info",
    }


# ---------------------------------------------------------------------------------------------
# column mapping


def _custom_rows() -> list[dict[str, Any]]:
    return [
        {"instruction": text, "solution": {"final": answer, "steps": "..."}, "topic": f"t{i}"}
        for i, (text, answer) in enumerate(PROBLEMS)
    ]


def test_column_map_reads_other_names_and_nested_answers(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "custom.parquet", _custom_rows())
    columns = ColumnMap(
        prompt_key="instruction", answer_key="solution.final", extra_keys=("topic",)
    )
    records = load_prompts(path, columns=columns)
    assert [(r.messages, r.ground_truth) for r in records] == EXPECTED
    assert [r.extra_info for r in records] == [{"topic": "t0"}, {"topic": "t1"}, {"topic": "t2"}]


def test_config_fields_reach_the_loader(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "custom.jsonl", _custom_rows())
    cfg = build_config(
        {
            "model": {"path": "m"},
            "data": {
                "train_path": str(path),
                "prompt_key": "instruction",
                "answer_key": "solution.final",
                "extra_keys": ["topic"],
                "prompt_template": "dapo",
            },
        }
    )
    records = load_prompts(cfg.data.train_path, columns=cfg.data.columns)
    assert records[0].messages == [
        {"role": "user", "content": DAPO_PROMPT_TEMPLATE.replace("{problem}", PROBLEMS[0][0])}
    ]
    assert [r.ground_truth for r in records] == ["5", "1", "42"]
    assert records[2].extra_info == {"topic": "t2"}
    # The same mapping serves the eval set.
    problems = load_eval_problems(str(path), 2, columns=cfg.data.columns)
    assert [p.ground_truth for p in problems] == ["5", "1"]


def test_prompt_template_wraps_text_but_never_chat_messages(tmp_path: Path) -> None:
    rows = [{"problem": "1 + 1 = ?", "answer": "2"}, _verl(1, "already formatted", "3")]
    path = write_rows(tmp_path / "mixed.jsonl", rows)
    # Braces other than {problem} are left alone (LaTeX templates).
    columns = ColumnMap(prompt_template="\\boxed{} please: {problem}")
    flat, chat = load_prompts(path, columns=columns)
    assert flat.messages[0]["content"] == "\\boxed{} please: 1 + 1 = ?"
    assert chat.messages[0]["content"] == "already formatted"


def test_dapo_template_matches_the_synthetic_tasks() -> None:
    assert DAPO_PROMPT_TEMPLATE == SYNTH_TEMPLATE


@pytest.mark.parametrize(
    ("columns", "missing", "how"),
    [
        (ColumnMap(prompt_key="question"), "question", "named by data.prompt_key"),
        (ColumnMap(answer_key="solution"), "solution", "named by data.answer_key"),
        (ColumnMap(extra_keys=("subject",)), "subject", "named by data.extra_keys"),
        (
            ColumnMap(answer_key="reward_model.ground_truth"),
            "reward_model.ground_truth",
            "named by data.answer_key",
        ),
    ],
)
def test_a_missing_mapped_column_names_it_and_the_columns_that_exist(
    tmp_path: Path, columns: ColumnMap, missing: str, how: str
) -> None:
    path = write_rows(tmp_path / "flat.parquet", [{"problem": t, "answer": a} for t, a in PROBLEMS])
    with pytest.raises(DataError) as err:
        load_prompts(path, columns=columns)
    msg = str(err.value)
    assert msg.startswith(f"{path}: row 0: field {missing!r} is missing ({how}")
    assert "the row's columns: 'problem', 'answer'" in msg


def test_unknown_flat_columns_list_what_was_looked_for(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "odd.jsonl", [{"text": "2 + 2?", "label": "4"}])
    with pytest.raises(DataError) as err:
        load_prompts(path)
    msg = str(err.value)
    assert "field 'prompt' is missing (looked for 'prompt', 'problem', 'question'" in msg
    assert "name the column with data.prompt_key" in msg
    assert "the row's columns: 'text', 'label'" in msg
    # Mapped, the same file loads.
    (rec,) = load_prompts(path, columns=ColumnMap(prompt_key="text", answer_key="label"))
    assert (rec.messages[0]["content"], rec.ground_truth) == ("2 + 2?", "4")


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"prompt_key": "a..b"}, "data.prompt_key"),
        ({"answer_key": ""}, "data.answer_key"),
        ({"extra_keys": ["ok", "bad."]}, "data.extra_keys"),
        ({"prompt_template": "no placeholder"}, "data.prompt_template"),
        ({"train_path": "hf://owner/name?split=test&revision=x"}, "data.train_path"),
        ({"eval_path": "hf://not a/valid id"}, "data.eval_path"),
    ],
)
def test_bad_data_settings_fail_when_the_config_is_read(data: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=rf"{key}="):
        build_config({"model": {"path": "m"}, "data": {"train_path": "t.parquet", **data}})


def test_missing_file_points_at_dapo_data_fetch(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"no such file or directory \(`dapo data fetch`"):
        load_prompts(tmp_path / "data" / "dapo-math-17k.parquet")


# ---------------------------------------------------------------------------------------------
# hf:// ids and the `datasets` library


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("data/train.parquet", None),
        ("hf://BytedTsinghua-SIA/DAPO-Math-17k", HubDataset("BytedTsinghua-SIA/DAPO-Math-17k")),
        ("hf://openai/gsm8k?name=main&split=test", HubDataset("openai/gsm8k", "test", "main")),
        ("hf://gsm8k?split=train", HubDataset("gsm8k", "train")),
    ],
)
def test_parse_hub_id(spec: str, expected: HubDataset | None) -> None:
    assert parse_hub_id(spec) == expected


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("hf://", "expected hf://OWNER/NAME"),
        ("hf://a/b/c", "expected hf://OWNER/NAME"),
        ("hf://a/b?split=", "'split' needs exactly one non-empty value"),
        ("hf://a/b?split=x&split=y", "'split' needs exactly one"),
        ("hf://a/b?config=main", "unknown option 'config'"),
    ],
)
def test_parse_hub_id_rejects(spec: str, match: str) -> None:
    with pytest.raises(DataError, match=match):
        parse_hub_id(spec)


@pytest.mark.parametrize("kind", ["hub", "directory"])
def test_without_datasets_the_error_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    spec = "hf://BytedTsinghua-SIA/AIME-2024" if kind == "hub" else str(tmp_path)
    with pytest.raises(DataError) as err:
        load_prompts(spec)
    msg = str(err.value)
    assert msg.startswith(spec)
    assert "needs the `datasets` library, not installed: pip install 'dapo-services[data]'" in msg


def test_hub_id_reads_through_load_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`hf://OWNER/NAME` goes through `datasets.load_dataset`, which resolves an id that names a
    local folder without the network: the code path of a real Hub id, offline."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "acme" / "tiny-math"
    folder.mkdir(parents=True)
    flat = SCHEMAS["question/answer"]  # the schema must be the same in every split
    write_rows(folder / "test.parquet", [flat(i, t, a) for i, (t, a) in enumerate(PROBLEMS)])
    write_rows(folder / "train.parquet", [{"question": "q", "answer": "#### 9"}])
    test = load_prompts("hf://acme/tiny-math?split=test")
    assert [(r.messages, r.ground_truth) for r in test] == EXPECTED
    (train,) = load_prompts("hf://acme/tiny-math")  # split defaults to train
    assert (train.ground_truth, train.data_source) == ("9", "tiny-math")
    with pytest.raises(DataError, match=r"cannot load split 'validation' .*Unknown split"):
        load_prompts("hf://acme/tiny-math?split=validation")


def test_dataset_dict_directory_asks_for_a_split(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = [{"problem": t, "answer": a} for t, a in PROBLEMS]
    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:1])}
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(
        DataError, match=r"one dataset per split \(train, test\): point at one of them"
    ):
        load_prompts(tmp_path / "dd")
    assert [r.ground_truth for r in load_prompts(tmp_path / "dd" / "test")] == ["5"]


def test_a_directory_that_is_no_dataset(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(DataError, match="not a dataset written by `datasets` save_to_disk"):
        load_prompts(tmp_path)


def test_offline_hub_id_fails_with_a_clear_error(tmp_path: Path) -> None:
    """A real Hub id with the Hub unreachable (offline mode: no network is tried)."""
    pytest.importorskip("datasets")
    code = (
        "from contracts.data import load_prompts, DataError\n"
        "try:\n    load_prompts('hf://BytedTsinghua-SIA/AIME-2024')\n"
        "except DataError as exc:\n    print(exc)\n"
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(tmp_path),
    }
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert out.stdout.startswith(
        "hf://BytedTsinghua-SIA/AIME-2024: cannot load split 'train' of the Hub dataset "
        "'BytedTsinghua-SIA/AIME-2024'"
    )
    assert "Offline, or the id is wrong?" in out.stdout


def test_data_module_imports_no_datasets() -> None:
    code = "import sys, contracts.config; print('datasets' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False"]
