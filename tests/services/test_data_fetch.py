"""`dapo data fetch` (services/data/fetch.py): conversion of published files, duplicates
merged, the presets' file names, and the error when the Hub cannot be reached.

No test downloads: the download step is injected and returns a local fixture written in the
published schema; the offline test runs the real download with the Hub switched off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from contracts.config import load_config
from contracts.data import DAPO_PROMPT_TEMPLATE, DataError, load_prompts, write_rows
from services.data.fetch import KNOWN_DATASETS, fetch

ROOT = Path(__file__).resolve().parents[2]
INSTRUCTION = DAPO_PROMPT_TEMPLATE.replace("{problem}", "{}")


def _published_dapo_rows(repeats: int) -> list[dict[str, Any]]:
    """DAPO-Math-17K as published: each problem repeated, each copy with its own UUID index."""
    problems = [("Find x if 2x = 10.", "5"), ("How many primes are below 10?", "4")]
    return [
        {
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": INSTRUCTION.format(text)}],
            "ability": "MATH",
            "reward_model": {"ground_truth": answer, "style": "rule"},
            "extra_info": {"index": f"uuid-{copy}-{i}"},
        }
        for copy in range(repeats)
        for i, (text, answer) in enumerate(problems)
    ]


class FakeHub:
    """The injected download step: serves local fixtures, records what was asked for."""

    def __init__(self, files: dict[tuple[str, str], Path]) -> None:
        self.files = files
        self.calls: list[tuple[str, str]] = []

    def __call__(self, repo_id: str, filename: str) -> Path:
        self.calls.append((repo_id, filename))
        return self.files[(repo_id, filename)]


def test_dapo_math_17k_converted_with_duplicates_merged(tmp_path: Path) -> None:
    published = write_rows(
        tmp_path / "hub" / "dapo-math-17k.parquet", _published_dapo_rows(repeats=3)
    )
    hub = FakeHub({("BytedTsinghua-SIA/DAPO-Math-17k", "data/dapo-math-17k.parquet"): published})
    (out,) = fetch("dapo-math-17k", tmp_path / "data", download=hub)
    assert hub.calls == [("BytedTsinghua-SIA/DAPO-Math-17k", "data/dapo-math-17k.parquet")]
    assert out == tmp_path / "data" / "dapo-math-17k.parquet"
    records = load_prompts(out)
    assert len(records) == 2  # 6 published rows, 2 distinct problems
    assert [r.ground_truth for r in records] == ["5", "4"]
    # Published prompts pass through untouched (never wrapped in the instruction again).
    assert records[0].messages == [
        {"role": "user", "content": INSTRUCTION.format("Find x if 2x = 10.")}
    ]
    assert {r.data_source for r in records} == {"math_dapo"}
    assert records[1].extra_info == {"index": "uuid-0-1"}  # the first copy's


def test_aime_2024_converted(tmp_path: Path) -> None:
    rows = _published_dapo_rows(repeats=32)
    published = write_rows(tmp_path / "hub" / "aime.parquet", rows)
    hub = FakeHub({("BytedTsinghua-SIA/AIME-2024", "data/aime-2024.parquet"): published})
    (out,) = fetch("aime-2024", tmp_path / "data", download=hub)
    assert out.name == "aime-2024.parquet"
    assert [r.ground_truth for r in load_prompts(out)] == ["5", "4"]


def test_gsm8k_flat_rows_get_the_instruction_and_final_answers(tmp_path: Path) -> None:
    train = write_rows(
        tmp_path / "hub" / "train.parquet",
        [{"question": "Tom has 3 apples and buys 4.", "answer": "3 + 4 = 7\n#### 7"}],
    )
    test = write_rows(
        tmp_path / "hub" / "test.parquet",
        [{"question": "A farm has 1,000 hens twice.", "answer": "2 * 1,000\n#### 2,000"}],
    )
    hub = FakeHub(
        {
            ("openai/gsm8k", "main/train-00000-of-00001.parquet"): train,
            ("openai/gsm8k", "main/test-00000-of-00001.parquet"): test,
        }
    )
    outs = fetch("gsm8k", tmp_path / "data", download=hub)
    assert [p.name for p in outs] == ["gsm8k-train.parquet", "gsm8k-test.parquet"]
    (rec,) = load_prompts(outs[1])
    assert rec.ground_truth == "2000"
    assert rec.messages == [
        {"role": "user", "content": INSTRUCTION.format("A farm has 1,000 hens twice.")}
    ]
    assert rec.data_source == "gsm8k"


def test_math_500_keeps_its_subject_level_and_id(tmp_path: Path) -> None:
    rows = [
        {
            "problem": "Compute $\\dfrac{1}{2}$ of 6.",
            "solution": "...",
            "answer": "3",
            "subject": "Prealgebra",
            "level": 1,
            "unique_id": "test/prealgebra/1.json",
        }
    ]
    published = write_rows(tmp_path / "hub" / "test.jsonl", rows)
    hub = FakeHub({("HuggingFaceH4/MATH-500", "test.jsonl"): published})
    (out,) = fetch("math-500", tmp_path / "data", download=hub)
    (rec,) = load_prompts(out)
    assert rec.ground_truth == "3"
    assert rec.data_source == "math500"
    assert rec.extra_info == {
        "index": 0,
        "subject": "Prealgebra",
        "level": 1,
        "unique_id": "test/prealgebra/1.json",
    }


def test_a_changed_published_schema_fails_naming_the_column(tmp_path: Path) -> None:
    rows = _published_dapo_rows(repeats=1)
    for row in rows:
        row["reward_model"] = {"answer": row["reward_model"]["ground_truth"]}
    published = write_rows(tmp_path / "hub" / "changed.parquet", rows)
    hub = FakeHub({("BytedTsinghua-SIA/AIME-2024", "data/aime-2024.parquet"): published})
    with pytest.raises(DataError, match=r"row 0: field 'reward_model\.ground_truth' is missing"):
        fetch("aime-2024", tmp_path / "data", download=hub)
    assert not (tmp_path / "data" / "aime-2024.parquet").exists()


def test_unknown_name_lists_the_known_sets(tmp_path: Path) -> None:
    with pytest.raises(
        DataError, match="unknown data set 'aime-2025'; known: dapo-math-17k, aime-2024"
    ):
        fetch("aime-2025", tmp_path, download=FakeHub({}))


def test_presets_read_files_that_fetch_writes() -> None:
    """Every data path under data/ in configs/*.yaml is a file some known set writes."""
    written = {f"data/{local}" for known in KNOWN_DATASETS.values() for _, local in known.files}
    preset_paths = set()
    for preset in sorted((ROOT / "configs").glob("*.yaml")):
        data = load_config(preset).data.model_dump()  # a LoRA preset `extends:` another
        preset_paths |= {
            data[k] for k in ("train_path", "eval_path") if str(data.get(k)).startswith("data/")
        }
    assert preset_paths == {"data/dapo-math-17k.parquet", "data/aime-2024.parquet"}
    assert preset_paths <= written


def test_offline_fetch_fails_with_a_clear_error(tmp_path: Path) -> None:
    """The real download step with the Hub switched off (HF_HUB_OFFLINE: no network is tried)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "data",
            "fetch",
            "aime-2024",
            "--out",
            str(tmp_path / "data"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    assert out.stderr.startswith(
        "dapo data fetch: cannot download data/aime-2024.parquet of the Hub dataset "
        "BytedTsinghua-SIA/AIME-2024"
    )
    assert "This machine may be offline or unable to reach the Hugging Face Hub" in out.stderr
    assert not (tmp_path / "data").exists()
