"""Where training batches come from: rank 0's source over the train stream, and the null
source the other ranks hold (they receive their batches from rank 0).

The stream source feeds prompts (admission control, `learner/feeder.py`) while it waits, reads
the groups the gatekeeper kept, drops groups older than `max_staleness` policy versions (counted
`stale` in the ledger), and hands out a batch once `train_batch_groups` fresh ones are in hand:
the first to arrive, or, with `max_staleness` 0, the first issued (`StreamSource.collect`).
At start it takes over groups a previous learner had read but not trained. It accounts trained
groups (a group id trained twice is counted and reported) and drains the pipeline at the end of
a completed run, so every issued job is accounted for.

A group that does not decode, or whose numbers no model could train on (NaN or infinite rewards
or log-probs, positive log-probs: checked by the schema's decode), or whose token ids fall outside
the model's vocabulary or whose prompt, responses or response count exceed what the run can
generate (checked here, where the model and the config are known), is dead-lettered with the
reason (counted `dead` in the ledger) and never reaches the trainer.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from contracts.bus import Entry, Fields, RunState, Transport
from contracts.keys import LEDGER_STALE, LEDGER_TRAINED, Counter, RunField
from contracts.runtime import StopFlag
from contracts.schemas import (
    SchemaError,
    ScoredGroup,
    check_job_signature,
    check_sizes,
    check_vocabulary,
    decode_scored_group,
    is_evaluation,
)
from contracts.signing import WeightKey
from learner.commands import Picked
from learner.feeder import PromptFeeder

log = logging.getLogger(__name__)


def issue_order(group: ScoredGroup) -> tuple[float, float]:
    """Sort key: the order in which the feeder issued the group's job. Its group id ends with the
    data cursor (`<run>-<cursor>`); an id that does not (none the feeder writes) goes after
    those that do, by issue time."""
    _, _, tail = group.job.group_id.rpartition("-")
    return (int(tail) if tail.isdigit() else math.inf), group.job.issued_at


class BatchSource(Protocol):
    @property
    def cursor(self) -> int: ...

    @property
    def jobs_issued(self) -> int:
        """Training jobs issued in the run (what a sample budget counts)."""
        ...

    def resume(self, checkpoint_cursor: int) -> None: ...

    def collect(self, policy_version: int) -> list[Picked] | None: ...

    def account(self, picked: Sequence[Picked]) -> None: ...

    def checkpoint_meta(self) -> dict[str, Any]: ...

    def reset_after_data_loss(self) -> None: ...

    def drain(self) -> None: ...


class NullSource:
    """Ranks other than 0: no data of their own (batches arrive inside `Train` commands)."""

    cursor = 0
    jobs_issued = 0

    def resume(self, checkpoint_cursor: int) -> None:
        pass

    def collect(self, policy_version: int) -> list[Picked] | None:
        return None

    def account(self, picked: Sequence[Picked]) -> None:
        pass

    def checkpoint_meta(self) -> dict[str, Any]:
        return {}

    def reset_after_data_loss(self) -> None:
        pass

    def drain(self) -> None:
        pass


class StreamSource:
    """Rank 0: prompts out through the feeder, kept groups in from the train stream."""

    def __init__(
        self,
        feeder: PromptFeeder,
        *,
        transport: Transport,
        run_state: RunState,
        batch_groups: int,
        max_staleness: int,
        max_deliveries: int,
        stop: StopFlag,
        catch_up: Callable[[], None],
        vocab_size: int,
        sizes: dict[str, int] | None = None,
        job_key: WeightKey | None = None,
        budget_s: float = 5.0,
        drain_timeout_s: float = 120.0,
    ) -> None:
        # The parts of the bus it touches: `transport` (the train stream and the ledger) and
        # `run_state` (the data cursor, the ids already trained).
        self.transport, self.run_state = transport, run_state
        self.feeder, self.stop, self.catch_up = feeder, stop, catch_up
        self.vocab_size = vocab_size
        """Rows of the model's embedding: token ids must be below it (`check_vocabulary`)."""
        self.sizes = sizes
        """The largest group the run can generate (`check_sizes`'s keywords); None: unchecked."""
        self.job_key = job_key
        """The learner's key: a group whose job it did not sign is refused (None: unchecked)."""
        self.batch_groups, self.max_staleness, self.max_deliveries = (
            batch_groups,
            max_staleness,
            max_deliveries,
        )
        self.budget_s, self.drain_timeout_s = budget_s, drain_timeout_s
        self.pending: list[Picked] = []
        # Only one learner runs at a time, so any group pending in the train stream belongs to
        # a previous incarnation that died before training it: take those over first.
        self.orphans: list[Entry] = self._take_over_pending()

    @property
    def cursor(self) -> int:
        return self.feeder.cursor

    @property
    def jobs_issued(self) -> int:
        return self.feeder.jobs_issued

    def resume(self, checkpoint_cursor: int) -> None:
        """Continue issuing after whatever was issued last. Group ids are the cursor, so going
        back would issue (and train) groups twice: take the furthest of the checkpoint's cursor,
        the one Redis recorded later, and the ledger's count of training jobs issued (which the
        same script that issues them moves, so it is never behind, even when the learner died
        between issuing and recording its cursor, or the recorded cursor is garbage)."""
        recorded = self.run_state.run_int(RunField.DATA_CURSOR)
        issued = self.transport.ledger().issued
        self.feeder.cursor = max(checkpoint_cursor, recorded, issued)
        # Without skipping every cursor position was issued, so the checkpoint's cursor also
        # bounds what a sample budget has spent when Redis lost the ledger.
        checkpoint_issued = checkpoint_cursor if self.feeder.skip is None else 0
        self.feeder.jobs_issued = max(issued, checkpoint_issued)

    # --- collecting -------------------------------------------------------------------------------
    @property
    def in_issue_order(self) -> bool:
        """Synchronous DAPO (`max_staleness` 0) trains the first-issued kept groups, as the
        reference truncates its kept groups in prompt order; the first to arrive would favour
        short responses, the rest of the round being dropped as stale after the step."""
        return self.max_staleness == 0

    def collect(self, policy_version: int) -> list[Picked] | None:
        """Gather fresh kept groups for up to `budget_s`: the full batch once it is in hand, else
        None (the loop keeps the other ranks alive meanwhile). Partial batches are kept.

        In issue order, a full hand is not enough: the batch is the `batch_groups` earliest
        issued, so it waits until no training job is in flight outside its hands (every job
        issued so far came back kept, or ended filtered, dead or stale). Only the ledger's
        counts say that, not which jobs are still out, hence the whole round. That wait ends:
        with a batch in hand admission issues nothing more (`learner/feeder.py`), so it lasts
        until the slowest response already in flight is done, the wait the synchronous
        reference has for its generation batch."""
        start = time.monotonic()
        while not self._ready() and time.monotonic() - start < self.budget_s:
            if self.stop.stopping:
                break
            self.feeder.admit(policy_version)  # records the cursor for a restart
            self._receive(policy_version)
            self.catch_up()
        if not self._ready():
            return None
        if self.in_issue_order:
            self.pending.sort(key=lambda p: issue_order(p.group))
        batch, self.pending = self.pending[: self.batch_groups], self.pending[self.batch_groups :]
        aged = [p for p in batch if self._stale(p, policy_version)]
        if aged:  # groups left over from before the last step may have aged
            self._drop([p.entry_id for p in aged])
            aged_ids = {p.entry_id for p in aged}
            self.pending = [p for p in batch if p.entry_id not in aged_ids] + self.pending
            return None
        return batch

    def _ready(self) -> bool:
        if len(self.pending) < self.batch_groups:
            return False
        # In issue order: the pending entries are the only training jobs left in the streams.
        return not self.in_issue_order or self.transport.ledger().train_in_flight <= len(
            self.pending
        )

    def _receive(self, policy_version: int) -> None:
        stage = self.transport.keys.train
        # In issue order the source keeps reading past a full hand (an earlier-issued group may
        # still come); the stream holds at most a round's jobs, which admission bounds.
        wanted = self.batch_groups if self.in_issue_order else self.batch_groups - len(self.pending)
        entries = self.orphans or self.transport.read(stage, count=wanted, block_ms=200)
        self.orphans = []
        for entry_id, fields in entries:
            try:
                picked = Picked(entry_id, self._decode(fields))
            except SchemaError as exc:
                self.transport.dead_letter(stage, entry_id, fields, f"learner: {exc}")
                continue
            if self.job_key is not None:
                try:
                    check_job_signature(picked.group, self.job_key)
                except SchemaError as exc:  # not one of our jobs: the ledger never counted it
                    self.transport.dead_letter(
                        stage, entry_id, fields, f"learner: {exc}", foreign=True
                    )
                    continue
            if self._stale(picked, policy_version):
                self._drop([entry_id])
            else:
                self.pending.append(picked)

    def _decode(self, fields: Fields) -> ScoredGroup:
        group = decode_scored_group(fields)
        check_vocabulary(group, self.vocab_size)
        if self.sizes is not None:
            check_sizes(group, **self.sizes)
        return group

    def _stale(self, picked: Picked, policy_version: int) -> bool:
        return policy_version - picked.group.policy_version > self.max_staleness

    def _drop(self, entry_ids: Sequence[str]) -> None:
        for entry_id in entry_ids:
            self.transport.hop(self.transport.keys.train, entry_id, outcome=LEDGER_STALE)

    def _take_over_pending(self) -> list[Entry]:
        taken = self.transport.reclaim(
            self.transport.keys.train,
            min_idle_s=0.0,
            max_deliveries=self.max_deliveries,
            count=100_000,
        )
        if taken:
            log.info("took over %d groups a previous learner had not trained", len(taken))
        return taken

    # --- accounting ----------------------------------------------------------------------------
    def account(self, picked: Sequence[Picked]) -> None:
        """Count trained groups in the ledger; a group id seen before is counted as a duplicate."""
        for p in picked:
            self.transport.hop(self.transport.keys.train, p.entry_id, outcome=LEDGER_TRAINED)
            if not self.run_state.mark_trained_id(p.group.job.group_id):
                self.transport.incr(Counter.TRAINED_TWICE)
                log.error("group %s was trained twice", p.group.job.group_id)

    def checkpoint_meta(self) -> dict[str, Any]:
        return {"data_cursor": self.feeder.cursor, "ledger": self.transport.ledger().as_dict()}

    def reset_after_data_loss(self) -> None:
        """Redis lost the streams: what was in hand is gone from the ledger too;
        re-record the cursor."""
        self.pending, self.orphans = [], []
        self.run_state.update_run_info({RunField.DATA_CURSOR: self.feeder.cursor})

    # --- the end of a completed run ------------------------------------------------------------
    def drain(self) -> None:
        """Stop issuing and account for every training job still in flight (counted `stale`).
        Evaluation jobs are left to run: the evaluation lane waits for them."""
        keys, deadline = self.transport.keys, time.monotonic() + self.drain_timeout_s
        self._drop(
            [p.entry_id for p in self.pending]
            + [eid for eid, _ in [*self.orphans, *self._take_over_pending()]]
        )
        self.pending, self.orphans = [], []
        drainer = self.transport.as_consumer(f"{self.transport.consumer}-drain")
        for entry_id, fields in drainer.read(
            keys.prompts, count=1_000_000, block_ms=None
        ):  # undelivered jobs
            if is_evaluation(fields):
                drainer.hand_back(keys.prompts, entry_id, fields)
            else:
                drainer.hop(keys.prompts, entry_id, outcome=LEDGER_STALE)
        while time.monotonic() < deadline:
            self._drop(
                [eid for eid, _ in self.transport.read(keys.train, count=1000, block_ms=100)]
            )
            if self.transport.ledger().train_in_flight == 0:
                break
            self.catch_up()  # a replica waiting for weights must not hold jobs forever
        ledger = self.transport.ledger()
        if ledger.train_in_flight:
            log.warning(
                "drain timed out with %d jobs in flight; stream depths %s",
                ledger.train_in_flight,
                self.transport.depths(),
            )
        log.info("drained: %s", ledger.as_dict())
