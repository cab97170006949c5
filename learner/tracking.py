"""Experiment trackers for per-step metrics: TensorBoard event files, and W&B when configured.

Metric names are the namespaced ones the learner reports (`actor/clipfrac_high`,
`gate/pass_rate`, `eval/acc`, ...), so the same names appear in Redis, /metrics and here.
Samples of completions go under `rollout/completions`: a markdown table in TensorBoard's Text
tab, a table in W&B.
"""

from __future__ import annotations

import html
import logging
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from contracts.config import DapoConfig

log = logging.getLogger(__name__)

COMPLETIONS_TAG = "rollout/completions"
MAX_CELL_CHARS = 2000
"""A table cell keeps this many characters of a prompt or response (then `…`): a 20k-token
response would make the Text tab unreadable and the event file large. W&B gets the whole text."""
_MARKDOWN = re.compile(r"([\\`*_\[\]|#$])")


@dataclass(frozen=True)
class Completion:
    """One sampled response as the trackers show it."""

    prompt: str
    response: str
    reward: float
    acc: bool | None
    finish_reason: str


def markdown_table(completions: list[Completion]) -> str:
    """The completions as a markdown table, their text shown literally: HTML and markdown
    characters escaped, line breaks kept, each cell cut at MAX_CELL_CHARS."""
    rows = ["| prompt | response | reward | acc | finish |", "|---|---|---|---|---|"]
    for c in completions:
        acc = "-" if c.acc is None else str(c.acc).lower()
        rows.append(
            f"| {_cell(c.prompt)} | {_cell(c.response)} | {c.reward:.3f} | {acc} | "
            f"{c.finish_reason} |"
        )
    return "\n".join(rows)


def _cell(text: str) -> str:
    if len(text) > MAX_CELL_CHARS:
        text = text[:MAX_CELL_CHARS] + "…"
    escaped = _MARKDOWN.sub(r"\\\1", html.escape(text, quote=False))
    return escaped.replace("\r\n", "\n").replace("\n", "<br>")


class Tracker(Protocol):
    """What the reporter writes to (`Trackers`, or a test's recorder)."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def log_completions(self, step: int, completions: list[Completion]) -> None: ...

    def close(self) -> None: ...


WANDB_RUN_ID_FILE = "wandb-run-id"
_WANDB_RUN_ID = re.compile(r"[a-z0-9]{1,64}")


def wandb_run_id(checkpoint_dir: Path) -> str:
    """The run's W&B id, kept beside its checkpoints: a restarted or resumed learner logs into
    the same W&B run (W&B needs the id to resume; `resume="allow"` alone starts a new one), and a
    fresh run, whose launcher sets the earlier checkpoints aside with this file, gets a new one.
    Steps a restored learner repeats are below what W&B has seen: it drops those rows, with a
    warning, and the run continues from the first new step."""
    path = checkpoint_dir / WANDB_RUN_ID_FILE
    try:
        kept = path.read_text().strip()
    except OSError:
        kept = ""
    if _WANDB_RUN_ID.fullmatch(kept):
        return kept
    run_id = secrets.token_hex(8)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(
        f".{WANDB_RUN_ID_FILE}.{run_id}"
    )  # a crash mid-write leaves no torn id
    with partial.open("w") as f:
        f.write(run_id + "\n")
        f.flush()
        os.fsync(f.fileno())
    partial.replace(path)
    return run_id


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
                raise RuntimeError(
                    "tracking.wandb_project is set but the wandb package is not installed "
                    "(pip install '.[wandb]')"
                ) from exc
            self.wandb = wandb.init(
                project=cfg.tracking.wandb_project,
                name=cfg.run_name,
                config=cfg.model_dump(mode="json"),
                id=wandb_run_id(cfg.checkpoint_dir),
                resume="allow",
            )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        numeric = {
            k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and "/" in k
        }
        for writer in self.writers:
            for key, value in numeric.items():
                writer.add_scalar(key, value, step)
            writer.flush()
        if self.wandb is not None:
            self.wandb.log(numeric, step=step)

    def log_completions(self, step: int, completions: list[Completion]) -> None:
        """A sample of the step's completions (prompt, response, reward)."""
        if not completions:
            return
        table = markdown_table(completions)
        for writer in self.writers:
            writer.add_text(COMPLETIONS_TAG, table, step)
            writer.flush()
        if self.wandb is not None:
            import wandb

            columns = ["prompt", "response", "reward", "acc", "finish"]
            data = [[c.prompt, c.response, c.reward, c.acc, c.finish_reason] for c in completions]
            self.wandb.log({COMPLETIONS_TAG: wandb.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        if self.wandb is not None:
            self.wandb.finish()
