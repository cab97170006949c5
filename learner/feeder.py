"""The prompt feeder (learner rank 0): data cursor + admission control.

Admission control (docs/algorithm.md s9, AReaL style: bound the work ahead of the learner instead of
generating freely and dropping old samples). The groups that will reach the learner from work in
flight are estimated as

    expected_kept = depth(train) + (in_flight - depth(train)) x pass_rate

and new prompts are issued only while expected_kept < (max_staleness + 1) x train_batch_groups,
so at most max_staleness + 1 batches of trainable groups are ever ahead of the learner
(`in_flight` counts the training lane only: evaluation jobs never hold training back). A hard
cap of (max_staleness + 1) x train_batch_groups x oversampling jobs in flight bounds the streams
when the pass rate is very low. Every group the gatekeeper filters lowers the estimate, and the
next `admit` replaces it, which is how a high filter rate turns into more sampling rather than a
stall. The
cursor counts issued jobs across epochs, so a resume continues exactly where it stopped.

A run with a `learner.sample_budget` issues exactly `budget_jobs` training jobs, never more: the
admission that would cross the budget is trimmed, so every run with one budget pays for the same
number of responses (the budget counts requested responses, filtered groups included, so what
the gatekeeper drops later cannot make it overshoot).
"""

from __future__ import annotations

import math
import random
import time
from typing import Any

from contracts.bus import StreamBus
from contracts.data import PromptRecord, encode_prompt
from contracts.schemas import PromptJob, encode_job


def budget_jobs(sample_budget: int | None, group_size: int) -> int | None:
    """Training jobs a `learner.sample_budget` of responses pays for: the fewest whose responses
    reach it (exactly budget / group_size when it divides); None without a budget."""
    return None if sample_budget is None else -(-sample_budget // group_size)


class PromptFeeder:
    def __init__(
        self,
        bus: StreamBus,
        records: list[PromptRecord],
        tokenizer: Any,
        *,
        run_name: str,
        limit: int,
        kept_ahead: int,
        max_prompt_len: int,
        shuffle: bool,
        seed: int,
        cursor: int = 0,
        max_jobs: int | None = None,
    ) -> None:
        if not records:
            raise ValueError("the training set is empty")
        self.bus, self.records, self.tokenizer = bus, records, tokenizer
        self.run_name, self.limit, self.max_prompt_len = run_name, limit, max_prompt_len
        self.kept_ahead = kept_ahead
        self.shuffle, self.seed = shuffle, seed
        self.cursor = cursor
        self.max_jobs = max_jobs
        """Training jobs the run may issue in all (`budget_jobs`); None = no budget."""
        self._order: list[int] = []
        self._order_epoch = -1
        self._token_cache: dict[int, list[int]] = {}

    @staticmethod
    def admission_limit(max_staleness: int, train_batch_groups: int, oversampling: float) -> int:
        """Hard cap on jobs in flight."""
        return math.ceil((max_staleness + 1) * train_batch_groups * oversampling)

    def wanted(self, *, in_flight: int, train_depth: int, pass_rate: float) -> int:
        """How many new jobs to issue now (see the module docstring)."""
        rate = min(max(pass_rate, 1e-3), 1.0)
        expected_kept = train_depth + (in_flight - train_depth) * rate
        room = self.kept_ahead - expected_kept
        if room <= 0:
            return 0
        return max(0, min(math.ceil(room / rate), self.limit - in_flight))

    def _index(self, cursor: int) -> int:
        epoch, pos = divmod(cursor, len(self.records))
        if epoch != self._order_epoch:
            self._order = list(range(len(self.records)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(self._order)
            self._order_epoch = epoch
        return self._order[pos]

    def _prompt_ids(self, index: int) -> list[int]:
        if index not in self._token_cache:
            self._token_cache[index] = encode_prompt(
                self.tokenizer, self.records[index].messages, self.max_prompt_len
            )
        return self._token_cache[index]

    def admit(self, policy_version: int) -> int:
        """Issue the prompt jobs admission control allows now; returns how many."""
        ledger = self.bus.ledger()
        rate = self.bus.pass_rate(ledger.filtered)
        n = self.wanted(
            in_flight=ledger.train_in_flight,
            train_depth=self.bus.depths()["learner"],
            pass_rate=1.0 if rate is None else rate,
        )
        if self.max_jobs is not None:  # trim the admission that reaches the sample budget
            n = min(n, self.max_jobs - self.cursor)
        if n <= 0:
            return 0
        jobs = []
        for _ in range(n):
            index = self._index(self.cursor)
            rec = self.records[index]
            job = PromptJob(
                group_id=f"{self.run_name}-{self.cursor}",
                prompt_index=index,
                prompt_ids=self._prompt_ids(index),
                ground_truth=rec.ground_truth,
                data_source=rec.data_source,
                issued_version=policy_version,
                issued_at=time.time(),
                extra_info=rec.extra_info,
            )
            jobs.append(encode_job(job))
            self.cursor += 1
        return self.bus.issue(jobs)
