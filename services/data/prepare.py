"""The first step of `dapo run`, and of compose's and Kubernetes' `prepare` containers: what a
run needs made before any service starts.

It writes the synthetic training and evaluation files (`data.synth`) or the reasoning-gym ones
(`data.gym`, `services.data.gym`) where they are missing, builds the tiny base model of the demo
once (from problems of its own draw, so every preset that names the same `model.path` starts
from the same base; a cached base built from other rows is refused), checks that a local model
directory exists, or downloads an `hf://` or `catalog://` model into the cache once, so that no
service downloads. The services then start from `Prepared`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contracts.config import ConfigError, DapoConfig, TinyModelSpec
from contracts.model_source import Download, with_local_model
from learner.evaluation import eval_problems

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prepared:
    """What the services start from once `prepare` ran."""

    cfg: DapoConfig
    """The run's config with `model.path` a local directory
    (a Hub model's snapshot in the cache)."""
    env: dict[str, str]
    """Environment the services get on top of this process's."""
    eval_set: dict[str, Any] | None = None
    """What the run's figures are measured on (`eval_set_summary`), read once at start."""


def prepare(cfg: DapoConfig, *, download: Download | None = None) -> Prepared:
    """Create the synthetic data and the tiny base model if the config asks for them, check that
    a local model exists, or download an `hf://` model (`contracts.model_source`;
    `download`: `huggingface_hub.snapshot_download` unless injected).

    Build progress is logged (once: the console shows this process's log lines), and so is an
    evaluation set that shares problems with the training set (`eval_set_summary`)."""
    prepare_data(cfg)
    eval_set = eval_set_summary(cfg)
    if cfg.model.hub_id is None and cfg.model.catalog_name is None:
        _local_model(cfg)
        return Prepared(cfg, {}, eval_set)
    # Every service now reads the same files from the cache; offline, none of them can start a
    # second download (or ask the Hub whether the id moved) if a library looks the id up again.
    return Prepared(with_local_model(cfg, download), {"HF_HUB_OFFLINE": "1"}, eval_set)


def eval_set_summary(cfg: DapoConfig) -> dict[str, Any] | None:
    """The evaluation set's size and whether it is held out (`learner.evaluation.eval_problems`
    logs the problems it shares with training): what the run's figures are measured on."""
    if not cfg.data.eval_path:
        return None
    problems, overlap = eval_problems(cfg)
    return {
        "problems": len(problems),
        "shared_with_training": overlap.shared,
        "dropped": overlap.dropped,
        "label": overlap.label,
    }


def _local_model(cfg: DapoConfig) -> None:
    """Build the tiny base model if the config asks for it and it is not there yet; otherwise
    the model directory must exist (a ConfigError now, not one in every service later)."""
    spec, path = cfg.model.build_tiny, Path(cfg.model.path).expanduser()
    if spec is not None and not (path / "config.json").exists():
        _build_tiny(cfg, spec)
    elif spec is not None:
        _check_tiny_base(cfg, path)
    elif not path.is_dir():
        raise ConfigError(
            f"model.path={cfg.model.path!r}: no such model directory (a Hugging Face Hub model is "
            "written hf://OWNER/NAME)"
        )


def prepare_data(cfg: DapoConfig) -> None:
    """Write the synthetic training and evaluation files (`data.synth`) where they are missing,
    or the reasoning-gym ones (`data.gym`, `services.data.gym`) where missing or out of date."""
    from contracts.data import write_rows
    from services.data.gym import prepare_gym
    from services.demo.synthetic import synth_rows

    d = cfg.data
    if d.gym is not None:
        prepare_gym(cfg)
    if d.synth is None:
        return
    if not Path(d.train_path).exists():
        write_rows(
            d.train_path,
            synth_rows(
                d.synth.num_train,
                difficulty=d.synth.difficulty,
                seed=d.seed,
                template=d.synth.template,
                tool_traces=d.synth.tool_traces,
                split="train",
            ),
        )
    if d.eval_path and not Path(d.eval_path).exists():
        write_rows(
            d.eval_path,
            synth_rows(
                d.synth.num_eval,
                difficulty=d.synth.difficulty,
                seed=d.seed + 1_000_003,
                template=d.synth.template,
                start_index=10_000_000,
                split="eval",  # no fact of any training file: held out by construction
            ),
        )


BASE_TRAIN_ROWS = 20_000
"""Problems the tiny base is warm-started on (at most)."""
BASE_SEED = 0
"""The draw of the tiny base's synthetic problems: the same base whatever `data.seed` a run has."""


def _base_train_rows(cfg: DapoConfig) -> list[dict[str, Any]]:
    """What the tiny base learns from: with `data.synth`, its own `BASE_TRAIN_ROWS` problems of
    the configured kind (tiny.yaml's training set), whatever the run trains on, so every preset
    that names the same `model.path` gets the same base (a preset over 1,000 problems once
    built a base from those 1,000, and every later run of the demo started from a weaker
    model); without it, the first `BASE_TRAIN_ROWS` rows of `data.train_path`. Drawn with
    `BASE_SEED`, not `data.seed`: seeds of a comparison (`dapo ablate --seeds 3`) vary the data
    order, never the base they all start from."""
    from contracts.data import load_prompts, parse_row
    from services.demo.synthetic import synth_rows

    d = cfg.data
    if d.synth is not None:
        rows = synth_rows(
            BASE_TRAIN_ROWS,
            difficulty=d.synth.difficulty,
            seed=BASE_SEED,
            template=d.synth.template,
            tool_traces=d.synth.tool_traces,
            split="train",  # the base never sees an evaluation fact either
        )
        return [_as_row(parse_row(r, row_number=i, source="synth")) for i, r in enumerate(rows)]
    return [_as_row(r) for r in load_prompts(d.train_path, columns=d.columns)[:BASE_TRAIN_ROWS]]


def _base_selection_rows(cfg: DapoConfig) -> list[dict[str, Any]]:
    """The problems the tiny base's warm-start checkpoint is chosen on (by measured accuracy):
    training-side problems of another draw, never the evaluation set, which must measure a base
    that was not picked by it."""
    from contracts.data import load_prompts, parse_row
    from services.demo.synthetic import synth_rows

    d = cfg.data
    if d.synth is not None:
        rows = synth_rows(
            128,
            difficulty=d.synth.difficulty,
            seed=BASE_SEED + 2_000_003,
            template=d.synth.template,
            split="train",
        )
        return [_as_row(parse_row(r, row_number=i, source="synth")) for i, r in enumerate(rows)]
    return [_as_row(r) for r in load_prompts(d.train_path, columns=d.columns)[-128:]]


def _check_tiny_base(cfg: DapoConfig, path: Path) -> None:
    """Refuse a cached tiny base that this config would not have built (other training rows):
    reusing it silently would start the run from another model than the preset says."""
    from services.demo.tiny_base import BUILD_INFO, rows_sha256

    info_path = path / BUILD_INFO
    if not info_path.exists():
        return  # a model put there by hand: the user's choice
    built = json.loads(info_path.read_text(encoding="utf-8")).get("train_sha256")
    wanted = rows_sha256(_base_train_rows(cfg))
    if built != wanted:
        raise ConfigError(
            f"model.path={cfg.model.path!r} holds a tiny base built from other training rows "
            f"than this config builds it from ({BUILD_INFO}: train_sha256 {built!r}); delete "
            "that folder to rebuild it, or set another model.path"
        )


def _build_tiny(cfg: DapoConfig, spec: TinyModelSpec) -> None:
    from services.demo.tiny_base import ensure_tiny_base

    log.info("building the tiny base model in %s (once; cached afterwards)", cfg.model.path)
    train = _base_train_rows(cfg)
    evals = _base_selection_rows(cfg)
    info = ensure_tiny_base(
        Path(cfg.model.path),
        train_rows=train,
        eval_rows=evals,
        seed=cfg.learner.seed,
        max_sft_steps=spec.sft_max_steps,
        batch_size=spec.sft_batch_size,
        lr=spec.sft_lr,
        target_acc=spec.target_acc,
        eval_every=spec.sft_eval_every,
        samples_per_problem=spec.sft_eval_samples_per_problem,
        vocab_size=spec.vocab_size,
        added_tokens=spec.added_tokens,
        max_new_tokens=cfg.rollout.max_response_len,
        model_kwargs={
            "hidden_size": spec.hidden_size,
            "num_layers": spec.num_layers,
            "num_heads": spec.num_heads,
            "num_kv_heads": spec.num_heads,
            "intermediate_size": spec.intermediate_size,
        },
    )
    log.info("tiny base model ready: %s", info)


def _as_row(rec: Any) -> dict[str, Any]:
    return {
        "data_source": rec.data_source,
        "prompt": rec.messages,
        "reward_model": {"ground_truth": rec.ground_truth, "style": "rule"},
        "extra_info": rec.extra_info,
    }
