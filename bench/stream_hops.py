"""Redis stream transport throughput: atomic hops (Lua: ack + delete + forward + count) against a
baseline of plain pipelined XADD + XREADGROUP + XACK in the same run, with realistic group sizes.

    .venv/bin/python bench/stream_hops.py [--groups 2000] [--group-size 16] [--tokens 256]

Prints groups/s and MB/s for both, and their ratio.
Last line: `hop_ms=<milliseconds per atomic hop>`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from contracts.bus import StreamBus, connect
from contracts.keys import Keys
from contracts.schemas import PromptJob, Response, RolloutGroup, encode_group, encode_job
from services.run.redis_server import RedisServer

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.results_file import save_result  # noqa: E402  (a module beside this script)


def make_group(group_size: int, tokens: int) -> RolloutGroup:
    job = PromptJob(
        group_id="g",
        prompt_index=0,
        prompt_ids=list(range(128)),
        ground_truth="1",
        issued_version=0,
        issued_at=0.0,
    )
    resp = [
        Response(token_ids=list(range(tokens)), logprobs=[-0.5] * tokens, finish_reason="stop")
        for _ in range(group_size)
    ]
    return RolloutGroup(job=job, policy_version=0, replica_id="r", responses=resp)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=2000)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = ap.parse_args()
    fields = encode_group(make_group(args.group_size, args.tokens))
    size_mb = sum(len(v) for v in fields.values()) / 2**20
    with tempfile.TemporaryDirectory() as tmp, RedisServer(tmp, appendonly=False) as server:
        bus = StreamBus(connect(server.url), Keys("bench"), "c")
        bus.ensure_groups()
        job = encode_job(make_group(1, 1).job)

        # Baseline: plain stream ops, pipelined per group, no atomicity, no ledger.
        r = bus.redis
        for _ in range(args.groups):
            r.xadd("base:in", job)
        r.xgroup_create("base:in", "g", id="0")
        start = time.perf_counter()
        for eid, _ in r.xreadgroup("g", "c", {"base:in": ">"}, count=args.groups)[0][1]:
            with r.pipeline(transaction=False) as p:
                p.xadd("base:out", fields)
                p.xack("base:in", "g", eid)
                p.execute()
        base_s = time.perf_counter() - start

        bus.issue([job] * args.groups)
        start = time.perf_counter()
        for eid, _ in bus.read(bus.keys.prompts, count=args.groups, block_ms=100):
            bus.hop(bus.keys.prompts, eid, downstream=bus.keys.rollouts.stream, fields=fields)
        hop_s = time.perf_counter() - start
        assert bus.ledger().balanced
    n = args.groups
    print(
        f"group: {args.group_size} responses x {args.tokens} tokens = {size_mb * 1024:.0f} KiB on "
        "the wire"
    )
    print(
        f"baseline xadd+xack pipeline: {n / base_s:8.0f} groups/s  {n * size_mb / base_s:7.1f} MB/s"
    )
    print(
        f"atomic hop (Lua):            {n / hop_s:8.0f} groups/s  {n * size_mb / hop_s:7.1f} MB/s"
    )
    print(f"hop / baseline throughput:   {base_s / hop_s:.2f}x")
    save_result(
        "stream_hops",
        {
            "group_size": args.group_size,
            "tokens": args.tokens,
            "groups": n,
            "hop_groups_per_s": n / hop_s,
            "baseline_groups_per_s": n / base_s,
            "hop_ms": 1e3 * hop_s / n,
        },
        args.out,
    )
    print(f"hop_ms={1e3 * hop_s / n:.3f}")


if __name__ == "__main__":
    main()
