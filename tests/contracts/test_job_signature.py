"""Jobs are the learner's: it signs each (`PromptJob.sig`, Ed25519), and the reward workers and
the learner refuse a group whose job it did not sign, so a rollout credential (a compromised
replica) cannot choose the prompts or the ground truths that get scored and trained."""

from __future__ import annotations

from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from contracts.bus import StreamBus, connect
from contracts.config import build_config
from contracts.keys import Counter, Keys
from contracts.schemas import (
    SCHEMA_VERSION,
    EvalResult,
    EvalTag,
    RolloutGroup,
    check_job_signature,
    decode_scored_group,
    encode_eval_result,
    encode_group,
    encode_job,
    sign_job,
)
from learner.evaluation import EvalLane
from tests.contracts.test_schemas import make_group
from tests.helpers import WEIGHTS_KEY, judged

REASON = "its job is not signed by this run's learner"


def groups() -> list[RolloutGroup]:
    """A group of a job the learner issued, one whose job another key signed, one whose ground
    truth was changed after the learner signed it, and one whose job carries no signature."""
    issued, forged, tampered, unsigned = (make_group() for _ in range(4))
    for i, g in enumerate((issued, forged, tampered, unsigned)):
        g.job.group_id = f"g{i}"
    issued.job = sign_job(issued.job, WEIGHTS_KEY)
    forged.job = sign_job(forged.job, Ed25519PrivateKey.generate())
    tampered.job = sign_job(tampered.job, WEIGHTS_KEY).model_copy(update={"ground_truth": "999"})
    return [issued, forged, tampered, unsigned]


def on_stream(bus: StreamBus, items: list[RolloutGroup], stream: str) -> None:
    """The first group as the pipeline carries one (its job issued, then hopped to `stream`);
    the others written straight onto `stream`, as a process holding a stage's password can."""
    issued, *planted = items
    assert bus.issue([encode_job(issued.job)]) == 1
    [(entry_id, _)] = bus.read(bus.keys.prompts, count=1, block_ms=10)
    assert bus.hop(bus.keys.prompts, entry_id, downstream=stream, fields=encode_group(issued))
    for g in planted:
        bus.redis.xadd(stream, encode_group(g))


def dead(bus: StreamBus) -> dict[str, str]:
    return {
        f[b"group_id"].decode(): f[b"reason"].decode() for _, f in bus.redis.xrange(bus.keys.dead)
    }


def test_only_the_learners_signature_of_the_whole_job_verifies() -> None:
    issued, *others = groups()
    check_job_signature(issued, WEIGHTS_KEY.public_key())  # the replicas' and workers' key
    for g in others:
        try:
            check_job_signature(g, WEIGHTS_KEY.public_key())
        except ValueError as exc:
            assert REASON in str(exc)
        else:
            raise AssertionError(f"{g.job.group_id} verified")


