"""Tests for services.demo.tiny_base: tokenizer, config, and the warm-started tiny base checkpoint."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import services.demo.tiny_base as tiny_base
from services.contracts.data import parse_row, render_prompt
from services.demo.synthetic import synth_rows
from services.demo.tiny_base import (
    BUILD_INFO,
    EOS_TOKEN,
    answer_correct,
    build_tiny_base,
    ensure_tiny_base,
    tiny_qwen2_config,
    train_tokenizer,
)

SAMPLES = [
    "Tom has 23 apples and buys 45 more. How many apples does Tom have?\nAnswer: 68",
    "A shop had 1234567 coins; it's 3.14 and -42 or 1,000 Ünïcödé café\r\n\ttabs  spaces",
    "<|im_start|>user\nWhat is 9+10?<|im_end|>\n<|endoftext|>",
]


def _corpus(n: int = 300) -> list[str]:
    rows = synth_rows(n, seed=0)
    texts = [r["prompt"][0]["content"] for r in rows]
    return texts + [f"Answer: {r['reward_model']['ground_truth']}" for r in rows]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return train_tokenizer(_corpus())


# ---------------------------------------------------------------------------------------------
# tokenizer and config


def test_tokenizer_special_tokens(tokenizer: Any) -> None:
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.pad_token == EOS_TOKEN
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == 0
    for special in ("<|im_start|>", "<|im_end|>", EOS_TOKEN):
        ids = tokenizer(special)["input_ids"]
        assert len(ids) == 1, special
    assert not getattr(tokenizer, "chat_template", None)
    assert len(tokenizer) <= 512
    # No BOS/EOS added on encode: prompts are used as they are.
    assert tokenizer("Answer")["input_ids"] == tokenizer.convert_tokens_to_ids(["Answer"])


def test_digits_are_single_tokens(tokenizer: Any) -> None:
    for text in ["1234567890", " 68", "Answer: 105", "x=42.5"]:
        tokens = tokenizer.convert_ids_to_tokens(tokenizer(text)["input_ids"])
        for tok in tokens:
            if any(c.isdigit() for c in tok):
                assert len(tok) == 1, (text, tokens)
    ids = tokenizer("Answer: 105")["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids)[-3:] == ["1", "0", "5"]


def test_tokenizer_decodes_back(tokenizer: Any) -> None:
    for text in SAMPLES:
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_tokenizer_round_trips_through_auto_tokenizer(tokenizer: Any, tmp_path: Path) -> None:
    """ENVIRONMENT.md: AutoTokenizer on a qwen2 checkpoint swaps in Qwen2's pre-tokenizer."""
    tokenizer.save_pretrained(tmp_path)
    tiny_qwen2_config(len(tokenizer)).save_pretrained(tmp_path)  # config.json says qwen2
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen2"
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in [*SAMPLES, *_corpus(20)]:
        assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"], text
    assert reloaded.eos_token_id == tokenizer.eos_token_id
    assert reloaded.pad_token_id == tokenizer.pad_token_id
    assert len(reloaded) == len(tokenizer)


def test_tiny_config() -> None:
    cfg = tiny_qwen2_config(300)
    assert cfg.model_type == "qwen2"
    assert cfg.hidden_size // cfg.num_attention_heads == 32
    assert cfg.tie_word_embeddings is False
    assert cfg.eos_token_id == cfg.pad_token_id == cfg.bos_token_id == 0
    assert cfg.vocab_size == 300
    with pytest.raises(AssertionError, match="head_dim"):
        tiny_qwen2_config(300, hidden_size=64, num_heads=4)
    with pytest.raises(ValueError, match="divisible"):
        tiny_qwen2_config(300, hidden_size=130, num_heads=4)


@pytest.mark.parametrize(
    ("response", "truth", "ok"),
    [
        ("Answer: 68", "68", True),
        ("answer : 68\n", "68", True),
        ("Answer: 12\nAnswer: 68", "68", True),
        ("Answer: 68\nAnswer: 12", "68", False),
        ("Answer: 68abc", "68", False),
        ("Answer: 1,068", "1068", True),
        ("68", "68", False),
        ("Answer: -5", "-5", True),
    ],
)
def test_answer_correct(response: str, truth: str, ok: bool) -> None:
    assert answer_correct(response, truth) is ok


# ---------------------------------------------------------------------------------------------
# build


def _small_build(out_dir: Path, **overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "train_rows": synth_rows(600, seed=0),
        "eval_rows": synth_rows(32, seed=99),
        "seed": 0,
        "max_sft_steps": 60,
        "batch_size": 32,
        "eval_every": 60,
        "eval_samples": 32,
        "target_acc": (0.0, 1.0),
    }
    kwargs.update(overrides)
    return build_tiny_base(out_dir, **kwargs)


