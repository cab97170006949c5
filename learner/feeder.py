"""The prompt feeder (learner rank 0): data cursor + admission control.

Work in flight (issued prompt jobs not yet trained, filtered, dropped or dead-lettered, measured
from the stage streams) is bounded by

    limit = ceil((max_staleness + 1) x train_batch_groups x oversampling)

(DAPO.md s9, AReaL-style admission instead of generating freely and dropping old samples). Every
group the gatekeeper filters frees a slot that is refilled with a new prompt at the next
`admit`, which is how a high filter rate turns into more sampling rather than a stall. The
cursor counts issued jobs across epochs, so a resume continues exactly where it stopped.
"""

from __future__ import annotations

import math
import random
import time
from typing import Any

from services.data import PromptRecord, render_prompt
from services.schemas import PromptJob, encode_job
from services.streams import StreamBus


class PromptFeeder:
    def __init__(
        self,
        bus: StreamBus,
        records: list[PromptRecord],
        tokenizer: Any,
        *,
        run_name: str,
        limit: int,
        max_prompt_len: int,
        shuffle: bool,
        seed: int,
        cursor: int = 0,
    ) -> None:
        if not records:
            raise ValueError("the training set is empty")
        self.bus, self.records, self.tokenizer = bus, records, tokenizer
        self.run_name, self.limit, self.max_prompt_len = run_name, limit, max_prompt_len
        self.shuffle, self.seed = shuffle, seed
        self.cursor = cursor
        self._order: list[int] = []
        self._order_epoch = -1
        self._token_cache: dict[int, list[int]] = {}

    @staticmethod
    def admission_limit(max_staleness: int, train_batch_groups: int, oversampling: float) -> int:
        return math.ceil((max_staleness + 1) * train_batch_groups * oversampling)

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
            text = render_prompt(self.tokenizer, self.records[index].messages)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            self._token_cache[index] = ids[-self.max_prompt_len :]  # left-truncate (paper)
        return self._token_cache[index]

    def admit(self, policy_version: int) -> int:
        """Issue prompt jobs until work in flight reaches the limit; returns how many."""
        free = self.limit - self.bus.ledger().in_flight
        if free <= 0:
            return 0
        jobs = []
        for _ in range(free):
            index = self._index(self.cursor)
            rec = self.records[index]
            job = PromptJob(
                group_id=f"{self.run_name}-{self.cursor}", prompt_index=index, prompt_ids=self._prompt_ids(index),
                ground_truth=rec.ground_truth, data_source=rec.data_source, issued_version=policy_version,
                issued_at=time.time(),
            )
            jobs.append(encode_job(job))
            self.cursor += 1
        return self.bus.issue(jobs)
