"""A Hugging Face model folder from the staged weights, without building another model.

The weights are written as safetensors (sharded above `max_shard_size`, with the standard index),
next to the base model's config and tokenizer, so the folder loads with `from_pretrained` and in
vLLM. Used for a checkpoint's `hf/` and for `<output_dir>/final_model`. The folder is written
under a temporary name and renamed into place, so a reader never sees half of it.

With LoRA (`learner.lora`) the staged weights are the adapters alone, and the folder is a `peft`
adapter (`contracts.lora.write_adapter`) with the base model's tokenizer: `PeftModel`, vLLM's
`LoRARequest`, `dapo eval` and a replica catching up from the store load it on top of the base.
`merge_adapter` writes the merged model on request (`dapo lora merge`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from contracts.config import LoraConfig as LoraSettings
from contracts.lora import read_adapter_config, write_adapter

log = logging.getLogger(__name__)


class Exporter(Protocol):
    def export(self, weights: Iterable[tuple[str, Tensor]], out: Path) -> None: ...


class NullExporter:
    """Ranks other than 0 write no model folder."""

    def export(self, weights: Iterable[tuple[str, Tensor]], out: Path) -> None:
        pass


class HFExporter:
    """Rank 0: weights + the config and tokenizer of `model_path` (the base model)."""

    def __init__(
        self, model_path: str, *, max_shard_size: str = "5GB", lora: LoraSettings | None = None
    ) -> None:
        self.model_path, self.max_shard_size, self.lora = model_path, max_shard_size, lora
        self._metadata: list[Any] | None = None  # config, tokenizer, generation config: read once

    def export(self, weights: Iterable[tuple[str, Tensor]], out: Path) -> None:
        out = Path(out)
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if self.lora is not None:
            write_adapter(tmp, dict(weights), self.lora, base_model=self.model_path)
        else:
            save_weights(dict(weights), tmp, max_shard_size=self.max_shard_size)
        self._save_config_and_tokenizer(tmp)
        _replace(tmp, out)
        what = "a LoRA adapter" if self.lora is not None else "a Hugging Face model"
        log.info("exported %s to %s", what, out)

    def _save_config_and_tokenizer(self, out: Path) -> None:
        if self._metadata is None:
            from transformers import AutoConfig, AutoTokenizer, GenerationConfig

            self._metadata = [AutoTokenizer.from_pretrained(self.model_path)]
            if self.lora is None:  # an adapter folder takes its model config from the base
                self._metadata.append(AutoConfig.from_pretrained(self.model_path))
            with contextlib.suppress(OSError):  # the base model may have none
                self._metadata.append(GenerationConfig.from_pretrained(self.model_path))
        for item in self._metadata:
            item.save_pretrained(out)


def save_weights(state: dict[str, Tensor], out: Path, *, max_shard_size: str = "5GB") -> None:
    """`model.safetensors`, or shards plus `model.safetensors.index.json` above max_shard_size.

    This is `huggingface_hub.save_torch_state_dict` one shard at a time: the staged weights are
    views into flat broadcast buckets, which that function refuses (it will not save part of a
    storage), so each shard's tensors are copied just before writing it; the extra memory is one
    shard, never the model.
    """
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    # Planned on shapes alone: the planner keeps tensors that share a storage in one file, and
    # here every tensor of a bucket does.
    shapes = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in state.items()}
    split = split_torch_state_dict_into_shards(shapes, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file(
            {n: _own_storage(state[n]) for n in names},
            str(out / filename),
            metadata={"format": "pt"},
        )
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _own_storage(t: Tensor) -> Tensor:
    """The tensor itself when it spans its whole storage, else a compact copy."""
    t = t.detach().cpu()
    whole = (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )
    return t if whole else t.clone()


def _replace(tmp: Path, out: Path) -> None:
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def merge_adapter(adapter_dir: Path, out: Path, *, base_model: str | None = None) -> Path:
    """Write the Hugging Face model `base + adapter` (peft's `merge_and_unload`) to `out`.

    `base_model`: the base model's folder; default the one the adapter names."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = base_model or read_adapter_config(adapter_dir)["base_model_name_or_path"]
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(base).save_pretrained(tmp)
    with contextlib.suppress(OSError):
        from transformers import GenerationConfig

        GenerationConfig.from_pretrained(base).save_pretrained(tmp)
    _replace(tmp, out)
    log.info("merged %s into %s: %s", adapter_dir, base, out)
    return out
