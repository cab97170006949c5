"""Where the run's base model lies on this machine: `model.path` as it is when it names a local
directory, or the Hugging Face cache's snapshot of an `hf://OWNER/NAME` model (at
`model.revision`), downloaded if it is not there yet, or a `catalog://NAME` model converted into
the model cache (`contracts.model_catalog`).

`dapo run` resolves the model once, before any service starts, and hands every service the local
snapshot with `HF_HUB_OFFLINE=1`, so no service downloads. A service started on its own
(`dapo learner`, `dapo rollout`, `dapo reward`, a Ray Serve replica: what docker-compose,
Kubernetes and Ray start) resolves it with the same function when it starts: the first to get
there downloads, the others find the files in the cache. Processes sharing one cache (`HF_HOME`
on a shared volume) may start at the same moment: huggingface_hub locks each file while it
writes it, so they wait for one another instead of writing the same file twice. Each still asks
the Hub once which commit the revision names, unless it runs with `HF_HUB_OFFLINE=1` and the
snapshot is already cached.

Pure module: huggingface_hub is imported only when a download is due.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from contracts.config import ConfigError, DapoConfig, ModelConfig
from contracts.model_catalog import CatalogError, fetch_catalog_model

log = logging.getLogger(__name__)

MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
"""What a Hub download fetches: config, generation config, safetensors weights and tokenizer
files. Repositories often hold the same weights again as PyTorch pickles (`*.bin`, `*.pth`) or
GGUF files; nothing here loads those (no pickles, ARCHITECTURE.md), so they are not downloaded."""

Download = Callable[..., str]
"""`huggingface_hub.snapshot_download`'s shape: keyword arguments in, the snapshot directory out."""


def fetch_model(model: ModelConfig, download: Download | None = None) -> str:
    """The local snapshot directory of an `hf://OWNER/NAME` `model.path`, downloaded into the
    Hugging Face cache (`HF_HOME`) if it is not there yet (`download`:
    `huggingface_hub.snapshot_download` unless injected).

    Raises:
        ConfigError: the path is not `hf://`, the download failed (the message says why), or
            the snapshot holds no config.json.
    """
    path, repo_id, revision = model.path, model.hub_id, model.revision
    if repo_id is None:
        raise ConfigError(f"model.path={path!r} is not an hf://OWNER/NAME model")
    download = download or _hub_download
    log.info(
        "fetching %s%s from the Hugging Face Hub into its cache (once; later reads are local)",
        repo_id,
        f"@{revision}" if revision else "",
    )
    try:
        local = str(download(repo_id=repo_id, revision=revision, allow_patterns=MODEL_FILES))
    except (OSError, ValueError) as exc:  # the Hub's errors: not found, gated, offline, network
        raise ConfigError(
            f"model.path={path!r}: downloading {repo_id} (revision {revision or 'default'}) from "
            f"the Hugging Face Hub failed ({type(exc).__name__}: {exc}). Check the id and "
            "model.revision, the network, and for a gated model HF_TOKEN"
        ) from None
    if not (Path(local) / "config.json").exists():
        raise ConfigError(
            f"model.path={path!r}: the Hub snapshot {local} has no config.json (not a "
            "transformers model)"
        )
    log.info("model %s is in %s", path, local)
    return local


def with_local_model(cfg: DapoConfig, download: Download | None = None) -> DapoConfig:
    """`cfg` with `model.path` a local directory: the same config for a local path, else one
    whose path is the snapshot `fetch_model` returns, or the converted directory of a
    `catalog://` model (`model_catalog.fetch_catalog_model`): what every model loader then
    reads."""
    if cfg.model.catalog_name is not None:
        try:
            local = str(fetch_catalog_model(cfg.model.catalog_name))
        except CatalogError as exc:
            raise ConfigError(f"model.path={cfg.model.path!r}: {exc}") from None
    elif cfg.model.hub_id is not None:
        local = fetch_model(cfg.model, download)
    else:
        return cfg
    model = cfg.model.model_copy(update={"path": local})
    return cfg.model_copy(update={"model": model})


def _hub_download(**kwargs: Any) -> str:
    from huggingface_hub import snapshot_download

    return str(snapshot_download(**kwargs))
