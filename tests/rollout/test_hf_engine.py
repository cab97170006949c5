"""The transformers engine: samples are well formed and their behaviour log-probs are those of
the distribution sampled from (temperature, top-p renormalisation)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollout.hf_engine import HFEngine, nucleus_mask


def test_nucleus_mask_keeps_smallest_set_reaching_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(nucleus_mask(logits, 0.7))
    assert kept.tolist() == [[True, True, False, False]]
    assert torch.isfinite(nucleus_mask(logits, 0.01)).sum() == 1  # the top token always stays


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.7)])
def test_behaviour_logprobs_match_a_forward_pass(
    tiny_model_dir: Path, temperature: float, top_p: float
) -> None:
    engine = HFEngine(str(tiny_model_dir), seed=0)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    out = engine.generate(prompts, n=3, max_tokens=6, temperature=temperature, top_p=top_p)
    assert [len(g) for g in out] == [3, 3]
    for prompt, group in zip(prompts, out, strict=True):
        for s in group:
            assert len(s.token_ids) == len(s.logprobs) and s.finish_reason in ("stop", "length")
            if not s.token_ids:
                continue
            ids = torch.tensor([prompt + s.token_ids])
            with torch.no_grad():
                logits = engine.model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
            if top_p < 1:
                logits = nucleus_mask(logits, top_p)
            expected = (
                torch.log_softmax(logits, -1)
                .gather(-1, torch.tensor(s.token_ids)[:, None])
                .squeeze(-1)
            )
            torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-4, rtol=1e-4)


def test_temperature_zero_is_greedy_decoding(tiny_model_dir: Path) -> None:
    """As vLLM: temperature 0 takes the most likely token at every step, in every copy of a
    group and with or without seeds (the skill report's greedy pass@1)."""
    engine = HFEngine(str(tiny_model_dir), seed=0)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    for seeds in (None, [[1, 2], [3, 4]]):
        out = engine.generate(prompts, n=2, max_tokens=6, temperature=0.0, top_p=1.0, seeds=seeds)
        for prompt, group in zip(prompts, out, strict=True):
            assert group[0].token_ids == group[1].token_ids
            ids = list(prompt)
            for token in group[0].token_ids:
                with torch.no_grad():
                    logits = engine.model(torch.tensor([ids])).logits[0, -1]
                assert token == int(logits.argmax())
                ids.append(token)


def test_shared_prefill_samples_what_expanded_prompts_sample(tiny_model_dir: Path) -> None:
    """A group's prompt computed once gives the same responses, log-probs and random draws as
    the prompt expanded n times (prompts of unequal length: left padding included)."""
    engine = HFEngine(str(tiny_model_dir), seed=0)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17]]
    runs = {}
    for shared in (True, False):
        engine.shared_prefill = shared
        torch.manual_seed(123)
        runs[shared] = engine.generate(prompts, n=4, max_tokens=8, temperature=1.0, top_p=1.0)
    for group_shared, group_expanded in zip(runs[True], runs[False], strict=True):
        for a, b in zip(group_shared, group_expanded, strict=True):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            torch.testing.assert_close(
                torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=1e-5
            )
    # The draws differ between responses of a group: four samples, not one repeated.
    assert len({tuple(s.token_ids) for s in runs[True][0]}) > 1


def test_a_seeded_sample_depends_on_its_seed_and_the_weights_only(tiny_model_dir: Path) -> None:
    """Paired evaluation: a sample drawn with a seed is the same alone or beside other prompts
    (other lengths, other positions), with or without shared prefill, in another engine."""
    prompt, seeds = [5, 6, 7, 8], [11, 12, 13]
    alone = HFEngine(str(tiny_model_dir), seed=0).generate(
        [prompt], n=3, max_tokens=8, temperature=1.0, top_p=0.9, seeds=[seeds]
    )[0]
    engine = HFEngine(str(tiny_model_dir), seed=99)
    for shared in (True, False):
        engine.shared_prefill = shared
        torch.manual_seed(shared)  # the global generator plays no part
        batch = engine.generate(
            [[9, 10, 11, 12, 13, 14, 15], prompt, [16]],
            n=3,
            max_tokens=8,
            temperature=1.0,
            top_p=0.9,
            seeds=[[1, 2, 3], seeds, [4, 5, 6]],
        )[1]
        assert [s.token_ids for s in batch] == [s.token_ids for s in alone]
        torch.testing.assert_close(
            torch.tensor([x for s in batch for x in s.logprobs]),
            torch.tensor([x for s in alone for x in s.logprobs]),
        )
    other = engine.generate(
        [prompt] * 2,
        n=3,
        max_tokens=8,
        temperature=1.0,
        top_p=0.9,
        seeds=[[21, 22, 23], [31, 32, 33]],
    )
    assert [s.token_ids for g in other for s in g] != [s.token_ids for s in alone] * 2
    with pytest.raises(ValueError, match="3 seeds for each of the 1 prompts"):
        engine.generate([prompt], n=3, max_tokens=8, temperature=1.0, top_p=1.0, seeds=[[1]])


