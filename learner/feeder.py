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
stall. The pass rate is the recent one (`RecentPassRate`, `algorithm.pass_rate_window`): the
run's own would hardly move when the policy outgrows its prompts late in a run, and the feeder
would keep expecting groups the gatekeeper no longer keeps. The cursor counts issued jobs across
epochs, so a resume continues exactly where it stopped.

A run with a `learner.sample_budget` issues exactly `budget_jobs` training jobs, never more: the
admission that would cross the budget is trimmed, so every run with one budget pays for the same
number of responses (the budget counts requested responses, filtered groups included, so what
the gatekeeper drops later cannot make it overshoot). It counts the jobs the ledger says were
issued, which a skipped prompt is not.

Prompt skipping (`algorithm.prompt_skip`, docs/algorithm.md section 11, `learner/prompt_skip.py`):
before issuing the prompt at the cursor, the feeder reads its record in the run's prompt history
and issues it with probability `keep_probability` of its easy or hard streak; a skipped prompt
only moves the cursor (it waits for its next epoch) and is counted `prompts_skipped`. The draw is
a function of the seed and the cursor position, so a resumed run makes the same decisions from
the same history and state. At each new policy version the feeder adapts the easy and hard keep
probabilities to the groups decided since the last one, and keeps them in the run info.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from contracts.bus import PromptHistory, RunState, Telemetry, Transport, pass_rate
from contracts.config import PromptSkipConfig
from contracts.data import PromptRecord, encode_prompt
from contracts.keys import Counter, RunField
from contracts.schemas import PromptJob, encode_job
from contracts.signing import SigningKey
from learner.prompt_skip import Decided, SkipState, keep_probability

T = TypeVar("T")

CANDIDATES_PER_JOB = 32
"""Prompts one admission may pass over for each job it wants, at most (more only when a whole
stretch of the data set is skipped): with the floor at 0.05 a job costs 20 candidates on
average even if every prompt had a long streak, so this bounds one admission's work without
ever holding issuing back in practice."""


