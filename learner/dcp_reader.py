"""torch.distributed.checkpoint's reader and load planner, with nothing in a checkpoint able to
run code on the learner.

DCP writes `state/.metadata` as a pickle of plain records, and its stock reader loads it with
`pickle.load`; its stock load planner reads every non-tensor item (the optimizer's
`param_groups` values, for one) with an unrestricted `torch.load`. A planted file could name
any callable (`os.system`) and have it run. The manifest check (`learner/checkpoint.py`) refuses
files that changed since the save, but not a writer who rewrites the manifest along with them.
So here:

- `.metadata` is unpickled by `MetadataUnpickler`: only the globals in METADATA_GLOBALS (and
  torch's dtypes, layouts and memory formats) can be named, by exact module and name (no dotted
  paths into them), `getattr` only as a lookup of an allowed enum's member by name, and state
  may be set only on a fresh record (RECORD_TYPES), never on a class, a function, an enum member
  or any other object the whole process shares; and any failure to unpickle is a refusal
  (`CheckpointRefused`, exit 4), never a crash that a retry would repeat;
- every storage file the metadata points at must be a plain file name inside `state/`;
- non-tensor items are read with `torch.load(weights_only=True)` (`SafeLoadPlanner`).

Measured on this project's checkpoints (torch 2.13, FSDP2 model and AdamW state): the globals a
`.metadata` names are those below. A later torch that adds one is refused with an error naming
it, which is the safe way to find out.
"""

from __future__ import annotations

import enum
import io
import pickle
import re
import sys
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from contracts.checkpoint_store import CheckpointRefused

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
METADATA_GLOBALS = frozenset(
    {
        (_DCP_METADATA, "Metadata"),
        (_DCP_METADATA, "MetadataIndex"),
        (_DCP_METADATA, "StorageMeta"),
        (_DCP_METADATA, "TensorProperties"),
        (_DCP_METADATA, "TensorStorageMetadata"),
        (_DCP_METADATA, "ChunkStorageMetadata"),
        (_DCP_METADATA, "BytesStorageMetadata"),
        (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a name -> torch.layout lookup
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    }
)
"""Every global a checkpoint's `.metadata` may name: records, enums and plain-value constructors."""

RECORD_TYPES = frozenset(
    {
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
        ChunkStorageMetadata,
        BytesStorageMetadata,
        _StorageInfo,
        _StoragePrefix,
    }
)
"""The only types whose instances a `.metadata` may set state on (pickle's BUILD): the records
torch writes, each created by the same pickle. Anything else reachable from an allowed global
is shared by the whole process (torch's layout cache is an attribute of `_get_layout`, an enum
member is one object for everyone): state set there would outlive the load."""

_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)
_STORAGE_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
"""A DCP storage file (`__0_0.distcp`): a plain name, never a path out of `state/`."""


def _enum_member(cls: Any, name: Any) -> Any:
    """What `builtins.getattr` may do in a `.metadata`: some Python versions (the 3.11 of
    Debian 12, for one) pickle an enum member as `getattr(EnumClass, "NAME")`. Only a member,
    by name, of an enum the list allows (the class itself came through `find_class`)."""
    if (
        isinstance(cls, type)
        and issubclass(cls, enum.Enum)
        and isinstance(name, str)
        and name in cls.__members__
    ):
        return cls.__members__[name]
    raise _refuse(f"looks up {name!r} on {cls!r}")


def _refuse(what: str) -> CheckpointRefused:
    return CheckpointRefused(
        f"the checkpoint's metadata {what}, which no checkpoint written by torch does: refused "
        "without loading it"
    )


class MetadataUnpickler(pickle._Unpickler):
    """The pure-Python unpickler (its opcodes can be overridden; `.metadata` is small), limited
    to METADATA_GLOBALS and to building instances, not classes."""

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        """An allowed global, looked up in a module already loaded, never imported: a name
        cannot make the process import anything (pickle's own `find_class` would)."""
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        loaded = sys.modules.get(module)
        found = vars(loaded).get(name) if loaded is not None else None
        allowed = (module, name) in METADATA_GLOBALS or (
            module == "torch" and isinstance(found, _TORCH_CONSTANTS)
        )
        if not allowed or found is None:
            raise _refuse(f"names {module}.{name}")
        return found

    def _load_build(self) -> None:
        target = self.stack[-2]  # type: ignore[attr-defined]  # the pure-Python unpickler's
        if isinstance(target, type):
            raise _refuse(f"sets attributes on the class {target.__name__}")
        if type(target) not in RECORD_TYPES:
            raise _refuse(f"sets state on a {type(target).__name__}, which is not a DCP record")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    def load(self) -> Any:
        try:
            return super().load()
        except CheckpointRefused:
            raise
        except Exception as exc:  # truncated, malformed, or nested past the recursion limit
            raise _refuse(f"does not unpickle ({type(exc).__name__}: {exc})") from None

    dispatch[pickle.BUILD[0]] = _load_build


def _check_storage_files(metadata: Metadata) -> None:
    for info in (metadata.storage_data or {}).values():
        path = getattr(info, "relative_path", None)
        if not isinstance(path, str) or not _STORAGE_FILE.fullmatch(path) or path in (".", ".."):
            raise _refuse(f"points at the storage file {path!r}")


class SafeMetadataReader(FileSystemReader):
    """`FileSystemReader` whose `read_metadata` unpickles through `MetadataUnpickler` and checks
    the storage file names; the rest of the method is torch 2.13's (rank-specific metadata path,
    storage_meta, load id)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read: dict[Any, Metadata] = {}
        """Metadata by path: the learner reads it once before `load` (to see a refusal as
        itself) and `load` reads it again. The pure-Python unpickler reads about 7 MB/s, so a
        large model's metadata is worth reading once."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        if path not in self._read:
            with self.fs.create_stream(path, "rb") as f:
                metadata = MetadataUnpickler(f).load()
            if not isinstance(metadata, Metadata):
                raise _refuse(f"is a {type(metadata).__name__}, not DCP Metadata")
            _check_storage_files(metadata)
            self._read[path] = metadata
        metadata = self._read[path]
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` reading non-tensor items with `torch.load(weights_only=True)`
    (plain values, containers and tensors only); the rest is torch 2.13's `load_bytes`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise _refuse(
                f"holds an item {read_item.dest_index.fqn!r} that is not a plain value ({exc})"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
