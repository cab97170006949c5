"""`algorithm`: DAPO's loss, dynamic sampling and admission control, and prompt skipping."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from contracts.config.base import PositiveInt, Section

LossAgg = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]


class PromptSkipConfig(Section):
    """Skip, before generating it, a prompt whose recent groups all carried no learning signal
    (GRESO, Zheng et al. 2025, "Act Only When It Pays"; docs/algorithm.md section 11).

    Each time the gatekeeper decides a prompt's group, the run's prompt history records it. A
    group without signal (zero advantage) is easy when every response was right and hard
    otherwise (all wrong); it lengthens the prompt's streak of its kind and ends the other kind's,
    and a group with signal ends both. When the feeder comes to the prompt again with a streak
    of z groups of one kind, it issues it with probability max(min_keep, p ** z), p that kind's
    base keep probability, and otherwise skips it (counted `prompts_skipped`).

    p adapts, as in GRESO's reference code: after each training step, the share of the groups
    decided during the step that were easy is compared with `easy_target`; at or above it p_easy
    steps down by `adapt_step` (skip more of them), below it up (explore more), within
    [keep_base_min, keep_base_max]; the same for hard. Not during the first data epoch, when no
    prompt has a history and nothing can be skipped, so the shares would only push p to a bound.
    The state lives in Redis with the run (run info `prompt_skip`), so a restarted learner goes on
    from it. The gatekeeper's filter stays the exact check; skipping only saves generation, and
    only for prompts seen before (several data epochs).
    """

    enabled: bool = False
    """Off reproduces the paper: every prompt is generated and dynamic sampling filters after.
    Needs `algorithm.gatekeeper` (without it skipping would be a filter of its own)."""
    easy_keep_base: float = Field(0.5, gt=0, lt=1)
    """p_easy at the start of the run (paper: 0.5): an all-right prompt is issued with
    probability p_easy ** z after z all-right groups in a row."""
    hard_keep_base: float = Field(0.75, gt=0, lt=1)
    """p_hard at the start (paper: 0.5, as easy). Higher than p_easy, so at equal streaks an
    all-wrong prompt is tried again more often: the policy improves, so it is the kind likely to
    turn informative (GRESO's reason for its higher hard target), and from the first step on."""
    easy_target: float = Field(0.25 / 3, ge=0, le=1)
    """Share of decided groups that may be easy zero-advantage ones (paper: a third of its 25%
    zero-variance budget)."""
    hard_target: float = Field(0.5 / 3, ge=0, le=1)
    """Share that may be hard ones (paper: the other two thirds): twice the easy share, which
    holds p_hard higher."""
    adapt_step: float = Field(0.01, ge=0, lt=1)
    """How far each base moves after a training step (paper: 0.01); 0 holds both where they
    started (the fixed-rate rule)."""
    keep_base_min: float = Field(0.05, gt=0, lt=1)
    """Lowest base either adapts to (paper: 0.05)."""
    keep_base_max: float = Field(0.95, gt=0, le=1)
    """Highest base either adapts to (paper: 0.95)."""
    min_keep: float = Field(0.05, gt=0, le=1)
    """The exploration floor: a prompt is issued with at least this probability however long its
    streak, so a prompt the policy has outgrown or grown into is seen again (paper: 0.01)."""

    @model_validator(mode="after")
    def _check_bases(self) -> PromptSkipConfig:
        low, high = self.keep_base_min, self.keep_base_max
        if low > high:
            raise ValueError(f"keep_base_min={low} > keep_base_max={high}")
        for name in ("easy_keep_base", "hard_keep_base"):
            if not low <= getattr(self, name) <= high:
                raise ValueError(
                    f"{name}={getattr(self, name)} is outside [keep_base_min, keep_base_max] = "
                    f"[{low}, {high}], where the base adapts: start it inside"
                )
        return self


class AlgorithmConfig(Section):
    clip_low: float = Field(0.2, gt=0, lt=1)
    """epsilon_low of the decoupled clip (paper: 0.2)."""
    clip_high: float = Field(0.28, gt=0)
    """epsilon_high, Clip-Higher (paper: 0.28)."""
    clip_c: float | None = Field(10.0, gt=1)
    """Dual-clip constant for negative advantages (reference 32B run: 10); null disables."""
    loss_agg: LossAgg = "token-mean"
    """Token-Level Policy Gradient Loss (paper: token-mean over the whole mini-batch)."""
    norm_by_std: bool = True
    """Divide group advantages by the unbiased std (GRPO/DAPO); false = Dr.GRPO."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus (paper: 0)."""
    train_batch_groups: PositiveInt = 512
    """Kept prompt groups per training step, B (paper: 512 prompts)."""
    mini_batch_groups: PositiveInt = 32
    """Groups per optimizer update (paper: 512 responses = 32 groups x 16, 16 updates/step)."""
    epochs: PositiveInt = 1
    """Passes over each training batch."""
    gatekeeper: bool = True
    """Dynamic sampling: drop groups whose metric is identical across the group."""
    gatekeeper_metric: Literal["acc", "score", "reward"] = "acc"
    """Metric the gatekeeper compares (paper: acc, not the shaped reward)."""
    oversampling: float = Field(3.0, ge=1)
    """Prompt jobs issued per needed group, bounding work in flight (reference: 3x)."""
    max_staleness: Annotated[int, Field(ge=0)] = 1
    """Admission control: at most (max_staleness + 1) train batches of work ahead of the learner.
    0 reproduces synchronous DAPO (rollout never runs ahead of the weights it was given)."""
    pass_rate_window: PositiveInt = 512
    """Admission control's pass rate is the recent one, not the run's: a moving average of the
    gatekeeper's decisions, each weighing 1/pass_rate_window, so the last pass_rate_window
    decisions carry 63% of it. The run's rate lags: after thousands of kept groups a run of
    filtered ones barely moves it, and the feeder would replace too few of them while the
    learner waits. An average rather than a window of the last N decisions: it is three numbers
    kept in Redis with the cursor, so a restarted learner goes on from it (docs/algorithm.md
    s9)."""
    is_clip: float = Field(2.0, ge=1)
    """Truncation of the behaviour importance weight pi_old / pi_behaviour
    (docs/algorithm.md s9)."""
    prompt_skip: PromptSkipConfig = PromptSkipConfig()
    """Pre-generation skipping of prompts that keep being filtered (off: the paper)."""

    @model_validator(mode="after")
    def _check_prompt_skip(self) -> AlgorithmConfig:
        # Skipping saves generating groups dynamic sampling would filter. Without the gatekeeper
        # every group is trained, and skipping would drop some of the zero-advantage ones itself.
        if self.prompt_skip.enabled and not self.gatekeeper:
            raise ValueError(
                "algorithm.prompt_skip.enabled=true needs algorithm.gatekeeper=true: skipping "
                "passes over prompts whose groups dynamic sampling would filter, so without the "
                "gatekeeper it would withhold some of the zero-advantage groups a GRPO run "
                "trains on, and the GRPO rungs of the ablation ladder (`dapo ablate`) would "
                "become partial dynamic sampling; turn prompt_skip off or the gatekeeper on"
            )
        return self
