"""The checkpoint store's layout: what a committed checkpoint is, listing, retention, the manifest.

Shared by the learner (which writes checkpoints, `learner/checkpoint.py`), rollout replicas (which
catch up from the newest Hugging Face export) and the API (which lists them).

Layout under the checkpoint store (`checkpoint.dir`, default `<output_dir>/checkpoints`):

    step_<N>/
      state/          torch.distributed.checkpoint: model + optimizer shards (every rank writes)
      trainer.json    step, policy version, data cursor, ledger counters, scheduler, config
      rng/rank_<r>.safetensors   RNG states of rank r (torch CPU and CUDA tensors; python's
                      `random` state as JSON in the file's metadata): nothing in it is pickled
      hf/             safetensors + config + tokenizer: loads with from_pretrained and in vLLM
      keep            optional: retention never deletes this checkpoint
      manifest.json   SHA-256 and size of every other file (not itself, not COMMITTED)
      COMMITTED       a directory without it is never listed or loaded
    .tmp-step_<N>/    a checkpoint being written (never listed; removed at the learner's start)
    .trash-step_<N>-<token>/   a checkpoint being deleted (never listed; removed at start)
    abandoned/<time>-after-step_<K>/step_<M>/   steps newer than K, set aside by a restore of K

Atomic and durable: a checkpoint is written whole under `.tmp-step_<N>`, every file and directory
fsynced, and renamed to `step_<N>` (then the store directory is fsynced), so `step_<N>` appears
complete or not at all. A committed step is never deleted in place: retention first renames it
to `.trash-...` (one atomic step that takes it out of the listing), then deletes it; a crash
during the deletion leaves only a `.trash-` directory, never a half-deleted `step_<N>`.

The manifest (`check_listing`, `verify_files`): loading must refuse a checkpoint whose files
do not match it before anything is unpickled (torch.distributed.checkpoint's `state/.metadata`
is a pickle). It detects a tampered, truncated, partially written, missing or added file. What it
does NOT guarantee: whoever can write the store can also write a consistent manifest, so it is no
defence against a writer with full access to the store; keep the store writable only by the
learner (the Kubernetes manifests mount it read-only in every other pod). Nor does it cover a file
swapped between verification and loading. Rollout replicas check only what they read, the `hf/`
export (`verify_subtree`): a damaged file elsewhere in the step does not stop a replica, only the
learner. A checkpoint written before manifests (with a pickled `rng.pt`) is still listed, but the
learner and the replicas refuse to load it.

Retention keeps the newest `keep_last` committed checkpoints plus any marked `keep`; abandoned
steps are never deleted automatically (they use disk until an operator removes them).
What this does NOT guarantee: Redis state (queued groups) is not part of the checkpoint; on
resume, groups still in the streams are used or accounted for by the ledger, not replayed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MARKER = "COMMITTED"
KEEP = "keep"
MANIFEST = "manifest.json"
HF_EXPORT = "hf"
"""The step's Hugging Face export: what rollout replicas and `from_pretrained` load."""
ABANDONED = "abandoned"
TMP_PREFIX = ".tmp-step_"
TRASH_PREFIX = ".trash-step_"
UNHASHED = frozenset({MANIFEST, MARKER})
"""The files the manifest does not cover: itself, and the marker written after it."""
CHUNK = 8 << 20
"""Bytes read per hashing call: bounded memory for files of any size."""
HASH_THREADS = 4
"""Files hashed at once per process (hashlib releases the GIL, so threads overlap)."""
MAX_NAMED = 10
"""Problems spelled out in a refusal; the rest are counted."""


class CheckpointRefused(RuntimeError):
    """A checkpoint that must not be loaded: no manifest, files that do not match it, or
    contents no checkpoint holds (`learner/dcp_reader.py`)."""


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    committed_at: float
    keep: bool
    meta: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        """What the API shows anyone who can reach it: paths relative to the checkpoint store
        (`checkpoint_dir`), so the machine's directory layout is not part of the answer."""
        return {
            "step": self.step,
            "path": self.path.name,
            "hf_path": f"{self.path.name}/{HF_EXPORT}",
            "committed_at": self.committed_at,
            "keep": self.keep,
            "policy_version": self.meta.get("policy_version"),
            "data_cursor": self.meta.get("data_cursor"),
            "metrics": self.meta.get("metrics", {}),
        }


@dataclass(frozen=True)
class FileDigest:
    sha256: str
    size: int


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step}"


def temp_step_dir(root: Path, step: int) -> Path:
    """Where step `step` is written before it is renamed into place. Deterministic, so every
    learner rank finds it without being told; only one learner writes a store."""
    return root / f"{TMP_PREFIX}{step}"


# --- listing --------------------------------------------------------------------------------------
def _step_of(d: Path) -> int | None:
    try:
        return int(d.name.removeprefix("step_"))
    except ValueError:
        return None


