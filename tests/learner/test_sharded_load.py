"""The sharded build reproduces the checkpoint exactly: built on the meta device, sharded over
3 ranks (shard rows that do not divide evenly), loaded rank by rank from the safetensors files,
the gathered parameters, the derived buffers and the logits equal `from_pretrained`'s.

Run by pytest; the same file is the script each rank runs under torch.distributed.run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _rank_main(model_dir: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from learner.precision import mixed_precision
    from learner.sharded_model import build_sharded_model

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    model = build_sharded_model(
        model_dir,
        device,
        rank=rank,
        world_size=world,
        mp=mixed_precision("none", device),
        checkpointing=False,
    )
    full = {
        n: p.full_tensor() if hasattr(p, "full_tensor") else p.data
        for n, p in model.named_parameters()
    }
    local = sum(
        p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters()
    )
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = float((model(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max())
    buffers = dict(model.named_buffers())
    result = {
        "param_mismatches": [
            n for n, p in ref.named_parameters() if not torch.equal(p.data, full[n])
        ],
        "buffer_mismatches": [n for n, b in ref.named_buffers() if not torch.equal(b, buffers[n])],
        "logit_diff": diff,
        "local_params": local,
        "total_params": sum(p.numel() for p in ref.parameters()),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # no rank leaves (closing its sockets) while another still talks to it
    dist.destroy_process_group()


def test_sharded_build_equals_from_pretrained(tiny_model_dir: Path, tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=3",
        __file__,
        str(tiny_model_dir),
        str(tmp_path),
    ]
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    for r in results:
        assert (
            r["param_mismatches"] == [] and r["buffer_mismatches"] == [] and r["logit_diff"] == 0.0
        )
    # No rank holds the whole model: the local shards add up to it once.
    assert sum(r["local_params"] for r in results) == results[0]["total_params"]
    assert max(r["local_params"] for r in results) < 0.4 * results[0]["total_params"]


if __name__ == "__main__":
    _rank_main(sys.argv[1], sys.argv[2])
