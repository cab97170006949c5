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
the gatekeeper drops later cannot make it overshoot). It counts the jobs the ledger says were
issued, which a skipped prompt is not.

Prompt skipping (`algorithm.prompt_skip`, docs/algorithm.md section 11): before issuing the
prompt at the cursor, the feeder reads its record in the run's prompt history and issues it with
probability `keep_probability(streak)`; a skipped prompt only moves the cursor (it waits for its
next epoch) and is counted `prompts_skipped`. The draw is a function of the seed and the cursor
position, so a resumed run makes the same decisions from the same history.
"""

from __future__ import annotations

import math
import random
import time
from typing import Any

from contracts.bus import StreamBus
from contracts.config import PromptSkipConfig
from contracts.data import PromptRecord, encode_prompt
from contracts.keys import Counter, RunField
from contracts.schemas import PromptJob, encode_job

CANDIDATES_PER_JOB = 32
"""Prompts one admission may pass over for each job it wants, at most (more only when a whole
stretch of the data set is skipped): with the floor at 0.05 a job costs 20 candidates on
average even if every prompt had a long streak, so this bounds one admission's work without
ever holding issuing back in practice."""


def budget_jobs(sample_budget: int | None, group_size: int) -> int | None:
    """Training jobs a `learner.sample_budget` of responses pays for: the fewest whose responses
    reach it (exactly budget / group_size when it divides); None without a budget."""
    return None if sample_budget is None else -(-sample_budget // group_size)


def keep_probability(streak: int, skip: PromptSkipConfig) -> float:
    """Probability of issuing a prompt whose latest `streak` groups in a row carried no learning
    signal: keep_base ** streak, never below the exploration floor min_keep (1 with no streak)."""
    return max(skip.min_keep, skip.keep_base**streak)


def skip_draw(seed: int, cursor: int) -> float:
    """The uniform draw in [0, 1) that decides the prompt at `cursor`: the same in every process
    and on every resume (a string seed is hashed with SHA-512, not Python's salted hash)."""
    return random.Random(f"prompt-skip:{seed}:{cursor}").random()


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
        skip: PromptSkipConfig | None = None,
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
        self.skip = skip if skip is not None and skip.enabled else None
        self.jobs_issued = 0
        """Training jobs issued in the run (the ledger's count, as of the last admission)."""
        self.skipped = 0
        """Prompts this feeder passed over (the run's total is the `prompts_skipped` counter)."""
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
        """Issue the prompt jobs admission control allows now; returns how many. The cursor may
        move further than that: past the prompts skipped on the way."""
        ledger = self.bus.ledger()
        # Never back: Redis restarted without persistence counts from 0 again.
        self.jobs_issued = max(self.jobs_issued, ledger.issued)
        rate = self.bus.pass_rate(ledger.filtered)
        n = self.wanted(
            in_flight=ledger.train_in_flight,
            train_depth=self.bus.depths()["learner"],
            pass_rate=1.0 if rate is None else rate,
        )
        if self.max_jobs is not None:  # trim the admission that reaches the sample budget
            n = min(n, self.max_jobs - self.jobs_issued)
        if n <= 0:
            return 0
        jobs = [encode_job(self._job(cursor, policy_version)) for cursor in self._choose(n)]
        # Recorded before the jobs exist, for a restarted learner (`StreamSource.resume`): a
        # position recorded but never issued is only skipped, one issued twice would be trained
        # twice (the ledger's issued count no longer bounds the cursor once prompts are skipped).
        self.bus.update_run_info({RunField.DATA_CURSOR: self.cursor})
        issued = self.bus.issue(jobs) if jobs else 0
        self.jobs_issued += issued
        return issued

    def _choose(self, n: int) -> list[int]:
        """The cursor positions of the next `n` prompts to issue, moving the cursor past them
        and past the prompts skipped among them."""
        if self.skip is None:
            self.cursor += n
            return list(range(self.cursor - n, self.cursor))
        chosen: list[int] = []
        skipped, budget = 0, n * CANDIDATES_PER_JOB
        while len(chosen) < n and skipped < budget:
            window = range(self.cursor, self.cursor + 2 * (n - len(chosen)))
            history = self.bus.prompt_stats([self._index(c) for c in window])
            for cursor, stats in zip(window, history, strict=True):
                self.cursor = cursor + 1
                if skip_draw(self.seed, cursor) < keep_probability(stats.streak, self.skip):
                    chosen.append(cursor)
                    if len(chosen) == n:
                        break
                else:
                    skipped += 1
        if skipped:
            self.skipped += skipped
            self.bus.incr(Counter.PROMPTS_SKIPPED, skipped)
        return chosen

    def _job(self, cursor: int, policy_version: int) -> PromptJob:
        index = self._index(cursor)
        rec = self.records[index]
        return PromptJob(
            group_id=f"{self.run_name}-{cursor}",
            prompt_index=index,
            epoch=cursor // len(self.records),
            prompt_ids=self._prompt_ids(index),
            ground_truth=rec.ground_truth,
            data_source=rec.data_source,
            issued_version=policy_version,
            issued_at=time.time(),
            extra_info=rec.extra_info,
        )
