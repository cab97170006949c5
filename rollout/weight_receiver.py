"""Receive a weight broadcast from learner rank 0 (used inside whichever process holds weights:
the rollout process for the transformers engine, the vLLM worker for the vLLM engine)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from services.contracts.weight_sync import (
    DTYPES,
    Announcement,
    broadcast_bucket,
    bucket_numel,
    make_group,
    unflatten,
)

log = logging.getLogger(__name__)


class WeightReceiver:
    """Keeps the group of the current membership generation; rebuilds it when that changes."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.group_key = ""
        self.group: dist.ProcessGroup | None = None
        self.last_seconds = 0.0

    def receive(self, ann: Announcement, rank: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) for every parameter, bucket by bucket, as they arrive.

        On any error the group is dropped, so the next announcement builds a fresh one.
        """
        start = time.monotonic()
        try:
            if self.group is None or self.group_key != ann.group_key:
                self.group = None
                self.group = make_group(ann, rank)
                self.group_key = ann.group_key
            for bucket in ann.buckets:
                flat = torch.empty(bucket_numel(bucket), dtype=DTYPES[bucket[0].dtype], device=self.device)
                broadcast_bucket(self.group, flat, ann.timeout_s)
                yield from unflatten(flat, bucket)
        except Exception:
            self.group = None
            self.group_key = ""
            raise
        self.last_seconds = time.monotonic() - start
        log.info("received policy version %d in %.3fs", ann.version, self.last_seconds)
