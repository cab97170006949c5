"""The light engine: a transformers model sampling in this process (CPU tests and demos).

Same interface as the vLLM engine. Sampling uses `generate` with the raw logits returned, and the
behaviour log-prob of each sampled token is that of the distribution actually sampled from:
log_softmax(logits / temperature), renormalised over the top-p nucleus when top_p < 1 (the same
quantity as vLLM's "processed" log-probs). With top_p = 1 (training) this is exactly what the
learner recomputes. No other setting shapes sampling: the model's own generation config (a
repetition penalty, top-k, min-p...) is replaced by one that keeps only its end tokens
(`rollout.generation_config`), since transformers fills every setting `generate` is not given
from it.

A response ends at the first of the model's end tokens (`rollout.end_tokens.end_token_ids`: the
tokenizer's eos and every eos of the generation config), which it keeps, with finish reason
"stop"; a response that reaches `max_tokens` without one ends with "length".

Shared prefill: the prompt of a group is run through the model once and its key/value cache
repeated for the group's n responses (`_prefill`), as vLLM's prefix cache does, instead of
expanding each prompt n times before the forward pass. The responses, their log-probs and the
random draws are the same either way (tests/rollout/test_hf_engine.py).

Seeded samples (`seeds`, evaluation): each sample draws from a generator of its own, seeded by
the caller (`rollout.engine.eval_seeds`: problem, sample index, `eval.seed`), by the Gumbel-max
trick (`_SeededSampling`): the token is the argmax of the log-probabilities plus Gumbel noise
from the sample's generator, which is an exact draw from the same distribution. A sample then
depends only on its seed and the weights, not on the other rows of the batch nor on anything
sampled before, so the same weights give the same evaluation in any run.

In-flight weight updates: `between_steps` runs after every sampled token (a stopping criterion
that never stops), so new weights are copied into the model between two decode steps; the
logits of each later token, and so its log-prob, come from the new weights. A sample's
`versions` are the lowest and highest version that sampled any of its tokens (a version can go
down: after a failed broadcast the replica reloads an older checkpoint).

LoRA (`learner.lora`): the engine injects the learner's adapters into its model
(`contracts.lora.inject_adapters`), so a weight sync copies the adapter tensors by name and the
base stays as loaded; a checkpoint's adapter folder loads the same way, and the base model's
folder resets the adapters to zero (the base policy, version 0).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Cache,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from contracts.config import LoraConfig as LoraSettings
from contracts.lora import inject_adapters, is_adapter_dir, is_adapter_param, read_adapter
from contracts.weight_sync import DTYPES
from rollout.end_tokens import end_token_ids
from rollout.generation_config import log_ignored_settings
from rollout.sample import Sample

log = logging.getLogger(__name__)


def nucleus_mask(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set logits outside the top-p nucleus to -inf (the most likely token always stays)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    drop_sorted = cum - sorted_logits.softmax(-1) >= top_p  # mass before this token already >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def response_end(tokens: list[int], end_ids: list[int]) -> tuple[int, str]:
    """(length, finish reason) of a generated row: up to and including its first end token
    ("stop"), else the whole row ("length"). What follows the end token is padding."""
    ends = set(end_ids)
    for i, tok in enumerate(tokens):
        if tok in ends:
            return i + 1, "stop"
    return len(tokens), "length"


class _EveryStep(StoppingCriteria):
    """Runs `between_steps` after each sampled token and records the version that will sample
    the next one; never stops a sequence."""

    def __init__(self, between_steps: Callable[[], int]) -> None:
        self.between_steps = between_steps
        self.versions = [between_steps()]  # versions[t]: the policy version that sampled token t

    def __call__(
        self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object
    ) -> torch.BoolTensor:
        self.versions.append(self.between_steps())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]


def _version_range(versions: list[int]) -> tuple[int, int]:
    """(lowest, highest) of the versions that sampled a response's tokens."""
    return min(versions), max(versions)


