"""Build a tiny Qwen2-architecture "base model" with partial arithmetic skill, on CPU.

DAPO starts from a pretrained base model (Qwen2.5-32B in the paper). Here that is out of reach,
so a ~1M-parameter Qwen2 model is made from scratch and warm-started by supervised learning on
prompt -> "Answer: N" + EOS until its *sampling* accuracy (temperature 1.0, as DAPO samples)
sits in a target band, e.g. 20-30%. A base that is at 0% gives RL no signal and one that is
saturated gives no room; dynamic sampling (DAPO s3.2) needs groups with mixed outcomes.

The build is the same on every run of the same machine type: one thread, deterministic kernels,
a seeded data order and seeded evaluations, so the weights' SHA-256 (`build_info.json`,
`weights_sha256`) repeats. Which checkpoint becomes the base is decided by measurement, not by
a step count: accuracy climbs from ~5% to ~45% within ~100 steps, so a fixed step would land
anywhere in that climb on a machine whose float rounding differs. The build evaluates avg@k on
the evaluation problems (the run's own metric) every few steps until accuracy has passed the
band, and keeps the checkpoint closest to the band's centre.

Departures from the paper: the tokenizer is a tiny BPE trained here on the prompts (Qwen2's
pre-tokenizer regex, so digits are single tokens and `AutoTokenizer` reloads it faithfully,
see ENVIRONMENT.md "Tokenizers"); there is no chat template; accuracy during the build uses a
minimal local form of the DAPO verifier (last `Answer:` in the last 300 characters, compared
as a string after dropping spaces and thousands commas), not the reward service.

The output directory is a normal Hugging Face checkpoint (safetensors + tokenizer) plus
`build_info.json`; it is written to a temporary sibling and renamed, so a directory with
`build_info.json` is always complete.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import logging
import math
import os
import platform
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from contracts.data import PromptRecord, parse_row, render_prompt

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")
EOS_TOKEN_ID = 0  # the trainer gives special tokens the first ids, in SPECIAL_TOKENS order
BUILD_INFO = "build_info.json"

_ANSWER_RE = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)


# ---------------------------------------------------------------------------------------------
# Tokenizer and model


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 512, added_tokens: Sequence[str] = ()
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE with Qwen2's pre-tokenizer; no chat template.

    Qwen2's split regex isolates every digit (`\\p{N}`), so numbers are spelled digit by digit
    whatever the merges. Using the same normalizer and pre-tokenizer as transformers'
    Qwen2Tokenizer means a checkpoint whose config says `qwen2` reloads through
    `AutoTokenizer` with identical encodings.
    """
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if added_tokens:  # whole tokens wherever they appear, and kept when decoding
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    if tok.token_to_id(EOS_TOKEN) != EOS_TOKEN_ID:
        raise RuntimeError(f"{EOS_TOKEN} got id {tok.token_to_id(EOS_TOKEN)}, expected 0")
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        extra_special_tokens=list(SPECIAL_TOKENS[1:]),
    )


def tiny_qwen2_config(
    vocab_size: int,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 4,
    intermediate_size: int = 512,
    max_position_embeddings: int = 512,
    eos_token_id: int = EOS_TOKEN_ID,
) -> Qwen2Config:
    """A small Qwen2 config. `eos_token_id` also serves as bos and pad, as in Qwen2.

    head_dim must be >= 32 (vLLM's CPU attention rejects 16, ENVIRONMENT.md), and the
    embeddings are untied (vLLM on CPU keeps stale output weights after a reload when tied).
    """
    if hidden_size % num_heads != 0:
        raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
    head_dim = hidden_size // num_heads
    assert head_dim >= 32, f"head_dim {head_dim} < 32: vLLM CPU attention needs >= 32"
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )


# ---------------------------------------------------------------------------------------------
# Data for the warm start


def answer_correct(response: str, ground_truth: str) -> bool:
    """Minimal DAPO verifier: the last `Answer:` line within the last 300 characters, compared
    with the ground truth after dropping spaces and commas. (The reward service's verifier
    also normalises LaTeX; integer answers need none of that.)"""
    matches = _ANSWER_RE.findall(response[-300:])
    if not matches:
        return False
    pred = matches[-1].strip().replace(" ", "").replace(",", "")
    return bool(pred == ground_truth.strip().replace(" ", "").replace(",", ""))


