"""What is held out: the distinct problems of an evaluation set, and which of them the training set
also holds (`data.heldout_key`, `data.drop_eval_overlap`), so a figure measured on them is
labelled held-out or in-distribution (STYLE.md). Reads sets through `contracts.data`."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from contracts.data import ColumnMap, DataError, PromptRecord, load_prompts, parse_hub_id

logger = logging.getLogger(__name__)


def distinct_problems(records: Iterable[PromptRecord]) -> list[PromptRecord]:
    """The records with duplicate problems merged (same messages and ground truth), first
    occurrence kept, order kept. AIME-style eval files repeat each problem (e.g. 32 times for
    avg@32); evaluation samples k responses per distinct problem instead, which gives the same
    expected avg@k for a fraction of the prompt tokens."""
    seen: set[tuple[str, str]] = set()
    out = []
    for rec in records:
        key = (json.dumps(rec.messages, sort_keys=True), rec.ground_truth)
        if key not in seen:
            seen.add(key)
            out.append(rec)
    return out


def load_eval_problems(
    path: str | Path, max_problems: int | None = None, *, columns: ColumnMap | None = None
) -> list[PromptRecord]:
    """The distinct problems of an eval set (see `distinct_problems`), the first `max_problems`."""
    records = load_prompts(path, columns=columns)
    problems = distinct_problems(records)
    if len(problems) < len(records):
        logger.info(
            "%s: %d rows hold %d distinct problems; duplicates merged",
            path,
            len(records),
            len(problems),
        )
    return problems[:max_problems]


@dataclass(frozen=True)
class Overlap:
    """How much of an evaluation set the training set holds (`held_out_problems`)."""

    problems: int
    """Distinct evaluation problems looked at."""
    shared: int
    """Of them, those whose key (`problem_key`) a training row also has."""
    dropped: bool
    """Whether the shared ones were left out of the evaluation set."""

    @property
    def label(self) -> str:
        """How a figure measured on the set must be described (STYLE.md: held-out or
        in-distribution)."""
        if self.shared == 0 or self.dropped:
            return "held-out"
        return f"in-distribution ({self.shared} of {self.problems} problems also in training)"


def problem_key(record: PromptRecord, key: str | None) -> str:
    """What makes two rows the same problem for the held-out check: the prompt as the model sees
    it (None), or the value of an `extra_info` field (`data.heldout_key`: a fact, an id)."""
    if key is None:
        return json.dumps(record.messages, sort_keys=True)
    if key not in record.extra_info:
        raise DataError(
            f"row {record.index}: no {key!r} for data.heldout_key (list it in data.extra_keys)"
        )
    return json.dumps(record.extra_info[key], sort_keys=True)


def held_out_problems(
    eval_path: str | Path,
    train_path: str | Path | None,
    *,
    max_problems: int | None = None,
    columns: ColumnMap | None = None,
    key: str | None = None,
    drop: bool = False,
) -> tuple[list[PromptRecord], Overlap]:
    """The distinct problems of an evaluation set (`load_eval_problems`) and how many of them the
    training set also holds, compared by `problem_key`; with `drop`, without those. The first
    `max_problems` are taken after dropping. Without a readable training set (`dapo eval` on a
    machine that has only the evaluation file) nothing is compared."""
    problems = load_eval_problems(eval_path, None, columns=columns)
    if train_path is None or not (parse_hub_id(str(train_path)) or Path(train_path).exists()):
        return problems[:max_problems], Overlap(len(problems), 0, False)
    seen = {problem_key(r, key) for r in load_prompts(train_path, columns=columns)}
    shared = [problem_key(p, key) in seen for p in problems]
    if drop:
        problems = [p for p, s in zip(problems, shared, strict=True) if not s]
    kept = problems[:max_problems]
    counted = shared[: len(kept)] if not drop else shared
    overlap = Overlap(len(kept) if not drop else len(shared), sum(counted), drop)
    if overlap.shared:
        logger.warning(
            "%s: %d of %d evaluation problems are also in the training set %s (by %s)%s",
            eval_path,
            overlap.shared,
            overlap.problems,
            train_path,
            key or "prompt",
            "; left out (data.drop_eval_overlap)"
            if drop
            else "; their figure is in-distribution, not held-out (data.drop_eval_overlap=true "
            "leaves them out)",
        )
    return kept, overlap
