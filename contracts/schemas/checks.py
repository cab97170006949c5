"""A decoded group's numbers and sizes, checked before anyone trains on them: score lengths, finite
rewards and log-probs, token ids within range, and no group larger than the run generates."""

from __future__ import annotations

import math

from contracts.schemas.messages import RolloutGroup, ScoredGroup
from contracts.schemas.parsing import SchemaError


def check_group_lengths(group: RolloutGroup) -> None:
    if not isinstance(group, ScoredGroup):
        return
    n = len(group.responses)
    for name in ("scores", "acc", "rewards", "preds"):
        values = getattr(group, name)
        if len(values) != n:
            raise SchemaError(
                f"group {group.job.group_id}: {name} has {len(values)} entries for {n} responses"
            )


MAX_LOGPROB = 1e-4
"""Largest behaviour log-prob accepted. A sampled token's probability is at most 1 (log-prob 0);
the slack absorbs float32 rounding in an engine's log-softmax or nucleus renormalisation, which
can put a near-certain token a hair above 0. Anything larger is a broken engine."""


def check_group_values(group: RolloutGroup) -> None:
    """Rewards and scores finite, behaviour log-probs finite and <= `MAX_LOGPROB`, token ids >= 0.

    One NaN here would reach every weight through the advantages or the importance ratio. What
    this does NOT catch: finite but wrong values (a log-prob of -3 for a token sampled with
    probability 0.9), and token ids past the model's vocabulary (`check_vocabulary`).
    """
    for name in ("rewards", "scores"):
        values: list[float] = getattr(group, name, [])
        for i, value in enumerate(values):
            if not math.isfinite(value):
                raise SchemaError(f"response {i} {name[:-1]} is {value}")
    for i, response in enumerate(group.responses):
        logprobs = response.logprobs
        # sum() is NaN or infinite when any term is (float32 values cannot overflow a float64 sum),
        # so the usual case costs two C-speed passes; the loop only names the offender.
        if logprobs and not (math.isfinite(sum(logprobs)) and max(logprobs) <= MAX_LOGPROB):
            for j, value in enumerate(logprobs):
                if not math.isfinite(value):
                    raise SchemaError(f"response {i} logprob {j} is {value}")
                if value > MAX_LOGPROB:
                    raise SchemaError(
                        f"response {i} logprob {j} is {value:g}, above 0 (a log-prob is never "
                        "positive)"
                    )
    _check_token_range(group, low=0, high=None, what="token ids are never negative")


def check_vocabulary(group: RolloutGroup, vocab_size: int) -> None:
    """Every prompt and response token id is in [0, vocab_size) (the model's embedding rows).

    Checked by the learner, which knows the model: an id past the embedding is an index error on
    CPU and a device-side assert that kills the process on CUDA.
    """
    _check_token_range(
        group, low=0, high=vocab_size, what=f"outside the model's vocabulary of {vocab_size} ids"
    )


def check_sizes(
    group: RolloutGroup, *, max_prompt_tokens: int, max_response_tokens: int, max_responses: int
) -> None:
    """The group is no larger than the run could have generated: its prompt within
    `data.max_prompt_len`, each response within `rollout.max_response_len` plus what tools may
    insert, no more responses than a job asks for. Checked by the learner before it batches: a
    group planted with a million-token response would otherwise be padded into every row of a
    batch (memory the learner does not have) instead of dead-lettered."""
    where = f"group {group.job.group_id}"
    if len(group.job.prompt_ids) > max_prompt_tokens:
        raise SchemaError(
            f"{where}: a prompt of {len(group.job.prompt_ids)} tokens, over the run's "
            f"{max_prompt_tokens}"
        )
    if len(group.responses) > max_responses:
        raise SchemaError(
            f"{where}: {len(group.responses)} responses, over the {max_responses} a job asks for"
        )
    for i, r in enumerate(group.responses):
        if len(r.token_ids) > max_response_tokens:
            raise SchemaError(
                f"{where}: response {i} has {len(r.token_ids)} tokens, over the run's "
                f"{max_response_tokens}"
            )


def _check_token_range(group: RolloutGroup, *, low: int, high: int | None, what: str) -> None:
    rows = [("prompt", group.job.prompt_ids)] + [
        (f"response {i}", r.token_ids) for i, r in enumerate(group.responses)
    ]
    for where, ids in rows:
        if not ids or (min(ids) >= low and (high is None or max(ids) < high)):
            continue
        for j, token in enumerate(ids):
            if token < low or (high is not None and token >= high):
                raise SchemaError(f"{where} token {j} is id {token}, {what}")
