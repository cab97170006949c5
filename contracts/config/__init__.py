"""The one configuration tree every process reads.

A run is described by one YAML file validated by this pydantic (v2) model tree; every service
(`dapo rollout`, `dapo learner`, ...) reads the same file, and command-line overrides use dotted
keys (`algorithm.clip_high=0.3`). Unknown keys are errors (`extra="forbid"`), and cross-field
rules are checked at start-up so that a bad run fails before it spends compute.

Each field is documented once, beside it in its section's module, with the DAPO paper's value
(arXiv 2503.14476, the reference 32B run; see docs/algorithm.md section 7) where there is one.

One module per section of the tree, the root last:

- `base`: the sections' base model and `ConfigError`;
- `model`, `data` (with `gym`, the reasoning-gym generator), `rollout`, `reward`, `algorithm`,
  `learner` (with `checkpoint` and `eval`), `operations` (`queue`, `api`, `tracking`);
- `tree`: `DapoConfig`, the root, and the rules that span sections;
- `loading`: reading a file and its overrides into a `DapoConfig`, and dumping one.

Everything is imported from here (`from contracts.config import DapoConfig, load_config`).
"""

from __future__ import annotations

from contracts.config.algorithm import AlgorithmConfig, LossAgg, PromptSkipConfig
from contracts.config.base import ConfigError
from contracts.config.data import DataConfig, SynthDataSpec, SynthTemplate
from contracts.config.gym import GymDataSpec, GymTaskSpec
from contracts.config.learner import (
    LORA_TARGETS_DEFAULT,
    CheckpointConfig,
    EvalConfig,
    LearnerConfig,
    LoraConfig,
)
from contracts.config.loading import build_config, dump_config, load_config, parse_override
from contracts.config.model import ModelConfig, TinyModelSpec, model_hub_id
from contracts.config.operations import (
    REDIS_URL_ENV,
    ApiConfig,
    QueueConfig,
    TrackingConfig,
    redact_url,
)
from contracts.config.reward import OverlongConfig, RewardConfig, Verifier
from contracts.config.rollout import RESULT_TAG_TOKENS, RolloutConfig, ToolsConfig, tool_name
from contracts.config.tree import DapoConfig

__all__ = [
    "LORA_TARGETS_DEFAULT",
    "REDIS_URL_ENV",
    "RESULT_TAG_TOKENS",
    "AlgorithmConfig",
    "ApiConfig",
    "CheckpointConfig",
    "ConfigError",
    "DapoConfig",
    "DataConfig",
    "EvalConfig",
    "GymDataSpec",
    "GymTaskSpec",
    "LearnerConfig",
    "LoraConfig",
    "LossAgg",
    "ModelConfig",
    "OverlongConfig",
    "PromptSkipConfig",
    "QueueConfig",
    "RewardConfig",
    "RolloutConfig",
    "SynthDataSpec",
    "SynthTemplate",
    "TinyModelSpec",
    "ToolsConfig",
    "TrackingConfig",
    "Verifier",
    "build_config",
    "dump_config",
    "load_config",
    "model_hub_id",
    "parse_override",
    "redact_url",
    "tool_name",
]
