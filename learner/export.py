"""A Hugging Face model folder from the staged weights, without building another model.

The weights are written as safetensors (sharded above `max_shard_size`, with the standard index),
next to the base model's config and tokenizer, so the folder loads with `from_pretrained` and in
vLLM. Used for a checkpoint's `hf/` and for `<output_dir>/final_model`. The folder is written
under a temporary name and renamed into place, so a reader never sees half of it.
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

log = logging.getLogger(__name__)


class Exporter(Protocol):
    def export(self, weights: Iterable[tuple[str, Tensor]], out: Path) -> None: ...


class NullExporter:
    """Ranks other than 0 write no model folder."""

    def export(self, weights: Iterable[tuple[str, Tensor]], out: Path) -> None:
        pass


class HFExporter:
    """Rank 0: weights + the config and tokenizer of `model_path` (the base model)."""

    def __init__(self, model_path: str, *, max_shard_size: str = "5GB") -> None:
        self.model_path, self.max_shard_size = model_path, max_shard_size
        self._metadata: list[Any] | None = None  # config, tokenizer, generation config: read once

    def export(self, weights: Iterable[tuple[str, Tensor]], out: Path) -> None:
        out = Path(out)
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_weights(dict(weights), tmp, max_shard_size=self.max_shard_size)
        self._save_config_and_tokenizer(tmp)
        _replace(tmp, out)
        log.info("exported a Hugging Face model to %s", out)

    def _save_config_and_tokenizer(self, out: Path) -> None:
        if self._metadata is None:
            from transformers import AutoConfig, AutoTokenizer, GenerationConfig

            self._metadata = [
                AutoConfig.from_pretrained(self.model_path),
                AutoTokenizer.from_pretrained(self.model_path),
            ]
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