def budget_jobs(sample_budget: int | None, group_size: int) -> int | None:
    """Training jobs a `learner.sample_budget` of responses pays for: the fewest whose responses
    reach it (exactly budget / group_size when it divides); None without a budget."""
    return None if sample_budget is None else -(-sample_budget // group_size)


@dataclass(frozen=True)
class RecentPassRate:
    """The gatekeeper's recent pass rate: a moving average over its decisions, each weighing
    1/window (`algorithm.pass_rate_window`), and the run's counts it has taken in so far."""

    rate: float | None = None
    """None before the first decision."""
    kept: int = 0
    filtered: int = 0

    def update(self, kept: int, filtered: int, window: int | None) -> RecentPassRate:
        """Take in the decisions made since the last update (`kept`, `filtered`: the run's
        counts). While the run has made at most `window` decisions (always, with no window),
        and when there is nothing to go on from (a learner restarted without the stored average,
        counts that went back after Redis lost its data), the rate is the run's own."""
        new_kept, new_filtered = kept - self.kept, filtered - self.filtered
        went_back = min(new_kept, new_filtered) < 0
        if window is None or kept + filtered <= window or self.rate is None or went_back:
            return RecentPassRate(pass_rate(kept, filtered), kept, filtered)
        n = new_kept + new_filtered
        if n == 0:
            return self
        # The n decisions came between two reads in an unknown order: they are taken in as one
        # block, with the weight n single updates would have given them together.
        decay = (1 - 1 / window) ** n
        return RecentPassRate(decay * self.rate + (1 - decay) * new_kept / n, kept, filtered)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RecentPassRate:
        """Raises ValueError (or TypeError, KeyError) on anything `to_json` did not write."""
        raw = json.loads(text)
        rate = None if raw["rate"] is None else float(raw["rate"])
        if rate is not None and not 0 <= rate <= 1:
            raise ValueError(f"a pass rate of {rate}")
        return cls(rate, int(raw["kept"]), int(raw["filtered"]))


def skip_draw(seed: int, cursor: int) -> float:
    """The uniform draw in [0, 1) that decides the prompt at `cursor`: the same in every process
    and on every resume (a string seed is hashed with SHA-512, not Python's salted hash)."""
    return random.Random(f"prompt-skip:{seed}:{cursor}").random()


class PromptFeeder:
    def __init__(
        self,
        records: list[PromptRecord],
        tokenizer: Any,
        *,
        transport: Transport,
        run_state: RunState,
        telemetry: Telemetry,
        prompt_history: PromptHistory,
        run_name: str,
        limit: int,
        kept_ahead: int,
        max_prompt_len: int,
        shuffle: bool,
        seed: int,
        cursor: int = 0,
        max_jobs: int | None = None,
        skip: PromptSkipConfig | None = None,
        pass_rate_window: int | None = None,
        chat: bool = True,
        job_key: SigningKey | None = None,
    ) -> None:
        if not records:
            raise ValueError("the training set is empty")
        # The parts of the bus it touches: `transport` (jobs out, the ledger it admits by),
        # `run_state` (its cursor and skipping state), `telemetry` (counters) and
        # `prompt_history` (how each prompt fared, to skip the ones that will be filtered).
        self.transport, self.run_state = transport, run_state
        self.telemetry, self.prompt_history = telemetry, prompt_history
        self.records, self.tokenizer = records, tokenizer
        self.run_name, self.limit, self.max_prompt_len = run_name, limit, max_prompt_len
        self.chat = chat  # `data.prompt_format`: through the chat template, or the text as it is
        self.job_key = job_key  # the learner's: signs every job (`PromptJob.sig`); None: unsigned
        self.kept_ahead = kept_ahead
        self.shuffle, self.seed = shuffle, seed
        self.cursor = cursor
        self.max_jobs = max_jobs
        """Training jobs the run may issue in all (`budget_jobs`); None = no budget."""
        self.skip = skip if skip is not None and skip.enabled else None
        self.pass_rate_window = pass_rate_window
        """Decisions the recent pass rate averages over (`RecentPassRate`); None: the run's."""
        self.recent: RecentPassRate | None = None
        """As of the last admission; read from the run info at the first."""
        self.skip_state: SkipState | None = None
        """Prompt skipping's adapted keep probabilities; read from the run info at the first
        admission."""
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
                self.tokenizer, self.records[index].messages, self.max_prompt_len, chat=self.chat
            )
        return self._token_cache[index]

    def admit(self, policy_version: int) -> int:
        """Issue the prompt jobs admission control allows now; returns how many. The cursor may
        move further than that: past the prompts skipped on the way."""
        ledger, counters = self.transport.ledger(), self.telemetry.counters()
        # Never back: Redis restarted without persistence counts from 0 again.
        self.jobs_issued = max(self.jobs_issued, ledger.issued)
        kept = counters.get(Counter.GATEKEEPER_KEPT, 0)
        self.recent = recent = self._recent().update(kept, ledger.filtered, self.pass_rate_window)
        if self.skip is not None:
            self._adapt_skipping(self.skip, policy_version, counters, kept + ledger.filtered)
        n = self.wanted(
            in_flight=ledger.train_in_flight,
            train_depth=self.transport.depths()["learner"],
            pass_rate=1.0 if recent.rate is None else recent.rate,
        )
        if self.max_jobs is not None:  # trim the admission that reaches the sample budget
            n = min(n, self.max_jobs - self.jobs_issued)
        if n <= 0:
            return 0
        jobs = [
            encode_job(self._job(cursor, policy_version), self.job_key)
            for cursor in self._choose(n)
        ]
        # Recorded before the jobs exist, for a restarted learner (`StreamSource.resume`): a
        # position recorded but never issued is only skipped, one issued twice would be trained
        # twice (the ledger's issued count no longer bounds the cursor once prompts are skipped).
        self.run_state.update_run_info(
            {RunField.DATA_CURSOR: self.cursor, RunField.RECENT_PASS_RATE: recent.to_json()}
        )
        issued = self.transport.issue(jobs) if jobs else 0
        self.jobs_issued += issued
        return issued

    def _recent(self) -> RecentPassRate:
        """The recent pass rate as of the last admission, from the run info at the first (a
        restarted learner goes on from its predecessor's)."""
        if self.recent is None:
            stored = self._stored(RunField.RECENT_PASS_RATE, RecentPassRate.from_json)
            self.recent = stored or RecentPassRate()
        return self.recent

    def _adapt_skipping(
        self, skip: PromptSkipConfig, policy_version: int, counters: Mapping[str, int], decided: int
    ) -> None:
        """Prompt skipping's keep probabilities for this admission: at a new policy version
        (a training step, or a restore) each moves one step toward its target share of the
        groups decided since the last version (`SkipState.step`), and is stored."""
        now = Decided(
            decided,
            counters.get(Counter.ZERO_ADVANTAGE_EASY, 0),
            counters.get(Counter.ZERO_ADVANTAGE_HARD, 0),
        )
        state = self.skip_state
        if state is None:
            state = self._stored(RunField.PROMPT_SKIP, SkipState.from_json)
        if state is None:
            state = SkipState(skip.easy_keep_base, skip.hard_keep_base, policy_version, now)
        elif state.policy_version != policy_version:
            state = state.step(
                policy_version,
                now,
                # As GRESO: in the first data epoch no prompt has a history, nothing is skipped,
                # and the shares would only push both probabilities to a bound.
                adapt=self.cursor >= len(self.records),
                easy_target=skip.easy_target,
                hard_target=skip.hard_target,
                step=skip.adapt_step,
                low=skip.keep_base_min,
                high=skip.keep_base_max,
            )
        if state != self.skip_state:
            self.run_state.update_run_info({RunField.PROMPT_SKIP: state.to_json()})
            self.skip_state = state

    def _stored(self, field: RunField, parse: Callable[[str], T]) -> T | None:
        """A JSON record of the feeder's in the run info; None when absent or malformed (then
        skipped and counted like any bad value: the feeder starts that record afresh)."""
        raw = self.run_state.run_field(field)
        if raw is None:
            return None
        try:
            return parse(raw)
        except (ValueError, TypeError, KeyError) as exc:
            self.run_state.skip_bad_value(self.run_state.keys.run_info, f"{field}: {exc!r}", raw)
            return None

    def _choose(self, n: int) -> list[int]:
        """The cursor positions of the next `n` prompts to issue, moving the cursor past them
        and past the prompts skipped among them."""
        if self.skip is None or self.skip_state is None:
            self.cursor += n
            return list(range(self.cursor - n, self.cursor))
        skip, state = self.skip, self.skip_state
        chosen: list[int] = []
        skipped, budget = 0, n * CANDIDATES_PER_JOB
        while len(chosen) < n and skipped < budget:
            window = range(self.cursor, self.cursor + 2 * (n - len(chosen)))
            history = self.prompt_history.prompt_stats([self._index(c) for c in window])
            for cursor, stats in zip(window, history, strict=True):
                self.cursor = cursor + 1
                keep = keep_probability(
                    stats.easy_streak,
                    stats.hard_streak,
                    keep_easy=state.keep_easy,
                    keep_hard=state.keep_hard,
                    min_keep=skip.min_keep,
                )
                if skip_draw(self.seed, cursor) < keep:
                    chosen.append(cursor)
                    if len(chosen) == n:
                        break
                else:
                    skipped += 1
        if skipped:
            self.skipped += skipped
            self.telemetry.incr(Counter.PROMPTS_SKIPPED, skipped)
        return chosen

    def _job(self, cursor: int, policy_version: int) -> PromptJob:
        index = self._index(cursor)
        rec = self.records[index]
        return PromptJob(
            group_id=f"{self.run_name}-{cursor}",
            prompt_index=index,
            data_epoch=cursor // len(self.records),
            prompt_ids=self._prompt_ids(index),
            ground_truth=rec.ground_truth,
            data_source=rec.data_source,
            issued_version=policy_version,
            issued_at=time.time(),
            extra_info=rec.extra_info,
        )
