"""`DapoConfig`, the root of the tree: its sections, the rules that span several of them, and the
values derived from them."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import model_validator

from contracts.config.algorithm import AlgorithmConfig
from contracts.config.base import Section
from contracts.config.data import DataConfig
from contracts.config.learner import CheckpointConfig, EvalConfig, LearnerConfig
from contracts.config.model import ModelConfig
from contracts.config.operations import REDIS_URL_ENV, ApiConfig, QueueConfig, TrackingConfig
from contracts.config.reward import RewardConfig
from contracts.config.rollout import RolloutConfig


class DapoConfig(Section):
    run_name: str = "dapo"
    output_dir: str = "runs/dapo"
    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    learner: LearnerConfig = LearnerConfig()
    eval: EvalConfig = EvalConfig()
    queue: QueueConfig = QueueConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    api: ApiConfig = ApiConfig()
    tracking: TrackingConfig = TrackingConfig()

    @model_validator(mode="after")
    def _cross_field(self) -> DapoConfig:
        alg, ro, ov = self.algorithm, self.rollout, self.reward.overlong
        if ro.group_size < 2:
            raise ValueError(
                f"rollout.group_size={ro.group_size}: group-relative advantages need >= 2 "
                "responses per prompt"
            )
        if alg.clip_high < alg.clip_low:
            raise ValueError(
                f"algorithm.clip_high={alg.clip_high} < algorithm.clip_low={alg.clip_low}: "
                "Clip-Higher needs clip_high >= clip_low"
            )
        if ov.enabled and ov.buffer_len >= ro.max_response_len:
            raise ValueError(
                f"reward.overlong.buffer_len={ov.buffer_len} must be < "
                f"rollout.max_response_len={ro.max_response_len}"
            )
        if alg.mini_batch_groups > alg.train_batch_groups:
            raise ValueError(
                f"algorithm.mini_batch_groups={alg.mini_batch_groups} > "
                f"algorithm.train_batch_groups={alg.train_batch_groups}"
            )
        if alg.train_batch_groups % alg.mini_batch_groups:
            raise ValueError(
                f"algorithm.train_batch_groups={alg.train_batch_groups} must be a multiple of "
                f"algorithm.mini_batch_groups={alg.mini_batch_groups}"
            )
        return self

    # Derived values: computed, never stored twice.
    @property
    def redis_url(self) -> str | None:
        return self.queue.redis_url or os.environ.get(REDIS_URL_ENV) or None

    def redis_url_for(self, role: str) -> str | None:
        """The URL a service of `role` connects with: `DAPO_REDIS_URL_<ROLE>` where a process
        hosts several roles' services (a Ray worker node hosts rollout and reward replicas, each
        its own Redis user), else `redis_url`."""
        return os.environ.get(f"{REDIS_URL_ENV}_{role.upper()}") or self.redis_url

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir or Path(self.output_dir) / "checkpoints")