def list_checkpoints(root: str | Path) -> list[CheckpointInfo]:
    """Committed checkpoints, oldest first. Half-written ones are invisible."""
    out: list[CheckpointInfo] = []
    root = Path(root)
    if not root.is_dir():
        return out
    for d in root.glob("step_*"):
        step = _step_of(d)
        try:  # a directory renamed away meanwhile (retention, a restore) is simply not listed
            committed_at = (d / MARKER).stat().st_mtime
            meta = json.loads((d / "trainer.json").read_text())
        except (OSError, ValueError):
            continue
        if step is not None:
            out.append(CheckpointInfo(step, d, committed_at, (d / KEEP).exists(), meta))
    return sorted(out, key=lambda c: c.step)


def get_checkpoint(root: str | Path, step: int) -> CheckpointInfo | None:
    return next((c for c in list_checkpoints(root) if c.step == step), None)


def latest_checkpoint(root: str | Path) -> CheckpointInfo | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


# --- durability -----------------------------------------------------------------------------------
def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's entries to stable storage (POSIX; directories included)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Write and fsync a file (its directory entry is fsynced with the directory)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_tree(path: Path) -> None:
    """fsync every directory under `path`, deepest first, then `path` itself."""
    dirs = [Path(d) for d, _, _ in os.walk(path)]
    for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        fsync_path(d)


def commit_dir(tmp: Path, final: Path) -> None:
    """Rename a fully written and fsynced `tmp` to `final` and make the rename durable.

    When `final` exists (the same step saved twice), it is first renamed aside and deleted after:
    a crash between the two renames leaves neither as `final`, so the previous checkpoint is the
    newest until the next save (the aside copy is removed at start). It is never deleted in place.
    """
    aside = _move_to_trash(final) if final.exists() else None
    tmp.rename(final)
    fsync_path(final.parent)
    if aside is not None:
        _remove(aside)


# --- deleting, cleaning, retiring -----------------------------------------------------------------
def _move_to_trash(path: Path) -> Path:
    trash = path.with_name(
        f"{TRASH_PREFIX}{path.name.removeprefix('step_')}-{secrets.token_hex(4)}"
    )
    path.rename(trash)
    fsync_path(path.parent)
    return trash


def _remove(path: Path) -> None:
    """Delete a directory already out of the listing. A failure (a file held open on a network
    filesystem, say) is logged, not raised: the checkpoints are consistent either way, and the
    next start removes what is left (`clean_stale`)."""
    try:
        shutil.rmtree(path)
    except OSError as exc:
        log.warning("could not delete %s (%s); the next start removes it", path, exc)


def discard(path: Path) -> None:
    """Delete a checkpoint directory: rename it out of the listing, then remove it."""
    _remove(_move_to_trash(path))


def apply_retention(root: str | Path, keep_last: int) -> list[int]:
    """Delete committed checkpoints beyond the newest `keep_last` (never those marked keep)."""
    found = list_checkpoints(root)
    doomed = [c for c in found[:-keep_last] if not c.keep] if keep_last > 0 else []
    for c in doomed:
        discard(c.path)
    return [c.step for c in doomed]


def clean_stale(root: str | Path) -> list[str]:
    """Remove what a crashed learner left: checkpoints half written (`.tmp-`) or half deleted
    (`.trash-`). Only the learner's rank 0 calls this, at start, before it writes anything."""
    root = Path(root)
    if not root.is_dir():
        return []
    stale = [
        d for d in root.iterdir() if d.name.startswith((TMP_PREFIX, TRASH_PREFIX)) and d.is_dir()
    ]
    for d in stale:
        _remove(d)
    return sorted(d.name for d in stale)


def retire_newer(root: str | Path, step: int) -> list[int]:
    """Move every `step_<M>` with M > `step` into `abandoned/<time>-after-step_<step>/`.

    A restore of `step` abandons the line that continued from it; left in place, its newest step
    would be the one resumed at the next restart. The steps are moved, not deleted."""
    root = Path(root)
    found = [(_step_of(d), d) for d in root.glob("step_*")]
    newer = sorted((s, d) for s, d in found if s is not None and s > step)
    if not newer:
        return []
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    dest = root / ABANDONED / f"{stamp}-after-step_{step}"
    dest.mkdir(parents=True)
    for _, d in newer:
        d.rename(dest / d.name)
    fsync_path(dest)
    fsync_path(dest.parent)
    fsync_path(root)
    return [s for s, _ in newer]


# --- the manifest ---------------------------------------------------------------------------------
def hashed_files(path: Path, under: str = "") -> tuple[dict[str, int], list[str]]:
    """(size of every regular file the manifest covers, by path relative to `path`; problems).

    `under` (a directory of the checkpoint, e.g. "hf") limits the walk to that directory; an
    absent one holds no files. A symlink or any other non-regular entry is a problem, never
    followed: the manifest speaks for the bytes inside the checkpoint directory only."""
    sizes: dict[str, int] = {}
    problems: list[str] = []
    top = path / under
    if under:  # os.walk follows a symlink given as its top: check the top itself first
        try:
            if not stat.S_ISDIR(top.lstat().st_mode):
                return sizes, [f"{under} is not a directory"]
        except FileNotFoundError:
            return sizes, problems
        except OSError as exc:
            return sizes, [f"{under} could not be listed ({exc})"]
    for d, subdirs, files in os.walk(top):
        for name in [*files, *subdirs]:
            p = Path(d) / name
            rel = p.relative_to(path).as_posix()
            try:
                st = p.lstat()
            except OSError as exc:
                problems.append(f"{rel} could not be listed ({exc})")
                continue
            if stat.S_ISLNK(st.st_mode) or not (
                stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)
            ):
                problems.append(f"{rel} is not a regular file")
            elif stat.S_ISREG(st.st_mode) and rel not in UNHASHED:
                sizes[rel] = st.st_size
    return sizes, problems


