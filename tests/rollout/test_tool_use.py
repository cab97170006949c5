"""Multi-turn generation with tools (rollout/tool_use.py): the call runs in a sandbox, its result
is context the model did not sample, a failing tool returns an error text and never loses the
response, and each model token keeps the log-prob and version it was sampled with."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from contracts.config import ToolsConfig
from contracts.schemas import PromptJob, Response, RolloutGroup
from learner.algos import policy_loss
from learner.batch import build_batch
from rollout.hf_engine import HFEngine
from rollout.sample import Sample
from rollout.tool_use import ToolBox, generate_with_tools
from tests.helpers import judged

FUNCTIONS = "tests.rollout.tool_functions"


class ScriptedEngine:
    """An engine that answers each context with the next scripted turn (text), log-prob -0.5
    per token, and reports the version `between_steps` returns."""

    def __init__(self, tokenizer: Any, turns: Callable[[str], str]) -> None:
        self.tokenizer, self.turns = tokenizer, turns
        self.contexts: list[str] = []

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seeds: object = None,
        between_steps: Callable[[], int] | None = None,
        stop: Sequence[str] = (),
    ) -> list[list[Sample]]:
        version = between_steps() if between_steps else 0
        out = []
        for prompt in prompts:
            context = self.tokenizer.decode(prompt)
            self.contexts.append(context)
            text = self.turns(context)
            ids = self.tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
            reason = "stop_string" if any(text.endswith(s) for s in stop) else "stop"
            samples = [Sample(ids, [-0.5] * len(ids), reason, (version, version))]
            out.append(samples * n)
        return out


def two_turns(context: str) -> str:
    """Call the calculator once, then answer with what it said."""
    if "<result>" not in context:
        return " <calculator>12*34</calculator>"
    return " Answer: " + context.rsplit("<result>", 1)[1].split("</result>")[0]


@pytest.fixture()
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def tools(tokenizer: Any, *functions: str, **settings: Any) -> ToolBox:
    cfg = ToolsConfig(enabled=True, functions=functions or ("calculator",), **settings)
    return ToolBox(cfg, tokenizer)


def run(engine: Any, box: ToolBox, tokenizer: Any, **kw: Any) -> list[Sample]:
    prompt = tokenizer.encode("What is 12 times 34?", add_special_tokens=False)
    return generate_with_tools(
        engine, box, [prompt], n=2, max_tokens=96, temperature=1.0, top_p=1.0, **kw
    )[0]


def test_the_result_is_inserted_as_context_the_model_did_not_sample(tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, two_turns)
    with tools(tokenizer) as box:
        samples = run(engine, box, tokenizer)
    for s in samples:
        text = tokenizer.decode(s.token_ids)
        assert text == " <calculator>12*34</calculator><result>408</result> Answer: 408"
        assert s.tool_calls == 1 and s.tool_errors == 0 and s.finish_reason == "stop"
        ((start, stop),) = s.tool_spans
        assert tokenizer.decode(s.token_ids[start:stop]) == "<result>408</result>"
        assert s.logprobs[start:stop] == [0.0] * (stop - start)
        assert all(lp == -0.5 for i, lp in enumerate(s.logprobs) if not start <= i < stop)
    # The second turn saw the whole trajectory: prompt, call, result.
    assert engine.contexts[-1].endswith("<calculator>12*34</calculator><result>408</result>")


@pytest.mark.parametrize(
    ("function", "expected"),
    [
        ("hang", "ran past its 1 s limit"),
        ("crash", "died during the call"),
        ("spawn", "starting processes is not allowed"),
        ("secret", "none"),
    ],
)
def test_a_failing_tool_returns_an_error_text_and_the_response_goes_on(
    tokenizer: Any, function: str, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DAPO_REDIS_URL", "redis://:secret@localhost:6379/0")
    engine = ScriptedEngine(
        tokenizer,
        lambda c: f" <{function}>x</{function}>" if "<result>" not in c else " Answer: 1",
    )
    with tools(tokenizer, f"{FUNCTIONS}:{function}", timeout_s=1.0) as box:
        samples = run(engine, box, tokenizer)
        result = samples[0]
        ((start, stop),) = result.tool_spans
        said = tokenizer.decode(result.token_ids[start:stop])
        assert expected in said, said
        assert tokenizer.decode(result.token_ids).endswith(" Answer: 1")  # the response went on
        failed = function != "secret"
        assert result.tool_errors == int(failed)
        assert result.tool_timeouts == int(function == "hang")
        if function in ("hang", "crash"):
            assert box.sandboxes[function].restarts >= 1  # replaced; the next call finds a worker


def test_calls_past_max_turns_end_the_response_unanswered(tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, lambda c: " <calculator>1+1</calculator>")
    with tools(tokenizer, max_turns=2) as box:
        samples = run(engine, box, tokenizer)
    assert samples[0].tool_calls == 2 and len(samples[0].tool_spans) == 2
    assert samples[0].finish_reason == "stop"
    assert tokenizer.decode(samples[0].token_ids).endswith("<calculator>1+1</calculator>")


def test_a_call_split_across_a_weight_update_keeps_each_turns_version(tokenizer: Any) -> None:
    """The weights change while the tool runs: the first turn's tokens keep version 3's log-probs,
    the second turn is sampled by version 4, and the response spans both."""
    version = [3]
    engine = ScriptedEngine(tokenizer, two_turns)

    def update_between_turns() -> None:
        version[0] = 4

    with tools(tokenizer) as box:
        samples = run(
            engine, box, tokenizer, between_steps=lambda: version[0], on_round=update_between_turns
        )
    assert samples[0].versions == (3, 4)


def test_tool_tokens_get_no_loss_and_the_loss_is_the_model_tokens_mean(tokenizer: Any) -> None:
    """A two-turn trajectory in a batch: mask 0 on the result, and on-policy the token-mean loss
    is minus the mean advantage over the model's own tokens; the result's log-probs get no
    gradient."""
    engine = ScriptedEngine(tokenizer, two_turns)
    with tools(tokenizer) as box:
        samples = run(engine, box, tokenizer)
    wrong = Sample(samples[1].token_ids[:3], [-0.5] * 3, "stop")
    responses = [
        Response(
            token_ids=s.token_ids,
            logprobs=s.logprobs,
            finish_reason="stop",
            tool_spans=s.tool_spans,
            tool_calls=s.tool_calls,
        )
        for s in (samples[0], wrong)
    ]
    job = PromptJob(
        group_id="g",
        prompt_index=0,
        prompt_ids=[1, 2, 3],
        ground_truth="408",
        data_source="test",
        issued_version=0,
        issued_at=0.0,
    )
    group = judged(
        RolloutGroup(job=job, policy_version=0, replica_id="r", responses=responses),
        acc=[True, False],
    )
    batch = build_batch([group], pad_id=0)
    ((start, stop),) = samples[0].tool_spans
    assert batch.response_mask[0, start:stop].sum() == 0
    model_tokens = len(samples[0].token_ids) - (stop - start)
    assert batch.response_mask[0].sum() == model_tokens and batch.response_mask[1].sum() == 3

    log_prob = batch.behaviour_log_prob.clone().requires_grad_(True)
    loss, _ = policy_loss(
        log_prob,
        batch.behaviour_log_prob,
        batch.advantages,
        batch.response_mask,
        clip_low=0.2,
        clip_high=0.28,
        loss_agg="token-mean",
    )
    adv = batch.advantages.tolist()
    hand = -(adv[0] * model_tokens + adv[1] * 3) / (model_tokens + 3)
    assert loss.item() == pytest.approx(hand, abs=1e-6)
    loss.backward()
    assert log_prob.grad is not None
    assert torch.all(log_prob.grad[0, start:stop] == 0)
    assert torch.all(log_prob.grad[0, :start] != 0)


def test_the_transformers_engine_stops_at_a_stop_string_and_keeps_its_tokens(
    tiny_model_dir: Path,
) -> None:
    """Same seed with and without a stop string: the stopped sample is the shortest prefix of
    the free one whose text holds the string."""
    engine = HFEngine(str(tiny_model_dir), seed=0)
    prompt = [[5, 6, 7, 8]]
    kw: dict[str, Any] = dict(n=1, max_tokens=12, temperature=1.0, top_p=1.0, seeds=[[11]])
    (free,) = engine.generate(prompt, **kw)[0:1][0]
    text = engine.tokenizer.decode(free.token_ids)
    stop = text[len(text) // 2 : len(text) // 2 + 1]
    assert stop.strip(), f"pick another seed: {text!r}"
    (cut,) = engine.generate(prompt, stop=[stop], **kw)[0]
    assert cut.finish_reason == "stop_string"
    assert free.token_ids[: len(cut.token_ids)] == cut.token_ids
    assert stop in engine.tokenizer.decode(cut.token_ids)
    assert stop not in engine.tokenizer.decode(cut.token_ids[:-1])
    assert cut.logprobs == pytest.approx(free.logprobs[: len(cut.logprobs)], abs=1e-5)


def test_a_tool_that_cannot_be_loaded_fails_at_start_naming_the_setting() -> None:
    from contracts.config import ConfigError
    from rollout.tool_use import check_tools

    check_tools(ToolsConfig(enabled=True, functions=("calculator", "python")))
    with pytest.raises(ConfigError, match=r"rollout\.tools\.functions: 'no_such_mod:fn'"):
        check_tools(ToolsConfig(enabled=True, functions=("no_such_mod:fn",)))
    check_tools(ToolsConfig(enabled=False, functions=("no_such_mod:fn",)))  # off: not loaded
