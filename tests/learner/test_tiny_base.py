"""Tests for services.demo.tiny_base: tokenizer, config,
and the warm-started tiny base checkpoint."""

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
from contracts.data import parse_row, render_prompt
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

REPO = Path(__file__).resolve().parents[2]

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


def _scripted_accuracy(
    monkeypatch: pytest.MonkeyPatch, by_step: dict[int, float]
) -> dict[int, dict[str, torch.Tensor]]:
    """Replace the accuracy check by `by_step` (the build seeds each evaluation with its step
    when seed=0); returns the weights each step was evaluated with."""
    snapshots: dict[int, dict[str, torch.Tensor]] = {}

    def fake(model: torch.nn.Module, *args: Any, seed: int, **kwargs: Any) -> float:
        snapshots[seed] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return by_step[seed]

    monkeypatch.setattr(tiny_base, "sampling_accuracy", fake)
    return snapshots


def test_build_keeps_the_checkpoint_closest_to_the_band_centre(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not the first evaluation in the band (0.21 at step 15) but the one nearest its centre,
    and no evaluation after the first one above the band."""
    by_step = {5: 0.0, 10: 0.05, 15: 0.21, 20: 0.26, 25: 0.33, 30: 0.25}
    _scripted_accuracy(monkeypatch, by_step)
    info = _small_build(
        tmp_path / "m", max_sft_steps=50, eval_every=5, batch_size=4, target_acc=(0.2, 0.3)
    )
    assert info["steps"] == 20 and info["in_band"] is True and info["accuracy"] == 0.26
    assert [e["step"] for e in info["evals"]] == [5, 10, 15, 20, 25]
    # Below half the band's low edge, the one-sample screen stands in for the measurement.
    assert ["accuracy" in e for e in info["evals"]] == [False, False, True, True, True]


def test_build_keeps_closest_checkpoint_when_none_in_band(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshots = _scripted_accuracy(monkeypatch, {5: 0.0, 10: 0.05, 15: 0.6, 20: 0.2})
    out = tmp_path / "m"
    info = _small_build(out, max_sft_steps=20, eval_every=5, batch_size=4, target_acc=(0.1, 0.4))
    assert info["in_band"] is False
    assert info["steps"] == 10 and info["accuracy"] == 0.05  # closest to the centre, 0.25
    assert sorted(snapshots) == [5, 10, 15]  # 0.6 is past the band: the build stopped there
    saved = load_file(str(out / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(saved[name], snapshots[10][name])
    assert not torch.equal(saved[name], snapshots[15][name])


def test_build_is_deterministic_whatever_the_callers_threads(tmp_path: Path) -> None:
    """Two builds, one called with 2 threads and one with 1, write the same weights and measure
    the same accuracies; the digest in build_info is that of the saved weights, and another seed
    gives other weights (the digest is not a constant)."""
    threads = torch.get_num_threads()
    infos = []
    try:
        for n, name in ((2, "a"), (1, "b")):
            torch.set_num_threads(n)
            infos.append(_small_build(tmp_path / name, max_sft_steps=20, eval_every=10))
    finally:
        torch.set_num_threads(threads)
    assert torch.get_num_threads() == threads  # the build restores the caller's setting
    first, second = infos
    assert first["weights_sha256"] == second["weights_sha256"]
    assert first["evals"] == second["evals"]
    saved: Any = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    assert tiny_base.weights_sha256(saved) == first["weights_sha256"]
    other = _small_build(tmp_path / "c", max_sft_steps=20, eval_every=10, seed=1)
    assert other["weights_sha256"] != first["weights_sha256"]


def test_sampling_accuracy_with_a_seed_repeats(tmp_path: Path) -> None:
    _small_build(tmp_path / "m", max_sft_steps=30, eval_every=30)
    model: Any = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    tok: Any = AutoTokenizer.from_pretrained(tmp_path / "m")
    records = [parse_row(r) for r in synth_rows(16, seed=7)]
    state = torch.get_rng_state()
    runs = [
        tiny_base.sampling_accuracy(model, tok, records, samples_per_problem=4, seed=3)
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    assert torch.equal(torch.get_rng_state(), state)  # the caller's RNG is left alone


def test_build_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="target_acc"):
        _small_build(tmp_path / "a", target_acc=(0.5, 0.2))
    with pytest.raises(ValueError, match="non-empty"):
        _small_build(tmp_path / "b", eval_rows=[])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.slow
def test_demo_base_lands_in_the_band(tiny_cache: None) -> None:
    """The tiny preset's base, as `dapo run` builds it (the session's cached build): its
    accuracy lies in the preset's band, so the demo a user gets starts where the measured runs
    started (docs/results.md, the tiny preset). Its weights repeat bit for bit on one machine (the
    builds above) but not across CPU models, whose vector units round float sums differently:
    docs/results.md lists two."""
    info = json.loads((REPO / "runs/cache/tiny-qwen2-arith-v3" / BUILD_INFO).read_text())
    assert info["in_band"] is True and 0.20 <= info["accuracy"] <= 0.30
    assert len(info["weights_sha256"]) == 64