def file_digest(path: Path, *, sync: bool = False) -> FileDigest:
    """SHA-256 and size of one file, read once in CHUNK pieces; `sync` also fsyncs it."""
    h = hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            h.update(
                view[:n]
            )  # hashlib releases the GIL on large buffers: threads hash in parallel
            size += n
        if sync:
            os.fsync(f.fileno())
    return FileDigest(h.hexdigest(), size)


def assign(sizes: dict[str, int], shares: int) -> list[list[str]]:
    """Split files into `shares` lists of about equal bytes (largest first, to the lightest
    share); deterministic, so every rank computes the same split from the same sizes."""
    out: list[list[str]] = [[] for _ in range(shares)]
    load = [0] * shares
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        i = load.index(min(load))
        out[i].append(name)
        load[i] += sizes[name]
    return out


def write_manifest(path: Path, step: int, digests: dict[str, FileDigest]) -> None:
    files = {name: {"sha256": d.sha256, "size": d.size} for name, d in sorted(digests.items())}
    write_durable(
        path / MANIFEST, json.dumps({"version": 1, "step": step, "files": files}, indent=1).encode()
    )


def read_manifest(path: Path) -> tuple[dict[str, FileDigest], str]:
    """(the manifest's entries, the SHA-256 of its bytes); CheckpointRefused when it is missing or
    malformed. Parsing JSON executes nothing."""
    where = path / MANIFEST
    try:
        raw = where.read_bytes()
        doc = json.loads(raw)
        files = {
            str(name): FileDigest(str(e["sha256"]), int(e["size"]))
            for name, e in doc["files"].items()
        }
    except FileNotFoundError:
        raise CheckpointRefused(
            f"{where} is missing: the checkpoint was written before manifests or not by this "
            "learner; it cannot be verified, so it is not loaded (move it out of the store to "
            "resume from an older one)"
        ) from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointRefused(
            f"{where} is unreadable or malformed ({exc!r}); the checkpoint is not loaded"
        ) from exc
    return files, hashlib.sha256(raw).hexdigest()


def check_listing(
    path: Path, manifest: dict[str, FileDigest], under: str = ""
) -> tuple[list[str], dict[str, int]]:
    """(files missing, added, of the wrong size or not regular, against the manifest; the files
    left to hash, with their sizes). Reads no file's contents. `under` limits both sides to one
    directory of the checkpoint (the manifest's entries below it, the files found in it)."""
    if under:
        manifest = {n: d for n, d in manifest.items() if n.startswith(f"{under}/")}
    sizes, problems = hashed_files(path, under)
    problems += [
        f"{n} is listed in {MANIFEST} but missing" for n in sorted(manifest.keys() - sizes.keys())
    ]
    problems += [f"{n} is not in {MANIFEST}" for n in sorted(sizes.keys() - manifest.keys())]
    common = sorted(sizes.keys() & manifest.keys())
    problems += [
        f"{n} has {sizes[n]} bytes, {MANIFEST} says {manifest[n].size}"
        for n in common
        if sizes[n] != manifest[n].size
    ]
    return problems, {n: sizes[n] for n in common if sizes[n] == manifest[n].size}


def verify_files(
    path: Path, manifest: dict[str, FileDigest], names: Iterable[str], *, threads: int
) -> list[str]:
    """Hash `names` (in `threads` threads) and name each one whose SHA-256
    differs from the manifest."""
    from concurrent.futures import ThreadPoolExecutor

    def check(name: str) -> str | None:
        try:
            got = file_digest(path / name)
        except OSError as exc:
            return f"{name} is unreadable ({exc})"
        return None if got == manifest[name] else f"{name} does not match its SHA-256 in {MANIFEST}"

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        return [p for p in pool.map(check, names) if p is not None]


def describe_problems(problems: list[str]) -> str:
    """A refusal's problems: the first MAX_NAMED, and how many more."""
    more = f" (and {len(problems) - MAX_NAMED} more)" if len(problems) > MAX_NAMED else ""
    return "; ".join(problems[:MAX_NAMED]) + more


def verify_subtree(path: Path, under: str, *, threads: int = HASH_THREADS) -> list[str]:
    """Check only the files under `path/under` against the checkpoint's manifest, for a reader that
    loads nothing else (a rollout replica reads `hf/`): what `check_listing` and `verify_files`
    find there, in one process. CheckpointRefused when the manifest is missing or malformed.

    Cost: hashes every byte under `under` once (see `learner/checkpoint.py` for measured rates)."""
    manifest, _ = read_manifest(path)
    problems, sizes = check_listing(path, manifest, under)
    return problems + verify_files(path, manifest, sorted(sizes), threads=threads)