def _completion_text(record: PromptRecord) -> str:
    """The warm start's target: the row's worked solution when it has one (`extra_info.solution`,
    synthetic level 6), else the bare answer line."""
    solution = record.extra_info.get("solution")
    return solution if isinstance(solution, str) and solution else f"Answer: {record.ground_truth}"


def _encode_sft(
    tokenizer: PreTrainedTokenizerFast, records: list[PromptRecord], max_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, labels, lengths) for prompt + completion + EOS.

    Labels are -100 on the prompt and the padding, so the loss is on the completion only.
    Returns tensors of shape (N, T), (N, T), (N,).
    """
    prompts = tokenizer([render_prompt(tokenizer, r.messages) for r in records])["input_ids"]
    answers = tokenizer([_completion_text(r) for r in records])["input_ids"]
    seqs = [(p, [*a, tokenizer.eos_token_id]) for p, a in zip(prompts, answers, strict=True)]
    width = max(len(p) + len(c) for p, c in seqs)
    if width > max_len:
        raise ValueError(f"a training sequence has {width} tokens > max positions {max_len}")
    input_ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    lengths = torch.empty(len(seqs), dtype=torch.long)
    for i, (p, c) in enumerate(seqs):
        n = len(p) + len(c)
        input_ids[i, :n] = torch.tensor(p + c)
        labels[i, len(p) : n] = torch.tensor(c)
        lengths[i] = n
    return input_ids, labels, lengths


@torch.no_grad()
def sampling_accuracy(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    records: list[PromptRecord],
    *,
    max_new_tokens: int = 12,
    batch_size: int = 128,
    samples_per_problem: int = 1,
    seed: int | None = None,
) -> float:
    """avg@k: the fraction of `samples_per_problem` samples per record answered correctly, each
    sampled at temperature 1.0, top_p 1.0 (top_k off), the way DAPO samples rollouts.

    With `seed`, sampling draws from a generator seeded with it (the global RNG is left as it
    was), so the same weights always measure the same accuracy."""
    if not records:
        raise ValueError("no evaluation records")
    if samples_per_problem < 1:
        raise ValueError(f"samples_per_problem must be >= 1, got {samples_per_problem}")
    was_training, padding_side = model.training, tokenizer.padding_side
    model.train(False)
    tokenizer.padding_side = "left"  # generation continues each prompt from its last token
    repeated = [r for r in records for _ in range(samples_per_problem)]
    correct = 0
    try:
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            for start in range(0, len(repeated), batch_size):
                chunk = repeated[start : start + batch_size]
                texts = _sample(model, tokenizer, chunk, max_new_tokens)
                correct += sum(
                    answer_correct(t, r.ground_truth) for t, r in zip(texts, chunk, strict=True)
                )
    finally:
        model.train(was_training)
        tokenizer.padding_side = padding_side
    return correct / len(repeated)


def weights_sha256(model: torch.nn.Module) -> str:
    """SHA-256 of the model's tensors (names, dtypes, shapes and bytes, in name order): the same
    weights give the same digest whatever file they were saved in."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().contiguous().cpu()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


@contextlib.contextmanager
def deterministic_cpu() -> Iterator[None]:
    """One thread and deterministic kernels for the duration: the reduction order of a
    multi-threaded kernel depends on the thread count, so a build on 2 cores and one on 64 would
    otherwise differ in the last bits, and those bits grow over hundreds of optimizer steps."""
    threads = torch.get_num_threads()
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        torch.set_num_threads(threads)