def test_seeded_sampling_draws_from_the_models_distribution(tiny_model_dir: Path) -> None:
    """The Gumbel-max draw is a draw from softmax(logits / T): the first token's frequencies over
    many seeds match its probabilities."""
    engine, prompt, temperature, draws = HFEngine(str(tiny_model_dir)), [5, 6, 7], 2.0, 4000
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt])).logits[0, -1].float()
    probs = torch.softmax(logits / temperature, -1)
    out = engine.generate(
        [prompt],
        n=draws,
        max_tokens=1,
        temperature=temperature,
        top_p=1.0,
        seeds=[list(range(draws))],
    )[0]
    counts = torch.bincount(torch.tensor([s.token_ids[0] for s in out]), minlength=len(probs))
    top = probs.argsort(descending=True)[:5]
    for tok in top.tolist():  # within 4.5 standard errors of the expected count
        expected = draws * probs[tok].item()
        assert (
            abs(counts[tok].item() - expected)
            <= 4.5 * (expected * (1 - probs[tok].item())) ** 0.5 + 1
        )


def test_update_weights_swaps_all_or_nothing(tiny_model_dir: Path) -> None:
    engine = HFEngine(str(tiny_model_dir), seed=0)
    new = {n: p.detach() + 1 for n, p in engine.model.named_parameters()}
    first = next(iter(new))
    with pytest.raises(ValueError, match="lack"):  # one missing: nothing is swapped
        engine.update_weights((n, t) for n, t in new.items() if n != first)
    assert not torch.equal(dict(engine.model.named_parameters())[first], new[first])
    engine.update_weights(iter(new.items()))
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, new[name])


def test_weights_swapped_between_decode_steps_sample_the_rest(tiny_model_dir: Path) -> None:
    """In-flight update: new weights arrive after the 2nd sampled token. Tokens 0 and 1 carry the
    old policy's log-probs; later ones the new policy's, computed over the KV the old weights had
    cached for the prompt and token 0; every longer sample records versions (0, 1)."""
    engine = HFEngine(str(tiny_model_dir), seed=0)
    old = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    new = {n: p * 1.5 for n, p in old.items()}  # sharper logits: a different policy
    calls: list[int] = []

    def between_steps() -> int:
        calls.append(len(calls))
        if len(calls) == 3:  # after tokens 0 and 1
            engine.update_weights(new.items())
        return 0 if len(calls) < 3 else 1

    prompt = [5, 6, 7, 8]
    [group] = engine.generate(
        [prompt], n=4, max_tokens=6, temperature=1.0, top_p=1.0, between_steps=between_steps
    )
    before, after = HFEngine(str(tiny_model_dir)), HFEngine(str(tiny_model_dir))
    after.update_weights(new.items())
    checked = 0
    for s in group:
        assert s.versions == ((0, 1) if len(s.token_ids) > 2 else (0, 0))
        for t, (tok, logp) in enumerate(zip(s.token_ids, s.logprobs, strict=True)):
            with torch.no_grad():
                if t < 2:
                    logits = before.model(torch.tensor([prompt + s.token_ids[:t]])).logits[0, -1]
                else:
                    cache = before.model(
                        torch.tensor([prompt + s.token_ids[:1]]), use_cache=True
                    ).past_key_values
                    logits = after.model(
                        torch.tensor([s.token_ids[1:t]]), past_key_values=cache
                    ).logits[0, -1]
                    checked += 1
            assert logp == pytest.approx(
                float(torch.log_softmax(logits.float(), -1)[tok]), abs=1e-4
            )
    assert checked > 0


def test_versions_are_the_lowest_and_highest_the_hook_returned(tiny_model_dir: Path) -> None:
    """The version can go down mid-generation (a failed broadcast, then a reload of an older
    checkpoint): tokens 0, 1, 2.. are sampled under versions 5, 6, 4, 4..; a response's range is
    the min and max over its own tokens, not (first, last)."""
    engine = HFEngine(str(tiny_model_dir), seed=0)
    returned = iter([5, 6])

    def between_steps() -> int:
        return next(returned, 4)

    [group] = engine.generate(
        [[5, 6, 7, 8]], n=6, max_tokens=5, temperature=1.0, top_p=1.0, between_steps=between_steps
    )
    expected = {1: (5, 5), 2: (5, 6)}
    assert any(len(s.token_ids) > 2 for s in group)
    for s in group:
        assert s.versions == expected.get(len(s.token_ids), (4, 6))