def test_build_saves_a_loadable_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "bases" / "tiny"
    messages: list[str] = []
    info = _small_build(out, progress=messages.append)

    # Outcome: it trained, and the record says what happened.
    assert info["steps"] == 60 and info["in_band"] is True
    assert info["final_loss"] < info["initial_loss"] - 1.0
    assert 0.0 <= info["accuracy"] <= 1.0 and info["seconds"] > 0 and info["seed"] == 0
    assert json.loads((out / BUILD_INFO).read_text()) == info
    assert any("step 60" in m for m in messages)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    assert [p.name for p in out.parent.iterdir()] == ["tiny"]  # no temp dir left behind

    # The checkpoint loads through the Auto classes, as the other services will load it.
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == "qwen2" and config.tie_word_embeddings is False
    model: Any = AutoModelForCausalLM.from_pretrained(out)
    tok: Any = AutoTokenizer.from_pretrained(out)
    assert model.num_parameters() == info["num_parameters"]
    assert len(tok) == info["vocab_size"] == config.vocab_size
    rec = parse_row(synth_rows(1, seed=5)[0])
    prompt = render_prompt(tok, rec.messages)
    assert prompt == rec.messages[0]["content"]  # no chat template: the raw prompt
    enc = tok(prompt, return_tensors="pt")
    out_ids = model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out_ids.shape[1] > enc["input_ids"].shape[1]
    # After a short warm start the most likely continuation already begins with "Answer".
    first = tok.decode(out_ids[0, enc["input_ids"].shape[1] :])
    assert first.startswith("Answer"), first


def test_ensure_tiny_base_reuses_existing_build(tmp_path: Path) -> None:
    out = tmp_path / "tiny"
    first = ensure_tiny_base(out, **_small_build_kwargs())
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    t0 = time.monotonic()
    # Empty rows would make a rebuild fail; a cache hit never looks at them.
    second = ensure_tiny_base(out, train_rows=[], eval_rows=[])
    assert time.monotonic() - t0 < 1.0
    assert second == first
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime


def _small_build_kwargs() -> dict[str, Any]:
    return {
        "train_rows": synth_rows(200, seed=1),
        "eval_rows": synth_rows(8, seed=98),
        "max_sft_steps": 5,
        "batch_size": 8,
        "eval_every": 5,
        "eval_samples": 8,
        "target_acc": (0.0, 1.0),
    }


def test_build_stops_at_first_evaluation_in_band(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scripted = iter([0.0, 0.05, 0.3, 0.3, 0.3])
    monkeypatch.setattr(tiny_base, "sampling_accuracy", lambda *a, **k: next(scripted))
    info = _small_build(
        tmp_path / "m", max_sft_steps=50, eval_every=5, batch_size=4, target_acc=(0.15, 0.45)
    )
    assert info["steps"] == 15 and info["in_band"] is True and info["accuracy"] == 0.3
    assert [e["step"] for e in info["evals"]] == [5, 10, 15]


def test_build_keeps_closest_checkpoint_when_none_in_band(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    accuracies = iter([0.0, 0.9, 0.45, 0.95])
    snapshots: list[dict[str, torch.Tensor]] = []

    def fake_accuracy(model: torch.nn.Module, *args: Any, **kwargs: Any) -> float:
        snapshots.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return next(accuracies)

    monkeypatch.setattr(tiny_base, "sampling_accuracy", fake_accuracy)
    out = tmp_path / "m"
    info = _small_build(out, max_sft_steps=20, eval_every=5, batch_size=4, target_acc=(0.1, 0.4))
    assert info["in_band"] is False
    assert info["steps"] == 15 and info["accuracy"] == 0.45  # closest to the band
    saved = load_file(str(out / "model.safetensors"))
    chosen, last = snapshots[2], snapshots[3]
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(saved[name], chosen[name])
    assert not torch.equal(saved[name], last[name])


def test_build_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="target_acc"):
        _small_build(tmp_path / "a", target_acc=(0.5, 0.2))
    with pytest.raises(ValueError, match="non-empty"):
        _small_build(tmp_path / "b", eval_rows=[])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.slow
def test_default_build_lands_in_band(tmp_path: Path) -> None:
    """The tuned defaults reach the target band on difficulty-1 problems (~1 min on 2 cores)."""
    info = build_tiny_base(
        tmp_path / "m", train_rows=synth_rows(4000, seed=0), eval_rows=synth_rows(128, seed=1000)
    )
    assert info["in_band"] is True
    assert 0.15 <= info["accuracy"] <= 0.45