def test_the_reward_worker_scores_only_groups_of_jobs_the_learner_signed(
    redis_url: str, tiny_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    from reward.service import RewardStage

    bus = StreamBus(connect(redis_url), Keys("t"), consumer="c1")
    bus.ensure_groups()
    on_stream(bus, groups(), bus.keys.rollouts.stream)
    cfg = build_config(
        {
            "model": {"path": str(tiny_model_dir)},
            "data": {"train_path": "t"},
            "queue": {"redis_url": redis_url, "namespace": "t"},
        }
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    worker = RewardStage(cfg, tokenizer, transport=bus, job_key=WEIGHTS_KEY.public_key())
    worker.handle(bus.read(bus.keys.rollouts, count=10, block_ms=10))
    scored = [
        decode_scored_group(f).job.group_id for _, f in bus.redis.xrange(bus.keys.scored.stream)
    ]
    assert scored == ["g0"]
    # The signed job survived the trip through the streams (the group re-encodes the job); the
    # others were dead-lettered unscored, with the reason.
    assert set(dead(bus)) == {"g1", "g2", "g3"}
    assert all(
        reason.startswith("reward: group g") and REASON in reason for reason in dead(bus).values()
    )
    # Not ours, so not counted as ours that died: the ledger balances (one issued, in flight).
    snap = bus.ledger()
    assert (snap.issued, snap.dead, snap.in_flight, snap.balanced) == (1, 0, 1, True)
    assert bus.counters()[Counter.POISON_MESSAGES] == 3


def test_the_learner_trains_only_groups_of_jobs_it_signed(redis_url: str) -> None:
    from tests.helpers import judged
    from tests.learner.test_nonfinite import stream_source

    bus = StreamBus(connect(redis_url), Keys("t"), consumer="c1")
    bus.ensure_groups()
    bus.set_policy_version(3)
    scored = [judged(g, [True, False, True, False]) for g in groups()]
    on_stream(bus, scored, bus.keys.train.stream)  # past the gatekeeper: an insider's write
    source = stream_source(bus, batch_groups=4, job_key=WEIGHTS_KEY, budget_s=1.0)
    assert source.collect(policy_version=3) is None  # one group of four: no batch yet
    assert [p.group.job.group_id for p in source.pending] == ["g0"]
    assert set(dead(bus)) == {"g1", "g2", "g3"}
    assert all(REASON in reason for reason in dead(bus).values())
    snap = bus.ledger()
    assert (snap.issued, snap.dead, snap.in_flight, snap.balanced) == (1, 0, 1, True)


def test_a_planted_entry_that_does_not_decode_is_poison_not_one_of_ours_that_died(
    redis_url: str,
) -> None:
    """An insider's entry carrying a group id but no job the learner signed (undecodable, or a
    decodable unsigned one) is dead-lettered as poison by a process holding the learner's key,
    so the ledger stays balanced; a signed job that dies counts as ours."""
    bus = StreamBus(connect(redis_url), Keys("t"), consumer="c1")
    bus.ensure_groups()
    bus.job_key = WEIGHTS_KEY.public_key()
    issued, _, _, unsigned = groups()
    assert bus.issue([encode_job(issued.job, WEIGHTS_KEY)]) == 1
    stream = bus.keys.scored.stream
    bus.redis.xadd(stream, {"v": "1", "kind": "scored", "group_id": "g9", "meta": "[[[["})
    bus.redis.xadd(stream, {"group_id": "g8", "meta": '{"group_id": "g8"}'})
    bus.redis.xadd(stream, encode_group(unsigned))
    for entry_id, fields in bus.read(bus.keys.scored, count=10, block_ms=10):
        assert bus.dead_letter(bus.keys.scored, entry_id, fields, "gatekeeper: bad")
    snap = bus.ledger()
    assert (snap.issued, snap.dead, snap.balanced) == (1, 0, True)
    assert bus.counters()[Counter.POISON_MESSAGES] == 3
    # A group of a job the learner signed, written in a schema version this reader does not
    # speak (a producer of another release): the run's own, counted dead.
    other_version = encode_group(issued)
    other_version.update(v=b"99")
    bus.redis.xadd(stream, other_version)
    [(entry_id, fields)] = bus.read(bus.keys.scored, count=1, block_ms=10)
    assert bus.dead_letter(bus.keys.scored, entry_id, fields, "gatekeeper: schema version")
    assert bus.ledger().dead == 1
    bus.redis.hincrby(bus.keys.ledger, "issued", 1)  # as its producer counted it
    # The issued job dies where the replica reads it: one of ours, counted dead.
    [(entry_id, fields)] = bus.read(bus.keys.prompts, count=1, block_ms=10)
    assert bus.dead_letter(bus.keys.prompts, entry_id, fields, "rollout: bad")
    snap = bus.ledger()
    assert (snap.issued, snap.dead, snap.in_flight, snap.balanced) == (2, 2, 0, True)


def test_the_evaluation_lane_takes_only_results_of_jobs_the_learner_signed(
    redis_url: str,
) -> None:
    """An evaluation result carries its job: one of a job the learner signed is added up and
    counted evaluated; a planted one (its job signed by another key, unsigned, or undecodable
    with a group id) is dead-lettered as poison, by the learner and by the dead-letter default
    of any process holding the public key, so the ledger balances and the round is ours only."""
    bus = StreamBus(connect(redis_url), Keys("t"), consumer="c1")
    bus.ensure_groups()
    bus.job_key = WEIGHTS_KEY.public_key()  # as every stage holds it
    tag = EvalTag(round_step=1, policy_version=1, problem=0, problems=1, samples=4)
    issued, forged, unsigned = (make_group() for _ in range(3))
    for i, g in enumerate((issued, forged, unsigned)):
        g.job.group_id, g.job.eval = f"e{i}", tag
    issued.job = sign_job(issued.job, WEIGHTS_KEY)
    forged.job = sign_job(forged.job, Ed25519PrivateKey.generate())
    assert bus.issue([encode_job(issued.job)], evaluation=True) == 1
    [(entry_id, _)] = bus.read(bus.keys.prompts, count=1, block_ms=10)
    result = encode_eval_result(EvalResult.of(judged(issued)))  # every response right
    assert bus.hop(bus.keys.prompts, entry_id, downstream=bus.keys.evals.stream, fields=result)
    for g in (forged, unsigned):
        wrong = judged(g, [False] * len(g.responses))
        bus.redis.xadd(bus.keys.evals.stream, encode_eval_result(EvalResult.of(wrong)))
    garbage = {"v": str(SCHEMA_VERSION), "kind": "eval", "group_id": "e9", "meta": "[[[["}
    bus.redis.xadd(bus.keys.evals.stream, garbage)  # dead-lettered by the default rule
    lane = EvalLane(
        [([1], "4", "src")],
        transport=bus,
        run_state=bus,
        run_name="t",
        samples=2,
        max_deliveries=3,
        catch_up=lambda: None,
        job_key=WEIGHTS_KEY,
    )
    [(_, metrics)] = lane.poll()
    assert metrics["eval/acc"] == 1.0  # the signed result's alone: no planted wrong answer
    assert set(dead(bus)) == {"e1", "e2", "e9"}
    assert all(REASON in dead(bus)[g] for g in ("e1", "e2"))
    snap = bus.ledger()
    assert (snap.eval_issued, snap.evaluated, snap.eval_dead, snap.balanced) == (1, 1, 0, True)
    assert bus.counters()[Counter.POISON_MESSAGES] == 3


def test_a_run_resumed_under_a_new_key_retires_the_jobs_of_its_earlier_key(
    redis_url: str,
) -> None:
    """`dapo run --resume` without the run's key signs with a new one: the jobs left in flight,
    pending or not yet delivered, are dead-lettered as the run's own (the ledger balances), and
    those the new key signed stay to be worked on."""
    bus = StreamBus(connect(redis_url), Keys("t"), consumer="c1")
    bus.ensure_groups()
    earlier, now = Ed25519PrivateKey.generate(), WEIGHTS_KEY
    old_a, old_b, new = (make_group() for _ in range(3))
    for i, g in enumerate((old_a, old_b, new)):
        g.job.group_id = f"g{i}"
    jobs = [
        encode_job(old_a.job, earlier),
        encode_job(old_b.job, earlier),
        encode_job(new.job, now),
    ]
    assert bus.issue(jobs) == 3
    # One earlier job went on to the rollouts stream and was read there by a replica that died.
    [(entry_id, _)] = bus.read(bus.keys.prompts, count=1, block_ms=10)
    old_a.job = sign_job(old_a.job, earlier)
    assert bus.hop(
        bus.keys.prompts, entry_id, downstream=bus.keys.rollouts.stream, fields=encode_group(old_a)
    )
    bus.as_consumer("dead-reward").read(bus.keys.rollouts, count=1, block_ms=10)
    retired = bus.as_consumer("resume").retire_unsigned(now.public_key(), "an earlier key")
    assert retired == 2 and set(dead(bus)) == {"g0", "g1"}
    snap = bus.ledger()
    assert (snap.issued, snap.dead, snap.in_flight, snap.balanced) == (3, 2, 1, True)
    [(_, fields)] = bus.as_consumer("replica").read(bus.keys.prompts, count=10, block_ms=10)
    assert fields[b"group_id"] == b"g2"  # the new key's job, still there to be generated
