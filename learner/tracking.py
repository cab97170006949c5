"""Experiment trackers for per-step metrics: TensorBoard event files, and W&B when configured.

Metric names are the namespaced ones the learner reports (`actor/clipfrac_high`,
`gate/pass_rate`, `eval/acc`, ...), so the same names appear in Redis, /metrics and here.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from services.contracts.config import DapoConfig

log = logging.getLogger(__name__)


class Trackers:
    def __init__(self, cfg: DapoConfig) -> None:
        self.writers: list[Any] = []
        self.wandb: Any = None
        if cfg.tracking.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writers.append(SummaryWriter(log_dir=str(Path(cfg.output_dir) / "tensorboard")))
        if cfg.tracking.wandb_project:
            try:
                import wandb
            except ImportError as exc:
                raise RuntimeError("tracking.wandb_project is set but the wandb package is not installed") from exc
            self.wandb = wandb.init(project=cfg.tracking.wandb_project, name=cfg.run_name, config=cfg.model_dump(mode="json"), resume="allow")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and "/" in k}
        for writer in self.writers:
            for key, value in numeric.items():
                writer.add_scalar(key, value, step)
            writer.flush()
        if self.wandb is not None:
            self.wandb.log(numeric, step=step)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        if self.wandb is not None:
            self.wandb.finish()
