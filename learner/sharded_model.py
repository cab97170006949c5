"""The policy as every learner rank holds it: FSDP2-sharded over the ranks without any rank ever
holding the whole model (built on the meta device, sharded, then each rank reads only its own rows
of each tensor from the safetensors files), with LoRA adapters injected before sharding when
`learner.lora` is on."""

from __future__ import annotations

import contextlib
import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM

from contracts.config import LoraConfig as LoraSettings
from contracts.lora import base_name, init_adapter, inject_adapters, is_adapter_param
from learner.batch import PACKED_ATTENTION

log = logging.getLogger(__name__)


def device_for(backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_sharded_model(
    path: str,
    device: torch.device,
    *,
    rank: int,
    world_size: int,
    mp: MixedPrecisionPolicy,
    checkpointing: bool,
    lora: LoraSettings | None = None,
    seed: int = 0,
) -> torch.nn.Module:
    """The policy, FSDP2-sharded over the ranks, without any rank ever holding the whole model.

    Built on the meta device (no memory), sharded (`fully_shard` per decoder layer, then the
    root), materialised as empty shards on `device`, then each rank reads only its own rows of
    each tensor from the Hugging Face safetensors files. fp32 master weights.

    With `lora`, adapters are injected before sharding and everything else is frozen; the frozen
    base is kept in the compute dtype when that is bf16 (no fp32 master copy of weights that
    never step), and the adapters start from `seed` (`contracts.lora.init_adapter`).
    """
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = policy_from_config(config)
        if lora is not None:
            model = inject_adapters(model, lora)
            if mp.param_dtype is not None:
                for param in model.parameters():
                    if not param.requires_grad:
                        param.data = param.data.to(mp.param_dtype)
    model.config.use_cache = False
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mesh = init_device_mesh(device.type, (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=device)
    load_local_shards(model, Path(path), rank=rank, world_size=world_size, seed=seed)
    _recreate_buffers(model, device)
    sharded: torch.nn.Module = model
    return sharded


def policy_from_config(config: Any) -> Any:
    """The policy (fp32, random weights) under `PACKED_ATTENTION`, whatever the model's config.json
    asks for: the packed layout's mask is exact only there (`learner.batch.packed_layout_problem`).
    An architecture without that implementation gets its default, and the trainer then keeps to
    the row layout."""
    try:
        return AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, dtype=torch.float32, attn_implementation=PACKED_ATTENTION
        )
    except ValueError as exc:  # transformers' refusal of an implementation the class lacks
        log.warning("%s; loading the model with its default attention", exc)
        return AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, dtype=torch.float32
        )


def _weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (one file, or an index of shards)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        return {
            name: path / file for name, file in json.loads(index.read_text())["weight_map"].items()
        }
    single = path / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
    with safe_open(single, "pt") as f:
        return dict.fromkeys(f.keys(), single)


@torch.no_grad()
def load_local_shards(
    model: torch.nn.Module, path: Path, *, rank: int, world_size: int, seed: int = 0
) -> None:
    """Copy each parameter's local rows (FSDP2 shards dim 0 like `torch.chunk`) from the files;
    LoRA adapters, which the files do not hold, start fresh (`contracts.lora.init_adapter`)."""
    files = _weight_files(path)
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(f, "pt")) for f in set(files.values())}
        for name, param in model.named_parameters():
            stored_name = base_name(name)
            if stored_name not in files and not is_adapter_param(name):
                raise ValueError(f"{path}: the checkpoint has no tensor {stored_name!r}")
            local = param.to_local() if isinstance(param, DTensor) else param
            rows = local.shape[0] if local.dim() else 0
            if rows == 0:
                continue
            start = (
                rank * math.ceil(param.shape[0] / world_size) if isinstance(param, DTensor) else 0
            )
            if is_adapter_param(name):
                fresh = init_adapter(name, tuple(param.shape), seed)
                local.copy_(fresh[start : start + rows])
                continue
            stored = handles[files[stored_name]].get_slice(stored_name)
            local.copy_(stored[start : start + rows])


def _recreate_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Buffers (rotary inverse frequencies) are derived, not stored: a module built on the meta
    device has none, so each module owning buffers is rebuilt from its config and its buffers
    copied over."""
    for module in model.modules():
        own = dict(module.named_buffers(recurse=False))
        if not own:
            continue
        if not hasattr(module, "config"):
            raise TypeError(f"cannot rebuild the buffers of {type(module).__name__} (no config)")
        with torch.device(device):
            fresh = type(module)(module.config)
        for name, buffer in fresh.named_buffers(recurse=False):
            own[name].copy_(buffer)


def has_dropout(model: torch.nn.Module) -> bool:
    """Whether a train-mode forward of `model` applies dropout: a `Dropout` module with p > 0
    (peft's LoRA dropout, `learner.lora.dropout`) or attention dropout, which Hugging Face models
    apply in train mode only."""
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    return float(getattr(model.config, "attention_dropout", 0.0) or 0.0) > 0