def _sample(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    records: list[PromptRecord],
    max_new_tokens: int,
) -> list[str]:
    """One sampled completion per record (left-padded batch), decoded without special tokens."""
    prompts = [render_prompt(tokenizer, r.messages) for r in records]
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    out = model.generate(  # type: ignore[misc]
        **enc,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,  # transformers samples from the top 50 by default; DAPO uses the full softmax
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    new_tokens = cast(torch.Tensor, out)[:, enc["input_ids"].shape[1] :]  # (B, new)
    texts: list[str] = tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    return texts


# ---------------------------------------------------------------------------------------------
# Build


def build_tiny_base(
    out_dir: Path,
    *,
    train_rows: list[dict[str, Any]],
    eval_rows: list[dict[str, Any]],
    seed: int = 0,
    max_sft_steps: int = 800,
    batch_size: int = 64,
    lr: float = 1e-3,
    target_acc: tuple[float, float] = (0.20, 0.30),
    eval_every: int = 10,
    eval_samples: int = 128,
    samples_per_problem: int = 4,
    progress: Callable[[str], None] | None = None,
    vocab_size: int = 512,
    added_tokens: Sequence[str] = (),
    model_kwargs: dict[str, int] | None = None,
    max_new_tokens: int = 12,
) -> dict[str, Any]:
    """Train tokenizer + tiny Qwen2 and warm-start it to a sampling accuracy in `target_acc`.

    Every `eval_every` steps it measures avg@`samples_per_problem` on the first `eval_samples`
    eval rows (after a one-sample screen that skips the measurement while accuracy is below
    half the band's low edge); it stops at the first evaluation above the band (or at
    `max_sft_steps`) and keeps the evaluated checkpoint closest to the band's centre.
    `build_info.json` records every evaluation, whether the kept one is in the band, and the
    weights' SHA-256.

    Deterministic (`deterministic_cpu`, seeded data order and evaluations): two builds with the
    same arguments on the same machine type give the same weights.

    Defaults, measured on the 2-core development machine with difficulty-1 "short" rows: batch
    64 learns more per example than 128 at half the cost per step; lr 2e-3 learned slower than
    1e-3. Accuracy climbs from ~5% to ~45% within ~100 steps (around steps 300-450), so
    evaluations every 10 steps see the climb in steps of about 4 points, and 4 samples on 100
    problems measure it to about +-2 points.

    `max_new_tokens` bounds each sampled completion of the accuracy check: the run's
    `rollout.max_response_len`, so a worked solution is judged at the length RL will allow.

    Returns the build info written to `out_dir/build_info.json`.
    """
    out_dir = Path(out_dir)
    low, high = target_acc
    if not 0.0 <= low <= high <= 1.0:
        raise ValueError(f"target_acc must satisfy 0 <= low <= high <= 1, got {target_acc}")
    if eval_every < 1 or max_sft_steps < 1:
        raise ValueError("eval_every and max_sft_steps must be >= 1")
    train = [parse_row(r, row_number=i, source="train_rows") for i, r in enumerate(train_rows)]
    evals = [parse_row(r, row_number=i, source="eval_rows") for i, r in enumerate(eval_rows)]
    evals = evals[:eval_samples]
    if not train or not evals:
        raise ValueError("train_rows and eval_rows must be non-empty")

    def report(msg: str) -> None:
        logger.info(msg)
        if progress is not None:
            progress(msg)

    t0 = time.monotonic()
    with deterministic_cpu():
        torch.manual_seed(seed)
        # No chat template yet, so render_prompt's plain join is the prompt text.
        corpus = [render_prompt(None, r.messages) for r in train]
        corpus += [_completion_text(r) for r in train]
        tokenizer = train_tokenizer(corpus, vocab_size=vocab_size, added_tokens=added_tokens)
        config = tiny_qwen2_config(len(tokenizer), **(model_kwargs or {}))
        model = Qwen2ForCausalLM(config)  # type: ignore[no-untyped-call]
        input_ids, labels, lengths = _encode_sft(tokenizer, train, config.max_position_embeddings)
        report(
            f"tiny base: vocab {len(tokenizer)}, {model.num_parameters():,} params, "
            f"{len(train)} train rows, deterministic on 1 thread"
        )
        info = _warm_start(
            model,
            tokenizer,
            input_ids,
            labels,
            lengths,
            evals,
            seed=seed,
            max_steps=max_sft_steps,
            batch_size=batch_size,
            lr=lr,
            band=(low, high),
            eval_every=eval_every,
            samples_per_problem=samples_per_problem,
            report=report,
            max_new_tokens=max_new_tokens,
        )
    info.update(
        seconds=round(time.monotonic() - t0, 2),
        seed=seed,
        target_acc=[low, high],
        lr=lr,
        batch_size=batch_size,
        vocab_size=len(tokenizer),
        num_parameters=model.num_parameters(),
        train_rows=len(train),
        train_sha256=rows_sha256(train_rows),
        eval_samples=len(evals),
        samples_per_problem=samples_per_problem,
        weights_sha256=weights_sha256(model),
        torch_version=torch.__version__.split("+")[0],
        machine=platform.machine(),
    )
    return _save_atomically(out_dir, model, tokenizer, info, report)


def _warm_start(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    input_ids: torch.Tensor,  # (N, T)
    labels: torch.Tensor,  # (N, T)
    lengths: torch.Tensor,  # (N,)
    evals: list[PromptRecord],
    *,
    seed: int,
    max_steps: int,
    batch_size: int,
    lr: float,
    band: tuple[float, float],
    eval_every: int,
    samples_per_problem: int,
    report: Callable[[str], None],
    max_new_tokens: int,
) -> dict[str, Any]:
    """The supervised loop; leaves `model` holding the chosen checkpoint's weights."""
    gen = torch.Generator().manual_seed(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = min(20, max_steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / (warmup + 1)))
    model.train()
    centre = (band[0] + band[1]) / 2
    history: list[dict[str, float]] = []
    losses: list[float] = []
    best: tuple[float, int, float, dict[str, torch.Tensor] | None] = (math.inf, 0, 0.0, None)
    for step in range(1, max_steps + 1):
        idx = torch.randint(0, input_ids.shape[0], (batch_size,), generator=gen)
        width = int(lengths[idx].max())
        batch_ids, batch_labels = input_ids[idx, :width], labels[idx, :width]  # (B, T)
        mask = (torch.arange(width) < lengths[idx, None]).long()  # (B, T)
        loss = model(input_ids=batch_ids, attention_mask=mask, labels=batch_labels).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        sched.step()
        losses.append(loss.item())
        if step % eval_every != 0 and step != max_steps:
            continue
        recent = sum(losses[-eval_every:]) / len(losses[-eval_every:])
        measure = functools.partial(
            sampling_accuracy,
            model,
            tokenizer,
            evals,
            max_new_tokens=max_new_tokens,
            seed=seed * 1_000_003 + step,
        )
        # A one-sample screen first: most evaluations come before the climb, near 0%, and the
        # full avg@k costs k times as much. Only a screen near the band pays for the measurement.
        screen = measure(samples_per_problem=1)
        if screen < band[0] / 2 and step != max_steps:
            history.append({"step": step, "screen": screen, "loss": round(recent, 4)})
            report(f"tiny base: step {step} loss {recent:.3f} screen accuracy {screen:.3f}")
            continue
        acc = measure(samples_per_problem=samples_per_problem)
        history.append({"step": step, "accuracy": acc, "loss": round(recent, 4)})
        report(f"tiny base: step {step} loss {recent:.3f} sampling accuracy {acc:.3f}")
        if abs(acc - centre) < best[0]:
            best = (abs(acc - centre), step, acc, copy.deepcopy(model.state_dict()))
        if acc > band[1]:
            break  # past the band: later checkpoints only move further from it
    _, best_step, best_acc, state = best
    if state is not None:
        model.load_state_dict(state)
    in_band = band[0] <= best_acc <= band[1]
    if not in_band:
        report(
            f"tiny base: no evaluation in band {band}; keeping step {best_step} ({best_acc:.3f})"
        )
    return {
        "accuracy": best_acc,
        "steps": best_step,
        "in_band": in_band,
        "initial_loss": round(sum(losses[:10]) / len(losses[:10]), 4),
        "final_loss": round(sum(losses[-10:]) / len(losses[-10:]), 4),
        "evals": history,
    }


def _save_atomically(
    out_dir: Path,
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    info: dict[str, Any],
    report: Callable[[str], None],
) -> dict[str, Any]:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        try:
            # rename(2) replaces an empty directory but not a non-empty one.
            os.rename(tmp, out_dir)
        except OSError:
            existing = out_dir / BUILD_INFO
            if not existing.exists():
                raise
            # Another builder finished first; its checkpoint is as good as ours.
            report(f"tiny base: {out_dir} appeared during the build; keeping it")
            shutil.rmtree(tmp)
            return dict(json.loads(existing.read_text(encoding="utf-8")))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    report(f"tiny base: saved to {out_dir} (accuracy {info['accuracy']:.3f}, {info['seconds']} s)")
    return info


def rows_sha256(rows: Iterable[dict[str, Any]]) -> str:
    """A fingerprint of a build's training rows (`build_info.json`, `train_sha256`): a base is
    only reused by a run that would build it from the same rows."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def ensure_tiny_base(out_dir: Path, **kwargs: Any) -> dict[str, Any]:
    """Return `out_dir`'s build info if it exists (no rebuild), else `build_tiny_base`."""
    out_dir = Path(out_dir)
    info_path = out_dir / BUILD_INFO
    if info_path.exists():
        logger.info("tiny base: using the existing build in %s", out_dir)
        return dict(json.loads(info_path.read_text(encoding="utf-8")))
    return build_tiny_base(out_dir, **kwargs)
