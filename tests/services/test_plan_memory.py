"""The capacity model's learner memory against memory measured on this CPU, for a model small
enough to build here: parameters, gradients, AdamW state and a micro-batch's activations of a
Qwen2 model built from a config (no download), fp32 on one rank, measured as resident-memory
deltas in a child process whose allocator returns freed memory at once (so the deltas are live
memory, not the heap's high-water mark)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.planning.capacity import ModelShape

REPO = Path(__file__).resolve().parents[2]
MODEL = {
    "hidden_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 1536,
    "vocab_size": 8192,
    "tie_word_embeddings": True,
    "max_position_embeddings": 1024,
}
MICRO_BATCH, SEQ_LEN = 4, 512
TOLERANCE = 0.15
"""The model counts tensors; the process also holds buffers (RoPE tables, autograd's
bookkeeping) that do not scale with the model, a few MiB here."""


def predicted_mib() -> dict[str, float]:
    """The capacity model's parts for this shape: fp32 (CPU: no mixed precision), one rank, no
    checkpointing. The decoder alone (no output head: the check's loss reads the last hidden
    state), which is a tied model's parameter count."""
    shape = ModelShape.from_config(MODEL)
    n, tokens = shape.params, MICRO_BATCH * SEQ_LEN
    final_norm = 2 * 4 * shape.hidden  # fp32 input and output of the last RMSNorm
    return {
        "parameters": 4 * n / 2**20,
        "gradients": 4 * n / 2**20,
        "optimizer": 8 * n / 2**20,
        "activations": tokens * (shape.layers * shape.activation_bytes(4) + final_norm) / 2**20,
    }


def measure() -> dict[str, float]:
    import torch
    from transformers import Qwen2Config, Qwen2Model

    torch.set_num_threads(1)
    torch.manual_seed(0)

    def rss() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    # One step of a one-layer model of the same architecture first, then freed: the first step
    # of a process allocates things once (autograd's engine, kernel scratch, the optimizer's
    # machinery) that would otherwise land in whichever part is measured first, by a margin that
    # differs between machines (12 to 16 MiB on the same kind of machine).
    warm = Qwen2Model(Qwen2Config(**{**MODEL, "num_hidden_layers": 1}, attn_implementation="sdpa"))
    warm(input_ids=torch.randint(0, MODEL["vocab_size"], (MICRO_BATCH, 16))).last_hidden_state.pow(
        2
    ).mean().backward()
    torch.optim.AdamW(warm.parameters(), lr=1e-4).step()
    del warm

    ids = torch.randint(0, MODEL["vocab_size"], (MICRO_BATCH, SEQ_LEN))
    start = rss()
    model = Qwen2Model(Qwen2Config(**MODEL, attn_implementation="sdpa"))
    built = rss()
    hidden = model(input_ids=ids).last_hidden_state  # (B, T, H)
    loss = hidden.pow(2).mean()
    forward = rss()
    loss.backward()
    del hidden, loss
    backward = rss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    optimizer.step()  # its state exists from the first step (and is freed with the optimizer)
    stepped = rss()
    return {
        "parameters": built - start,
        "activations": forward - built,
        "gradients": backward - built,
        "optimizer": stepped - backward,
    }


@pytest.mark.timeout(300)
def test_learner_memory_model_matches_memory_measured_on_cpu() -> None:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "tests.services.test_plan_memory"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
        check=True,
    )
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    predicted = predicted_mib()
    print()
    for part, want in predicted.items():
        got = measured[part]
        print(f"{part}: predicted {want:.1f} MiB, measured {got:.1f} MiB ({want / got - 1:+.1%})")
    for part, want in predicted.items():
        assert want == pytest.approx(measured[part], rel=TOLERANCE), part


if __name__ == "__main__":
    print(json.dumps(measure()))


def test_lora_budget_counts_the_adapters_peft_injects() -> None:
    """`ModelShape.lora_params` is the count of the adapters peft adds to the real architecture,
    and with LoRA the budget's gradients and AdamW moments are those adapters' alone, the base
    frozen in the compute dtype, and a weight sync sends the adapters."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from contracts.config import build_config
    from contracts.lora import inject_adapters, is_adapter_param
    from services.planning.capacity import budget, sync_bytes

    overrides = ["learner.lora.enabled=true", "learner.lora.rank=8", "learner.nproc=2"]
    overrides.append("learner.mixed_precision=none")  # the frozen base in fp32, as on CPU
    cfg = build_config({"model": {"path": "m"}, "data": {"train_path": "t.parquet"}}, overrides)
    with torch.device("meta"):
        model = inject_adapters(Qwen2ForCausalLM(Qwen2Config(**MODEL)), cfg.learner.lora)
    adapters = sum(p.numel() for n, p in model.named_parameters() if is_adapter_param(n))
    shape = ModelShape.from_config(MODEL)
    assert shape.lora_params(8, cfg.learner.lora.target_modules) == adapters
    parts = budget(cfg, shape, 80.0).learner
    assert parts["optimizer"] == pytest.approx(8 * adapters / 2 / 2**30)
    assert parts["gradients"] == pytest.approx(4 * adapters / 2 / 2**30)
    assert parts["parameters"] == pytest.approx((4 * shape.params + 4 * adapters) / 2 / 2**30)
    assert sync_bytes(cfg, shape) == 4 * adapters  # float32 on CPU
    with pytest.raises(ValueError, match="no module"):
        shape.lora_params(8, ("qkv_proj",))
