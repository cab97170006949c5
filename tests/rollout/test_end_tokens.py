"""Responses end at any of the model's end tokens: the tokenizer's eos and every eos of
`generation_config.json` (Qwen2.5-Instruct and Llama-3-Instruct list two).

The model is built in the test so that it samples only two tokens, an ordinary one and
`<|im_end|>`, each with probability ~1/2: `<|im_end|>` is an end token of the generation config
but not the tokenizer's eos (`<|endoftext|>`, which the model never samples). An engine that
stopped at the tokenizer's eos alone would run every response to `max_tokens`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM

from rollout.end_tokens import end_token_ids
from rollout.hf_engine import HFEngine, response_end
from services.demo.synthetic import synth_rows
from services.demo.tiny_base import EOS_TOKEN_ID, tiny_qwen2_config, train_tokenizer

MAX_TOKENS = 24


def save_two_end_token_model(out: Path) -> tuple[int, int]:
    """A tiny Qwen2 whose next token is `word` or `<|im_end|>` (logit 12 each, every other token
    0), at every position; its generation config lists `<|im_end|>` and `<|endoftext|>` as end
    tokens, as Qwen2.5-Instruct's does. Returns (word, im_end) ids."""
    rows = synth_rows(200, seed=0)
    tok = train_tokenizer([r["prompt"][0]["content"] for r in rows], vocab_size=300)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert isinstance(im_end, int)
    word = int(tok("Answer")["input_ids"][0])
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        tiny_qwen2_config(len(tok), num_layers=1, hidden_size=64, num_heads=2, num_kv_heads=2)
    ).eval()
    with torch.no_grad():
        # Every input token has the same embedding, so every position of every sequence has the
        # same final hidden state h (attention averages identical values); an output row
        # c * h / |h|^2 then gives exactly logit c, whatever came before.
        model.model.embed_tokens.weight.copy_(
            model.model.embed_tokens.weight[1].expand_as(model.model.embed_tokens.weight)
        )
        h = model.model(torch.tensor([[1]])).last_hidden_state[0, -1]  # (H,)
        model.lm_head.weight.zero_()
        for tid in (word, im_end):
            model.lm_head.weight[tid] = 12.0 * h / h.dot(h)
    model.generation_config.eos_token_id = [im_end, EOS_TOKEN_ID]
    model.generation_config.pad_token_id = EOS_TOKEN_ID
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return word, im_end


@pytest.fixture(scope="module")
def two_end_tokens(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, int]:
    out = tmp_path_factory.mktemp("two-end-tokens")
    word, im_end = save_two_end_token_model(out)
    return out, word, im_end


def test_end_tokens_are_the_tokenizers_eos_and_the_generation_configs(tmp_path: Path) -> None:
    assert end_token_ids(str(tmp_path), 7) == [7]  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert end_token_ids(str(tmp_path), 7) == [7, 9]  # an int
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7, 11]}))
    # a list, without repeating the tokenizer's
    assert end_token_ids(str(tmp_path), 7) == [7, 9, 11]
    assert end_token_ids(str(tmp_path), None) == [9, 7, 11]
    (tmp_path / "generation_config.json").write_text(json.dumps({}))
    with pytest.raises(ValueError, match="names an end token"):
        end_token_ids(str(tmp_path), None)


def test_a_response_ends_at_its_first_end_token() -> None:
    assert response_end([4, 9, 5, 7, 7], [7, 9]) == (2, "stop")
    assert response_end([4, 5, 6], [7, 9]) == (3, "length")
    assert response_end([7], [7, 9]) == (1, "stop")


def test_transformers_engine_stops_at_the_generation_configs_end_token(
    two_end_tokens: tuple[Path, int, int],
) -> None:
    model_dir, word, im_end = two_end_tokens
    engine = HFEngine(str(model_dir), seed=0)
    assert engine.end_ids == [EOS_TOKEN_ID, im_end]
    [group] = engine.generate([[5, 6, 7]], n=16, max_tokens=MAX_TOKENS, temperature=1.0, top_p=1.0)
    for s in group:  # P(no <|im_end|> in 24 tokens) = 2^-24 per sample
        assert s.finish_reason == "stop"
        assert s.token_ids == [word] * (len(s.token_ids) - 1) + [im_end]  # cut right after it
        assert len(s.logprobs) == len(s.token_ids)
        # log(1/2): the model's own choice
        assert s.logprobs[-1] == pytest.approx(-0.6931, abs=1e-3)
    assert len({len(s.token_ids) for s in group}) > 1  # sampled lengths, not a fixed cut
