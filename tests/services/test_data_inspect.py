"""`dapo data inspect` (issue 42) prints what a run would read: rows read, parsed and refused,
the columns used, each row's scorer and why, one prompt as the model sees it with its ground
truth, and every refused row with its reason; the exit status says whether any was refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from contracts.data import write_rows
from services.cli import main
from tests.contracts.test_data_formats import CHAT, GSM8K, VERL, jsonl


def inspect(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["data", "inspect", *args])
    return code, capsys.readouterr().out


def config(tmp_path: Path, **sections: Any) -> str:
    tree = {"model": {"path": str(tmp_path / "no-model")}, **sections}
    tree.setdefault("data", {"train_path": str(tmp_path / "train.jsonl")})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return str(path)


def test_a_gsm8k_file_with_bad_rows(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = jsonl(tmp_path / "gsm8k.jsonl", [*GSM8K, {"question": "no answer"}, "{broken"])
    code, out = inspect(capsys, str(path))
    assert code == 1
    assert "rows: 4 read, 2 parsed, 2 refused" in out
    assert "prompt column: question (2 rows)" in out
    assert "ground truth column: answer (2 rows)" in out
    assert "data_source: gsm8k (2 rows)" in out
    assert "scorer: dapo-reference (reward.verifier) (2 rows)" in out
    assert "  | Natalia sold 48 clips" in out and "its ground truth: '72'" in out
    assert "row 2 (line 3): field 'reward_model.ground_truth' is missing" in out
    assert "row 3 (line 4): invalid JSON" in out


def test_a_verl_parquet_chooses_a_scorer_per_source(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = write_rows(tmp_path / "verl.parquet", VERL)
    reward = {"verifier": "math-verify", "verifier_by_source": {"openai/gsm8k": "first-number"}}
    code, out = inspect(capsys, str(path), "--config", config(tmp_path, reward=reward))
    assert code == 0 and "rows: 2 read, 2 parsed, 0 refused" in out
    assert "prompt column: prompt (2 rows)" in out
    assert "ground truth column: reward_model.ground_truth (2 rows)" in out
    assert "first-number (reward.verifier_by_source['openai/gsm8k']) (1 rows)" in out
    assert "math-verify (reward.verifier) (1 rows)" in out
    assert "refused" not in out.split("0 refused", 1)[1]


def test_a_chat_file_through_the_models_chat_template(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    model = tmp_path / "model"
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=raw)
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    tok.save_pretrained(model)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    path = jsonl(tmp_path / "chat.jsonl", CHAT)
    cfg = config(tmp_path)
    code, out = inspect(capsys, str(path), "--config", cfg, "--set", f"model.path={model}")
    assert code == 0
    assert "prompt column: messages (2 rows)" in out
    assert "ground truth column: messages[-1].content (1 rows), answer (1 rows)" in out
    assert f"rendered with {model}'s chat template" in out
    assert "  | <system>Be brief.\n  | <user>What is 2 + 3?\n" in out  # the reply is not in it
    assert "its ground truth: '5'" in out


def test_a_generated_gym_set_from_its_config(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pytest.importorskip("reasoning_gym")
    data = {
        "train_path": str(tmp_path / "gym" / "train.parquet"),
        "eval_path": str(tmp_path / "gym" / "eval.parquet"),
        "prompt_format": "completion",
        "gym": {
            "tasks": [{"task": "chain_sum", "params": {"max_terms": 2, "max_digits": 2}}],
            "num_train": 30,
            "num_eval": 5,
            "answer_format": "first-line",
            "few_shot": 1,
        },
    }
    code, out = inspect(capsys, "--config", config(tmp_path, data=data))
    assert code == 0 and "rows: 30 read, 30 parsed, 0 refused" in out
    assert "scorer: reasoning-gym:chain_sum (the row's reasoning-gym task) (30 rows)" in out
    assert "rendered with data.prompt_format: completion" in out
    assert "  | Q: State the final answer" in out and out.count("  | A:") == 2


def test_no_file_and_no_config_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "inspect"]) == 2
    assert "give a FILE" in capsys.readouterr().err
