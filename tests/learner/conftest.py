"""Fixtures of the learner's tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from contracts.runtime import free_port


@pytest.fixture(scope="module")
def one_rank_group() -> Iterator[None]:
    """A one-rank gloo process group for a module's trainers (FSDP2 needs one even alone)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1"
    )
    dist.init_process_group("gloo")
    yield
    dist.destroy_process_group()
