"""One rank of `test_nonfinite.py`'s multi-rank check, run under torch.distributed.run.

    python tests/learner/nonfinite_ranks.py --worker MODEL_DIR OUT

One DAPO step on `bench/multirank_check.py`'s batch with a NaN advantage in row 0 only, so only
the rank that holds row 0 sees a NaN loss; rank 0 saves the metrics and the parameters before
and after the step to OUT.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]


def worker(model_dir: str, out: str) -> None:
    from bench.multirank_check import make_groups
    from contracts.config import load_config
    from learner.batch import build_batch
    from learner.trainer import Trainer

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    batch = build_batch(make_groups(), pad_id=0)
    batch.advantages[0] = float("nan")  # one row of one mini-batch: on one rank only
    cfg = load_config(
        REPO / "configs" / "tiny.yaml",
        [
            f"model.path={model_dir}",
            "learner.lr=1e-3",
            "learner.warmup_steps=0",
            "learner.micro_batch_size=1",
            "algorithm.train_batch_groups=4",
            "algorithm.mini_batch_groups=2",
        ],
    )
    trainer = Trainer(cfg, rank=rank, world_size=world, backend="gloo")
    before = {n: t.cpu().clone() for n, t in trainer.named_full_params()}
    metrics = trainer.train_step(batch, policy_version=1)
    after = {n: t.cpu().clone() for n, t in trainer.named_full_params()}
    if rank == 0:
        torch.save({"metrics": metrics, "before": before, "after": after}, out)
    dist.barrier()  # no rank leaves (closing its sockets) while another still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "--worker":
        sys.exit(__doc__)
    worker(sys.argv[2], sys.argv[3])
    # The work is done and saved. Leave without the interpreter's teardown: once, under a loaded
    # suite, a rank aborted in a C++ destructor at exit ("terminate called without an active
    # exception") after finishing, which failed a test whose results were already written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
