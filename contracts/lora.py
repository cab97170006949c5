"""Low-rank adapters on the wire and on disk: what the learner, the replicas and the exports
agree on when `learner.lora` is on.

In a model, `peft.inject_adapter_in_model` replaces each targeted `nn.Linear` by a LoRA layer
whose base weight moves to `<module>.base_layer.weight` and whose adapters are
`<module>.lora_A.default.weight` (rank x in) and `<module>.lora_B.default.weight` (out x rank);
the layer computes base(x) + B(A(dropout(x))) * alpha / rank. The learner and the transformers
engine inject the same adapters into the same model, so a weight sync sends those in-model
names and each side copies them by name.

On disk an adapter is a `peft` folder: `adapter_config.json` and `adapter_model.safetensors`
with peft's key names (`base_model.model.<module>.lora_A.weight`, no adapter name). That is what
`PeftModel.from_pretrained` and vLLM's `LoRARequest` load, what a checkpoint's `hf/` holds, and
what a replica catching up from the store reads.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from contracts.config import LoraConfig as LoraSettings

ADAPTER_NAME = "default"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
BASE_LAYER = ".base_layer"


def peft_config(settings: LoraSettings) -> Any:
    """The `peft.LoraConfig` of `learner.lora`."""
    from peft import LoraConfig

    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        bias="none",
    )


def inject_adapters(model: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """Add `learner.lora`'s adapters to `model` in place and freeze everything else. The
    adapters start as peft starts them: A Kaiming-uniform, B zero (the model is unchanged)."""
    from peft import inject_adapter_in_model

    model = inject_adapter_in_model(peft_config(settings), model, adapter_name=ADAPTER_NAME)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_param(name))
    if not any(is_adapter_param(n) for n, _ in model.named_parameters()):
        raise ValueError(
            f"learner.lora.target_modules {list(settings.target_modules)} matched no module"
        )
    return model


def is_adapter_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str:
    """The base checkpoint's name of a parameter in an adapted model (`q_proj.base_layer.weight`
    is the base file's `q_proj.weight`)."""
    return name.replace(BASE_LAYER, "")


def init_adapter(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A fresh adapter tensor, the same on every rank and every run with this seed: A as peft's
    Kaiming-uniform (a = sqrt(5)), B zero, so the adapted model starts equal to the base."""
    if ".lora_B." in name:
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + _stable_hash(name))
    bound = 1.0 / math.sqrt(shape[1])  # kaiming_uniform_ with a = sqrt(5): sqrt(6 / 6 fan_in)
    return (torch.rand(shape, generator=generator) * 2 - 1) * bound


def _stable_hash(text: str) -> int:
    import hashlib

    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")


def to_peft_key(name: str) -> str:
    """In-model name -> peft file key: `model.layers.0.q_proj.lora_A.default.weight` ->
    `base_model.model.model.layers.0.q_proj.lora_A.weight`."""
    return PEFT_PREFIX + name.replace(f".{ADAPTER_NAME}.", ".")


def from_peft_key(key: str) -> str:
    if not key.startswith(PEFT_PREFIX):
        raise ValueError(f"not a peft adapter key: {key!r}")
    stem = key.removeprefix(PEFT_PREFIX)
    for part in (".lora_A.", ".lora_B."):
        if part in stem:
            return stem.replace(part, f"{part}{ADAPTER_NAME}.")
    raise ValueError(f"not a LoRA adapter tensor: {key!r}")


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_config_dict(settings: LoraSettings, base_model: str) -> dict[str, Any]:
    """`adapter_config.json`'s content: peft's own serialisation, so peft and vLLM read it."""
    config = peft_config(settings)
    config.base_model_name_or_path = str(base_model)
    data: dict[str, Any] = config.to_dict()
    data["target_modules"] = sorted(settings.target_modules)
    plain: dict[str, Any] = json.loads(json.dumps(data, default=_jsonable))
    return plain


def _jsonable(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        return sorted(value)
    return str(value)


def write_adapter(
    out: Path, tensors: dict[str, torch.Tensor], settings: LoraSettings, base_model: str
) -> None:
    """Write a peft adapter folder from in-model adapter tensors (into `out`, which exists)."""
    from safetensors.torch import save_file

    weights = {
        to_peft_key(n): t.detach().to("cpu").contiguous().clone() for n, t in tensors.items()
    }
    save_file(weights, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = adapter_config_dict(settings, base_model)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))


def read_adapter(path: str | Path) -> dict[str, torch.Tensor]:
    """In-model name -> tensor of a peft adapter folder."""
    from safetensors.torch import load_file

    folder = Path(path)
    weights = folder / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(f"{folder}: no {ADAPTER_WEIGHTS}")
    return {from_peft_key(k): t for k, t in load_file(str(weights)).items()}


def read_adapter_config(path: str | Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((Path(path) / ADAPTER_CONFIG).read_text())
    return data