class _SeededSampling(LogitsProcessor):
    """Sampling with one generator per row: returns log_softmax(logits / T) (top-p masked) plus
    Gumbel noise drawn from row r's generator, whose argmax (greedy decoding) is a draw from
    that distribution. Every row draws one vector per decode step, so its t-th token uses the
    t-th draw of its own generator whatever the batch holds."""

    def __init__(self, seeds: list[int], temperature: float, top_p: float) -> None:
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]
        self.temperature, self.top_p = temperature, top_p

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        logits = scores.float() / self.temperature  # (R, V)
        if self.top_p < 1.0:
            logits = nucleus_mask(logits, self.top_p)
        vocab = logits.shape[-1]
        uniform = torch.stack([torch.rand(vocab, generator=g) for g in self.generators])
        tiny = torch.finfo(uniform.dtype).tiny
        gumbel = -torch.log(-torch.log(uniform.clamp_min(tiny)))  # (R, V)
        return torch.log_softmax(logits, dim=-1) + gumbel.to(logits.device)  # type: ignore[return-value]


class HFEngine:
    def __init__(
        self,
        model_dir: str,
        *,
        dtype: str = "float32",
        seed: int = 0,
        lora: LoraSettings | None = None,
    ) -> None:
        # Any: transformers' stubs type generate() by the mixin, not by the model it returns.
        self.model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype])
        self.lora = lora
        if lora is not None:
            self.model = inject_adapters(self.model, lora)
            self._reset_adapters()
        self.model.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.end_ids = end_token_ids(model_dir, self.tokenizer.eos_token_id)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.end_ids[0])
        # generate() takes every setting it is not given from here: keep the end tokens only.
        log_ignored_settings(model_dir)
        self.model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
            eos_token_id=self.end_ids, pad_token_id=self.pad_id
        )
        self.shared_prefill = True
        """Compute each prompt once for its group (`_prefill`); False expands every prompt n
        times before the forward pass, as `num_return_sequences` does (bench/skip.py compares)."""
        self.generator = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seeds: Sequence[Sequence[int]] | None = None,
        between_steps: Callable[[], int] | None = None,
        stop: Sequence[str] = (),
    ) -> list[list[Sample]]:
        if seeds is not None and [len(s) for s in seeds] != [n] * len(prompts):
            raise ValueError(f"seeds must hold {n} seeds for each of the {len(prompts)} prompts")
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        hook = _EveryStep(between_steps) if between_steps is not None else None  # new weights first
        greedy = temperature == 0  # as vLLM: the most likely token, seeds or not
        expand: dict[str, object] = {"num_return_sequences": n}
        if self.shared_prefill and n > 1 and width > 1:
            expand = {"past_key_values": self._prefill(ids, mask, n)}
            ids, mask = ids.repeat_interleave(n, dim=0), mask.repeat_interleave(n, dim=0)
        elif seeds is not None or greedy:  # greedy decoding takes no num_return_sequences
            expand = {}
            ids, mask = ids.repeat_interleave(n, dim=0), mask.repeat_interleave(n, dim=0)
        sampling: dict[str, object] = (
            {"do_sample": False}
            if greedy
            else {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
            if seeds is None
            else {  # greedy over Gumbel-perturbed log-probs: one generator per sample
                "do_sample": False,
                "logits_processor": LogitsProcessorList(
                    [_SeededSampling([s for row in seeds for s in row], temperature, top_p)]
                ),
            }
        )
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            **expand,
            **sampling,
            max_new_tokens=max_tokens,
            eos_token_id=self.end_ids,
            pad_token_id=self.pad_id,
            return_dict_in_generate=True,
            output_logits=True,
            stopping_criteria=StoppingCriteriaList([hook] if hook else []),
            **({"stop_strings": list(stop), "tokenizer": self.tokenizer} if stop else {}),
        )
        new = out.sequences[:, width:]  # (B*n, T)
        # Log-probs of the distribution sampled from; greedy decoding's, unscaled.
        logits = torch.stack(out.logits, dim=1).float() / (1.0 if greedy else temperature)
        if top_p < 1.0 and not greedy:
            logits = nucleus_mask(logits, top_p)
        logp = (
            torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        )  # (B*n, T)
        samples: list[Sample] = []
        for row in range(new.shape[0]):
            toks = new[row].tolist()
            end, reason = response_end(toks, self.end_ids)
            cut = self._stop_string_end(toks[:end], stop) if stop else None
            if cut is not None:
                end, reason = cut, "stop_string"
            versions = _version_range(hook.versions[: max(end, 1)]) if hook else None
            samples.append(Sample(toks[:end], logp[row, :end].tolist(), reason, versions))
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _stop_string_end(self, tokens: list[int], stop: Sequence[str]) -> int | None:
        """The length of the shortest prefix of `tokens` whose text contains a `stop` string
        (generation stopped that row there; what follows is padding), or None. Containing one
        only grows with the prefix, so a binary search decodes log2(len) prefixes."""

        def holds(k: int) -> bool:
            text = self.tokenizer.decode(tokens[:k], skip_special_tokens=False)
            return any(s in text for s in stop)

        if not tokens or not holds(len(tokens)):
            return None
        low, high = 1, len(tokens)
        while low < high:
            mid = (low + high) // 2
            if holds(mid):
                high = mid
            else:
                low = mid + 1
        return low

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor, n: int) -> Cache:
        """The key/value cache of every prompt token but the last, computed once per prompt and
        repeated for its n responses (row i*n + j is response j of prompt i, the order
        `num_return_sequences` gives). `generate` then starts from it and runs only the last
        prompt token n times, which yields the first sampled token's logits. Positions are the
        ones `generate` gives left-padded rows: counted over the attention mask, 0 on padding."""
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        cache = self.model(
            input_ids=ids[:, :-1],
            attention_mask=mask[:, :-1],
            position_ids=positions[:, :-1],
            use_cache=True,
            logits_to_keep=1,  # only the cache is wanted: no (B, T, vocab) logits
        ).past_key_values
        cache.batch_repeat_interleave(n)
        repeated: Cache = cache
        return repeated

    @torch.no_grad()
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Receive every tensor first, then swap: a broadcast that fails half-way leaves the
        weights (and the policy version they belong to) untouched."""
        params = self._swapped_params()
        staged = dict(weights)
        missing = set(params) - set(staged)
        if missing:
            raise ValueError(f"the new weights lack {sorted(missing)[:3]}")
        unknown = set(staged) - set(params)
        if unknown:
            raise ValueError(
                f"the new weights have tensors this model lacks: {sorted(unknown)[:3]}"
            )
        for name, tensor in staged.items():
            params[name].copy_(tensor)

    def _swapped_params(self) -> dict[str, torch.Tensor]:
        """What a weight sync replaces: every parameter, or the adapters alone (LoRA)."""
        params = dict(self.model.named_parameters())
        if self.lora is None:
            return params
        return {n: p for n, p in params.items() if is_adapter_param(n)}

    @torch.no_grad()
    def _reset_adapters(self) -> None:
        for name, param in self.model.named_parameters():
            if ".lora_B." in name:
                param.zero_()

    def load_weights_from_dir(self, path: str) -> None:
        if self.lora is not None:
            if is_adapter_dir(path):
                self.update_weights(read_adapter(path).items())
            else:  # the base model's folder: the base policy, which the adapters start from
                self._reset_adapters()
            return
        if is_adapter_dir(path):
            raise ValueError(f"{path} is a LoRA adapter; this engine serves full weights")
        fresh = AutoModelForCausalLM.from_pretrained(path, dtype=self.model.dtype)
        self.model.load_state_dict(fresh.state_dict())

    weights_consistent_after_failure = True
    receives_on_host = True  # the model lives in this process: any host tensor can be copied in

    def close(self) -> None:
        pass
