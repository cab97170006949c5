"""The Hugging Face export of staged weights: views into flat buckets, written without a model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from learner.export import HFExporter
from services.demo.tiny_base import tiny_qwen2_config, train_tokenizer


def base_model(path: Path) -> Any:
    tokenizer = train_tokenizer(
        ["Tom has 23 apples and buys 45 more.\nAnswer: 68"] * 4, vocab_size=300
    )
    tokenizer.save_pretrained(path)
    config = tiny_qwen2_config(
        len(tokenizer),
        hidden_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=2,
        intermediate_size=64,
    )
    model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    model.save_pretrained(path)
    return model


def staged_views(model: Any) -> list[tuple[str, torch.Tensor]]:
    """Trained-looking weights as the publisher stages them: views into one flat bucket."""
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    flat = torch.cat([t.reshape(-1) for _, t in named]) + 1.0
    out, offset = [], 0
    for name, t in named:
        out.append((name, flat[offset : offset + t.numel()].view(t.shape)))
        offset += t.numel()
    return out


def test_export_loads_with_from_pretrained_and_holds_the_staged_weights(tmp_path: Path) -> None:
    base = base_model(tmp_path / "base")
    staged = staged_views(base)
    out = tmp_path / "final_model"
    HFExporter(str(tmp_path / "base")).export(iter(staged), out)
    HFExporter(str(tmp_path / "base")).export(iter(staged), out)  # replaces an existing folder
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "base",
        "final_model",
    ]  # no temporaries left
    loaded = AutoModelForCausalLM.from_pretrained(out)
    params = dict(loaded.named_parameters())
    for name, tensor in staged:
        torch.testing.assert_close(params[name].detach(), tensor)
    assert set(load_file(out / "model.safetensors")) == set(
        load_file(tmp_path / "base" / "model.safetensors")
    )
    assert AutoTokenizer.from_pretrained(out).encode("Tom has 23") == AutoTokenizer.from_pretrained(
        tmp_path / "base"
    ).encode("Tom has 23")


def test_a_large_model_is_sharded_with_an_index(tmp_path: Path) -> None:
    base = base_model(tmp_path / "base")
    staged = staged_views(base)
    out = tmp_path / "hf"
    HFExporter(str(tmp_path / "base"), max_shard_size="50KB").export(iter(staged), out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    params = dict(AutoModelForCausalLM.from_pretrained(out).named_parameters())
    for name, tensor in staged:
        torch.testing.assert_close(params[name].detach(), tensor)
