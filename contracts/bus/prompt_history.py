"""The run's prompt history: what each training prompt's groups taught so far.

One fixed-width record per prompt index in one Redis string (`Keys.prompt_history`), written by
the gatekeeper each time it decides a group and read by the learner's feeder before it issues a
prompt (`algorithm.prompt_skip`, docs/algorithm.md section 11). A string of 8-byte records keeps
the history exact and bounded: 8 MB for a million prompts, with no per-key overhead, and it lives
with the run's other state in Redis (AOF makes it survive a Redis restart; a learner restart
does not touch it).

A record, big-endian as Redis's BITFIELD numbers its bits:

    seen    u16  groups of this prompt the gatekeeper decided (saturates at 65535)
    data_epoch  u16  the data epoch of the latest of them
    easy    u4   zero-advantage groups in a row whose responses were all right
    hard    u4   zero-advantage groups in a row otherwise (all wrong)
    correct u8   responses of the latest group that were right
    size    u8   responses in the latest group
    kept    u8   groups of this prompt kept in all (saturates at 255)

The two streaks are GRESO's separate easy and hard counts (docs/algorithm.md section 11): a group
with signal resets both, a zero-advantage group lengthens its own kind's and resets the other's,
so at most one is non-zero. They saturate at 15, which bounds how rarely a long streak is issued:
at a base keep probability p <= 0.8, p ** 15 is under the default exploration floor (0.05) anyway;
at the largest base, 0.95, such a prompt is issued with 0.46 rather than less. (A record written
when this byte held one streak reads as that many hard groups, the kind explored more.)

The gatekeeper's update is one BITFIELD command, so it is atomic; it comes after the group's hop,
like the response counts, so a crash in between can miss one record: history guides a sampling
probability, it is not the ledger. Any bytes read back decode to numbers, so a planted value can
only change a skip probability, which the exploration floor bounds.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from contracts.bus.hygiene import WRONGTYPE, RedisHygiene

RECORD = struct.Struct(">HHBBBB")
RECORD_BITS = RECORD.size * 8

MAX_PROMPTS = 1 << 21
"""Prompt indices the history records (16 MiB at most): an index beyond it, which no data set
this system trains on reaches, is not recorded, so one message cannot grow the string without
bound."""


@dataclass(frozen=True)
class PromptStats:
    """One prompt's record (all zero: never decided)."""

    seen: int = 0
    data_epoch: int = 0
    easy_streak: int = 0
    hard_streak: int = 0
    correct: int = 0
    size: int = 0
    kept: int = 0

    @property
    def streak(self) -> int:
        """Zero-advantage groups in a row, of whichever kind the latest was (0: it was kept)."""
        return self.easy_streak + self.hard_streak

    @property
    def pass_rate(self) -> float | None:
        """Share of the latest group's responses that were right; None before the first."""
        return self.correct / self.size if self.size else None


class PromptHistory(RedisHygiene):
    """Reads and writes of the prompt history (see the module docstring)."""

    def record_prompt_outcome(
        self, prompt_index: int, *, data_epoch: int, correct: int, size: int, kept: bool
    ) -> bool:
        """Add one decided group of `prompt_index`; False when the index is out of range. `kept`:
        the group carried learning signal; one that did not is easy when every response was
        right, hard otherwise."""
        if not 0 <= prompt_index < MAX_PROMPTS:
            return False
        at = prompt_index * RECORD_BITS
        easy, hard = ("SET", "u4", at + 32, 0), ("SET", "u4", at + 36, 0)
        if not kept and 0 < size == correct:
            easy = ("INCRBY", "u4", at + 32, 1)
        elif not kept:
            hard = ("INCRBY", "u4", at + 36, 1)
        self.write(
            "BITFIELD",
            self.keys.prompt_history,
            "OVERFLOW",
            "SAT",
            "INCRBY", "u16", at, 1,
            "SET", "u16", at + 16, min(max(data_epoch, 0), 0xFFFF),
            *easy,
            *hard,
            "SET", "u8", at + 40, min(max(correct, 0), 0xFF),
            "SET", "u8", at + 48, min(max(size, 0), 0xFF),
            "INCRBY", "u8", at + 56, int(kept),
        )  # fmt: skip
        return True

    def prompt_stats(self, indices: Sequence[int]) -> list[PromptStats]:
        """The records of `indices`, in order (never decided, or out of range: all zero)."""
        pipe = self.redis.pipeline(transaction=False)
        wanted = [i for i in indices if 0 <= i < MAX_PROMPTS]
        for i in wanted:
            pipe.getrange(self.keys.prompt_history, i * RECORD.size, (i + 1) * RECORD.size - 1)
        raw: list[Any] = []
        if wanted:
            try:
                raw = pipe.execute()
            except redis.ResponseError as exc:  # a key of another type: skipped and counted
                if WRONGTYPE not in str(exc):
                    raise
                self.skip_bad_value(self.keys.prompt_history, "a value of the wrong type")
        found = dict(zip(wanted, raw, strict=False))
        return [decode_record(found.get(i, b"")) for i in indices]

    def prompt_history_bytes(self) -> int:
        """Bytes the history holds (what it costs in Redis, roughly)."""
        raw: Any = self._read(0, self.redis.strlen, self.keys.prompt_history)
        return int(raw or 0)


def decode_record(raw: bytes) -> PromptStats:
    """One record's bytes (fewer than a record: beyond the string's end, never written)."""
    if len(raw) < RECORD.size:
        return PromptStats()
    seen, data_epoch, streaks, correct, size, kept = RECORD.unpack(raw[: RECORD.size])
    return PromptStats(seen, data_epoch, streaks >> 4, streaks & 0xF, correct, size, kept)
