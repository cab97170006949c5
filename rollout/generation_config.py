"""A model's own sampling defaults, which no engine applies.

A checkpoint's `generation_config.json` may carry sampling settings (Qwen2.5-Instruct:
temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05). transformers' `generate` and
vLLM (with its default `generation_config="auto"`) would sample with them, while the behaviour
log-prob an engine records, and the log-prob the learner recomputes, are those of
log_softmax(logits / temperature) alone (`learner/response_head.py`): the rollouts would be silently
off-policy. So only the configured `temperature` and `top_p` apply, in both engines; of the
model's generation config only its end tokens are kept (`rollout.end_tokens`: a stop condition,
not a change of distribution). `ignored_settings` names what is left out, for the start-up log.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

KEPT = frozenset(
    {
        "eos_token_id",
        "bos_token_id",
        "pad_token_id",
        "decoder_start_token_id",
        "transformers_version",
        "_from_model_config",
    }
)
"""Entries that are token ids or bookkeeping, not sampling settings."""


def ignored_settings(model_dir: str) -> dict[str, Any]:
    """Every setting of the model's `generation_config.json` that the engines do not apply
    (those that differ from transformers' defaults), by name; empty without the file."""
    from transformers import GenerationConfig

    try:
        model_config = GenerationConfig.from_pretrained(model_dir)
    except OSError:  # no generation_config.json
        return {}
    return {k: v for k, v in sorted(model_config.to_diff_dict().items()) if k not in KEPT}


def log_ignored_settings(model_dir: str) -> dict[str, Any]:
    """Log, once per engine start, what of the model's generation config does not apply."""
    ignored = ignored_settings(model_dir)
    if ignored:
        log.info(
            "%s: generation_config.json settings not applied (only the configured temperature and "
            "top_p shape sampling; the learner computes nothing else): %s",
            model_dir,
            ignored,
        )
    return ignored
