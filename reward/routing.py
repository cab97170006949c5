"""Which verifier scores a row, and a scorer that sends each row to it (issue 42).

A file may mix sources (verl's parquet selects its scorer by each row's `data_source`), and a
reasoning-gym mixture needs each row scored by its own task. The rule, `verifier_for`, is the one
`dapo data inspect` reports too:

1. `reward.function`, when set, scores every row;
2. else the row's `data_source` in `reward.verifier_by_source`;
3. else a row generated from reasoning-gym (its `extra_info` carries the task's entry) gets
   "reasoning-gym";
4. else `reward.verifier`.

`RoutedScorer` holds one scorer per verifier. Those the config names are started with it, so one
that cannot start stops the service at start; one first needed by a row the config did not
announce (a reasoning-gym file given as `data.train_path` without `data.gym`) is started then,
and if it cannot start, those rows score [ERROR] with the reason and the service carries on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Final

from contracts.config import RewardConfig
from contracts.tasks import GYM_ENTRY_KEY
from reward.result import VerifyResult, error_result
from reward.sandbox_pool import WorkerStartError
from reward.verifiers import Scorer, canonical_verifier

log = logging.getLogger(__name__)

FUNCTION: Final = "reward.function"
"""What `verifier_for` names when `reward.function` scores every row."""
GYM: Final = "reasoning-gym"


def verifier_for(rw: RewardConfig, data_source: str, extra_info: Mapping[str, Any]) -> str:
    """The verifier that scores a row (module docstring): a canonical verifier name, or
    `FUNCTION`."""
    if rw.function is not None:
        return FUNCTION
    if data_source in rw.verifier_by_source:
        return canonical_verifier(rw.verifier_by_source[data_source])
    if GYM_ENTRY_KEY in extra_info:
        return GYM
    return canonical_verifier(rw.verifier)


def announced_verifiers(rw: RewardConfig, *, gym: bool) -> list[str]:
    """The verifiers a run's config says it uses (`gym`: its data comes from `data.gym`)."""
    names = [canonical_verifier(rw.verifier)]
    names += [canonical_verifier(v) for v in rw.verifier_by_source.values()]
    return list(dict.fromkeys([*names, *([GYM] if gym else [])]))


class RoutedScorer:
    """A `Scorer` that scores each row with `verifier_for`'s verifier (not for
    `reward.function`, which scores every row itself)."""

    def __init__(
        self, rw: RewardConfig, make: Callable[[str], Scorer], *, start: Iterable[str]
    ) -> None:
        """`make(name)` builds a verifier's scorer; `start`: those built now (their start
        errors propagate, after the ones already built are closed)."""
        self.rw, self._make = rw, make
        self.scorers: dict[str, Scorer] = {}
        self.unavailable: dict[str, str] = {}
        """Verifiers that could not start when a row first needed them, with the reason."""
        try:
            for name in start:
                self.scorers[name] = make(name)
        except BaseException:
            self.close()
            raise

    def score_many(
        self,
        pairs: Sequence[tuple[str, str | int]],
        extra_info: Sequence[Mapping[str, Any]] | None = None,
        sources: Sequence[str] | None = None,
    ) -> list[VerifyResult]:
        """Score each pair with its row's verifier; results in input order."""
        infos: Sequence[Mapping[str, Any]] = extra_info or [{}] * len(pairs)
        names = [
            verifier_for(self.rw, sources[i] if sources is not None else "", infos[i])
            for i in range(len(pairs))
        ]
        out: dict[int, VerifyResult] = {}
        for name in dict.fromkeys(names):
            rows = [i for i, n in enumerate(names) if n == name]
            out |= dict(zip(rows, self._score(name, rows, pairs, infos), strict=True))
        return [out[i] for i in range(len(pairs))]

    def _score(
        self,
        name: str,
        rows: list[int],
        pairs: Sequence[tuple[str, str | int]],
        infos: Sequence[Mapping[str, Any]],
    ) -> list[VerifyResult]:
        scorer = self._scorer(name)
        if scorer is None:
            return [error_result(self.unavailable[name])] * len(rows)
        return scorer.score_many([pairs[i] for i in rows], [infos[i] for i in rows])

    def _scorer(self, name: str) -> Scorer | None:
        if name not in self.scorers and name not in self.unavailable:
            try:
                self.scorers[name] = self._make(name)
            except WorkerStartError as exc:
                self.unavailable[name] = f"the {name} verifier could not start: {exc}"[:500]
                log.error("%s", self.unavailable[name])
        return self.scorers.get(name)

    def close(self) -> None:
        for scorer in self.scorers.values():
            scorer.close()

    def __enter__(self) -> RoutedScorer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
