"""The vLLM engine's bookkeeping around vLLM, with a stand-in for `vllm.LLM` (no engine starts):
each sample's version range is the lowest and highest version `between_steps` returned until its
request finished; the engine starts with this replica's seed and without the model's own
sampling defaults (`generation_config="vllm"`)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from contracts.config import build_config
from rollout.engine import make_engine, replica_seed

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed"
)


@dataclass
class _Logprob:
    logprob: float


@dataclass
class _Completion:
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, _Logprob]]
    finish_reason: str = "length"


@dataclass
class _Output:
    request_id: str
    outputs: list[_Completion]
    finished: bool = True


@dataclass
class _Core:
    """Request i finishes at step `finish_at[i]` (0-based) with one token per step."""

    finish_at: list[int]
    step_no: int = 0
    kwargs: dict[str, Any] = field(default_factory=dict)

    def has_unfinished_requests(self) -> bool:
        return self.step_no <= max(self.finish_at)

    def step(self) -> list[_Output]:
        done = [
            _Output(str(i), [_Completion(0, [7] * (last + 1), [{7: _Logprob(-1.0)}] * (last + 1))])
            for i, last in enumerate(self.finish_at)
            if last == self.step_no
        ]
        self.step_no += 1
        return done


class _FakeLLM:
    """What `VLLMEngine` uses of `vllm.LLM`."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.llm_engine = _Core(finish_at=[0])

    def enqueue(
        self, inputs: list[Any], params: list[Any], lora_request: Any = None, use_tqdm: bool = False
    ) -> None:
        assert len(inputs) == len(params) == len(self.llm_engine.finish_at)

    def reset_prefix_cache(self) -> bool:
        return True


@pytest.fixture()
def fake_vllm(monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path) -> Any:
    import vllm

    monkeypatch.setattr(vllm, "LLM", _FakeLLM)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # the engine sets it; restored afterwards
    cfg = build_config(
        {
            "model": {"path": str(tiny_model_dir)},
            "data": {"train_path": "unused.jsonl"},
            "rollout": {"engine": "vllm", "seed": 3},
        }
    )
    return make_engine(cfg, replica_id="rollout-host-7")


def test_the_engine_starts_with_the_replica_seed_and_no_model_sampling_defaults(
    fake_vllm: Any,
) -> None:
    kwargs = fake_vllm.llm.kwargs
    assert kwargs["seed"] == replica_seed(3, "rollout-host-7")
    assert kwargs["generation_config"] == "vllm"


def test_versions_are_the_lowest_and_highest_seen_until_a_request_finished(fake_vllm: Any) -> None:
    # Request 0 finishes at step 1, request 1 at step 3. The hook runs before step 0 (5), then
    # between steps: 6, 4, 8. The version goes down (a failed broadcast, an older checkpoint).
    fake_vllm.llm.llm_engine = _Core(finish_at=[1, 3])
    returned = iter([5, 6, 4, 8])
    groups = fake_vllm.generate(
        [[1, 2], [3]],
        n=1,
        max_tokens=4,
        temperature=1.0,
        top_p=1.0,
        between_steps=lambda: next(returned),
    )
    assert [g[0].versions for g in groups] == [(5, 6), (4, 8)]
    assert [len(g[0].token_ids) for g in groups] == [2, 4]
