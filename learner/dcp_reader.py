"""torch.distributed.checkpoint's reader, with its `.metadata` unpickled through an allow-list.

DCP writes `state/.metadata` as a pickle of plain records (its own metadata classes, torch.Size,
dtypes, layouts, paths), and its `FileSystemReader` loads it with `pickle.load`: a planted file
could name any callable (`os.system`) and have it run on the learner. The manifest check
(`learner/checkpoint.py`) refuses files that changed since the save, but not a writer who
rewrites the manifest along with them. This reader refuses, before it is even looked up, every
global a checkpoint's metadata never holds, so loading a checkpoint runs no code whatever the
files say.

Measured on this project's checkpoints (torch 2.13, FSDP2 model and AdamW state): the globals a
`.metadata` names are those of METADATA_MODULES, `torch.Size`, a dtype, `torch.serialization`'s
layout lookup and `pathlib.PosixPath`. A later torch that adds another is refused with an error
naming it, which is the safe way to find out.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from services.contracts.checkpoint_store import CheckpointRefused

METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
"""Modules whose classes (records and enums; never their functions) a `.metadata` may name."""
PLAIN_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                 ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}
"""Other globals it may name: constructors of plain values (`_get_layout` maps a name to a layout)."""


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in PLAIN_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype | torch.layout | torch.memory_format):
            return super().find_class(module, name)
        if module in METADATA_MODULES and not name.startswith("__"):
            found = super().find_class(module, name)
            if isinstance(found, type):
                return found
        raise CheckpointRefused(f"the checkpoint's metadata names {module}.{name}, which a checkpoint never holds: "
                                "refused without loading it")


class SafeMetadataReader(FileSystemReader):
    """`FileSystemReader` whose `read_metadata` unpickles through `MetadataUnpickler`; the rest of
    the method is torch 2.13's (rank-specific metadata path, storage_meta, load id)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointRefused(f"the checkpoint's metadata is a {type(metadata).__name__}, not DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
