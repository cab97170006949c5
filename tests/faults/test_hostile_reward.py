"""Hostile responses through a real reward service process (`dapo reward`, a real Redis): power
towers, a 1 MB response, deeply nested LaTeX, invalid UTF-8 and NUL bytes. Each group is scored
within its bound (responses are scored in parallel by `reward.sandbox_workers`, each within
`reward.timeout_s`), the worker stays up, a well-formed answer next to the hostile ones still
scores +1, and the ledger balances. The worst-case latency is printed (run with `-s`)."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from transformers import AutoTokenizer

from contracts.bus import StreamBus, connect
from contracts.keys import Keys
from contracts.schemas import (
    PromptJob,
    Response,
    RolloutGroup,
    ScoredGroup,
    decode_scored_group,
    encode_group,
    encode_job,
    sign_job,
)
from tests.helpers import REPO, WEIGHTS_KEY, wait_for

pytestmark = pytest.mark.slow

TIMEOUT_S = 2.0
WORKERS = 2
NESTING = 2000
MAX_LEN = 1_100_000
"""Long enough for the 1 MB response (the tiny tokenizer spells digits one token each)."""


def hostile_texts(tokenizer: object) -> dict[str, list[int]]:
    """Token ids of each hostile response (a byte-level tokenizer spells any bytes); every one
    of them is a wrong answer to "42"."""
    encode = tokenizer.encode  # type: ignore[attr-defined]
    byte_token = tokenizer.convert_tokens_to_ids  # type: ignore[attr-defined]
    nested = "\\frac{" * NESTING + "1" + "}{2}" * NESTING
    texts = {
        "power tower": "Answer: $\\boxed{10^{10^{10^{10^{10^{10}}}}}}$",
        "power tower (bare)": "Answer: 9^{9^{9^{9^{9^{9^{9}}}}}}",
        "1 MB": "7" * 1_000_000 + "\nAnswer: 43",
        "nested LaTeX": f"Answer: $\\boxed{{{nested}}}$ and {nested}",
        "NUL bytes": "\x00" * 1000 + "Answer: 4\x007\x00",
    }
    ids = {name: encode(text, add_special_tokens=False) for name, text in texts.items()}
    # Invalid UTF-8: a truncated 2-byte sequence (0xC3 0x28), then 0xFF and 0xFE (byte-level
    # tokens for printable bytes are the bytes' own Latin-1 characters).
    ids["invalid UTF-8"] = [byte_token(c) for c in ("Ã", "(", "ÿ", "þ")] + encode(
        "Answer: 41", add_special_tokens=False
    )
    return ids


def group_of(name: str, hostile: list[int], good: list[int], index: int) -> RolloutGroup:
    job = PromptJob(
        group_id=f"hostile-{index}",
        prompt_index=index,
        prompt_ids=[1, 2, 3],
        ground_truth="42",
        issued_version=0,
        issued_at=time.time(),
    )
    responses = [
        Response(token_ids=ids, logprobs=[-1.0] * len(ids), finish_reason="stop")
        for ids in (hostile, hostile, hostile, good)
    ]
    # Signed as the learner signs its jobs: the reward worker scores no other.
    return RolloutGroup(
        job=sign_job(job, WEIGHTS_KEY),
        policy_version=0,
        replica_id=f"injector:{name}",
        responses=responses,
    )


@pytest.mark.parametrize("verifier", ["math-verify", "dapo"])
def test_hostile_responses_are_scored_within_the_bound(
    verifier: str, redis_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    keys = Keys("dapo")
    bus = StreamBus(connect(redis_url), keys, "injector")
    bus.ensure_groups()
    log = (tmp_path / "reward.log").open("w")
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "reward",
            "--config",
            "configs/tiny.yaml",
            f"model.path={tiny_model_dir}",
            f"queue.redis_url={redis_url}",
            f"reward.verifier={verifier}",
            f"reward.timeout_s={TIMEOUT_S}",
            f"reward.sandbox_workers={WORKERS}",
            f"output_dir={tmp_path / 'run'}",
            f"rollout.max_response_len={MAX_LEN}",
        ],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        r = redis.Redis.from_url(redis_url)
        wait_for(
            "the reward worker", lambda: any(r.scan_iter(match="dapo:hb:reward:*")), timeout_s=120
        )
        good = tokenizer.encode("The sum is 42.\nAnswer: 42", add_special_tokens=False)
        hostile = hostile_texts(tokenizer)
        names = [*hostile, "control"]
        groups = [group_of(name, hostile.get(name, good), good, i) for i, name in enumerate(names)]
        # A response longer than any sampler could produce is malformed: dead-lettered, not scored.
        too_long = group_of("too long", [7] * (MAX_LEN + 1), good, len(groups))
        # Issue the jobs and hop them to the rollouts stream as a replica would,
        # so the ledger counts them.
        bus.issue([encode_job(g.job) for g in [*groups, too_long]])
        sent_ms = {}
        for (entry_id, _), g in zip(
            bus.read(keys.prompts, count=len(groups) + 1, block_ms=100),
            [*groups, too_long],
            strict=True,
        ):
            bus.hop(keys.prompts, entry_id, downstream=keys.rollouts.stream, fields=encode_group(g))
            sent_ms[g.job.group_id] = int(time.time() * 1000)
        per_group_bound_s = (
            math.ceil(4 / WORKERS) * TIMEOUT_S + 5.0
        )  # 4 responses, plus decode and overhead
        scored = wait_for(
            "every group scored",
            lambda: _scored(r, keys, len(groups)),
            timeout_s=len(groups) * per_group_bound_s + 30,
        )
        assert worker.poll() is None, "the reward worker died"
        latency = {
            g.replica_id.split(":", 1)[1]: (int(e.split("-")[0]) - sent_ms[g.job.group_id]) / 1000
            for e, g in scored
        }
        # Queue wait included: the worker takes groups one after another, so measure each one's own
        # time as the gap since the previous group was scored.
        order = sorted(scored, key=lambda eg: eg[0])
        own = {}
        previous = min(sent_ms.values()) / 1000
        for e, g in order:
            done = int(e.split("-")[0]) / 1000
            own[g.replica_id.split(":", 1)[1]] = round(
                done - max(previous, sent_ms[g.job.group_id] / 1000), 2
            )
            previous = done
        wait_for("the dead letter", lambda: r.xlen(keys.dead) == 1, timeout_s=60)
        dead_reason = r.xrange(keys.dead)[0][1][b"reason"].decode()
        ledger = bus.ledger()
        timeouts = int(r.hget(keys.counters, "reward_timeouts") or 0)
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    print(
        f"{verifier}: seconds to score each 4-response group {own}; worst {max(own.values()):.2f}s "
        f"(bound {per_group_bound_s:.0f}s); {timeouts} responses hit the {TIMEOUT_S}s timeout"
    )
    assert worker.returncode == 0  # SIGTERM: finished its item and exited cleanly
    assert max(own.values()) <= per_group_bound_s, own
    assert max(latency.values()) <= len(groups) * per_group_bound_s
    for _, g in scored:
        assert len(g.rewards) == 4 and all(
            -2.0 <= x <= 1.0 for x in g.rewards
        )  # scored, never NaN/garbage
        assert g.acc[3], f"the well-formed answer next to {g.replica_id} was not scored correct"
        name = g.replica_id.split(":", 1)[1]
        if name != "control":
            assert not any(g.acc[:3]), f"{name} scored as correct"
    assert (
        f"a response of {MAX_LEN + 1} tokens exceeds rollout.max_response_len={MAX_LEN}"
        in dead_reason
    )
    assert (
        ledger.issued == len(groups) + 1
        and ledger.in_flight == len(groups)
        and ledger.dead == 1
        and ledger.balanced
    )


def _scored(r: redis.Redis, keys: Keys, n: int) -> list[tuple[str, ScoredGroup]] | None:
    rows = r.xrange(keys.scored.stream)
    if len(rows) < n:
        return None
    return [(eid.decode(), decode_scored_group(fields)) for eid, fields in rows]
