"""Non-finite values never reach the weights.

Groups with NaN or infinite rewards or log-probs, positive log-probs or token ids outside the
vocabulary are dead-lettered with the reason by the gatekeeper (the schema's decode) or the
learner's collector (the vocabulary), and the ledger balances; a training update whose loss or
gradient norm is not finite is skipped on every rank, counted, and stops the run after
`learner.max_nonfinite_steps` in a row.
"""

from __future__ import annotations

import math
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.multirank_check import build_model, launch_ranks
from contracts.bus import StreamBus, connect
from contracts.config import DapoConfig, load_config
from contracts.data import PromptRecord
from contracts.keys import Counter, Keys, Stage
from contracts.runtime import StopFlag
from contracts.schemas import (
    PromptJob,
    Response,
    ScoredGroup,
    decode_scored_group,
    encode_group,
    encode_job,
)
from learner.batch import TrainBatch, build_batch
from learner.collect import StreamSource
from learner.commands import Picked, Progress, Train
from learner.feeder import PromptFeeder
from learner.trainer import NonFiniteTrainingError, Trainer
from tests.contracts.test_schemas import make_group
from tests.helpers import gatekeeper_on, judged
from tests.learner.test_loop import FakeSource, rank0

REPO = Path(__file__).resolve().parents[2]
NAN, INF = float("nan"), float("inf")
VOCAB = 100  # make_group's token ids stay below 4 + 50
MAX_RESPONSE = 64  # the run's largest response (make_group's are 50 tokens)


# --- groups on the streams ------------------------------------------------------------------------
def scored(group_id: str) -> ScoredGroup:
    g = make_group()
    g.job.group_id = group_id
    return judged(g, [True, False, True, False])


def set_reward(i: int, value: float) -> Callable[[ScoredGroup], None]:
    def corrupt(g: ScoredGroup) -> None:
        g.rewards = [value if j == i else r for j, r in enumerate(g.rewards)]

    return corrupt


def set_logprob(i: int, j: int, value: float) -> Callable[[ScoredGroup], None]:
    def corrupt(g: ScoredGroup) -> None:
        g.responses[i].logprobs[j] = value

    return corrupt


def set_token(i: int, j: int, value: int) -> Callable[[ScoredGroup], None]:
    def corrupt(g: ScoredGroup) -> None:
        g.responses[i].token_ids[j] = value

    return corrupt


def set_prompt_token(j: int, value: int) -> Callable[[ScoredGroup], None]:
    def corrupt(g: ScoredGroup) -> None:
        g.job.prompt_ids[j] = value

    return corrupt


NUMBERS = [  # what every consumer's decode rejects: (corruption, reason)
    pytest.param(set_reward(1, NAN), "response 1 reward is nan", id="nan-reward"),
    pytest.param(set_reward(0, -INF), "response 0 reward is -inf", id="inf-reward"),
    pytest.param(set_logprob(2, 7, INF), "response 2 logprob 7 is inf", id="inf-logprob"),
    pytest.param(set_logprob(3, 5, NAN), "response 3 logprob 5 is nan", id="nan-logprob"),
    pytest.param(
        set_logprob(1, 4, 0.5),
        "response 1 logprob 4 is 0.5, above 0 (a log-prob is never positive)",
        id="positive-logprob",
    ),
    pytest.param(
        set_token(0, 2, -7),
        "response 0 token 2 is id -7, token ids are never negative",
        id="negative-token",
    ),
]


def lengthen(i: int, tokens: int) -> Callable[[ScoredGroup], None]:
    def corrupt(g: ScoredGroup) -> None:
        g.responses[i].token_ids += [5] * tokens
        g.responses[i].logprobs += [-1.0] * tokens

    return corrupt


def add_responses(n: int) -> Callable[[ScoredGroup], None]:
    def corrupt(g: ScoredGroup) -> None:
        extra = judged(make_group(), [True] * len(g.responses))
        for _ in range(n // len(g.responses)):
            g.responses += extra.responses
            g.scores += extra.scores
            g.acc += extra.acc
            g.rewards += extra.rewards
            g.preds += extra.preds

    return corrupt


VOCABULARY = [  # what only the learner, which knows the model and the run's sizes, rejects
    pytest.param(
        set_token(2, 4, VOCAB),
        f"response 2 token 4 is id {VOCAB}, outside the model's vocabulary of {VOCAB} ids",
        id="oov-response-token",
    ),
    pytest.param(
        set_prompt_token(1, VOCAB + 5),
        f"prompt token 1 is id {VOCAB + 5}, outside the model's vocabulary of {VOCAB} ids",
        id="oov-prompt-token",
    ),
    pytest.param(
        lengthen(2, 10_000),
        f"group g1: response 2 has {10_000 + 50} tokens, over the run's {MAX_RESPONSE}",
        id="oversized-response",
    ),
    pytest.param(
        add_responses(8),
        "group g1: 12 responses, over the 8 a job asks for",
        id="too-many-responses",
    ),
]


@pytest.fixture()
def bus(redis_url: str) -> StreamBus:
    b = StreamBus(connect(redis_url), Keys("t"), consumer="c1")
    b.ensure_groups()
    b.set_policy_version(20)  # past every group's version: the gatekeeper refuses newer ones
    return b


def forward(bus: StreamBus, groups: list[ScoredGroup], downstream: Stage) -> None:
    """Issue one job per group (counted in the ledger) and hop each, as its group,
    to `downstream`."""
    assert bus.issue([encode_job(g.job) for g in groups]) == len(groups)
    entries = bus.read(bus.keys.prompts, count=len(groups), block_ms=10)
    for (entry_id, _), g in zip(entries, groups, strict=True):
        assert bus.hop(
            bus.keys.prompts, entry_id, downstream=downstream.stream, fields=encode_group(g)
        )


def dead_letters(bus: StreamBus) -> list[tuple[str, str]]:
    return [
        (f[b"group_id"].decode(), f[b"reason"].decode()) for _, f in bus.redis.xrange(bus.keys.dead)
    ]


def stream_source(
    bus: StreamBus, batch_groups: int, *, job_key: Any = None, budget_s: float = 5.0
) -> StreamSource:
    """The learner's collector with a feeder that issues nothing (`kept_ahead=0`); `job_key`:
    the learner's key, checking every job's signature (None: unchecked)."""
    record = PromptRecord(
        index=0,
        messages=[{"role": "user", "content": "1+1"}],
        ground_truth="2",
        data_source="t",
        extra_info={},
    )
    feeder = PromptFeeder(
        [record],
        None,
        transport=bus,
        run_state=bus,
        telemetry=bus,
        prompt_history=bus,
        run_name="t",
        limit=0,
        kept_ahead=0,
        max_prompt_len=16,
        shuffle=False,
        seed=0,
    )
    return StreamSource(
        feeder,
        transport=bus,
        run_state=bus,
        batch_groups=batch_groups,
        max_staleness=100,
        max_deliveries=3,
        stop=StopFlag(),
        catch_up=lambda: None,
        vocab_size=VOCAB,
        sizes={"max_prompt_tokens": 16, "max_response_tokens": MAX_RESPONSE, "max_responses": 8},
        job_key=job_key,
        budget_s=budget_s,
    )


@pytest.mark.parametrize(("corrupt", "reason"), NUMBERS)
def test_the_gatekeeper_dead_letters_a_group_with_bad_numbers(
    bus: StreamBus, corrupt: Callable[[ScoredGroup], None], reason: str
) -> None:
    good, bad = scored("good"), scored("bad")
    corrupt(bad)
    forward(bus, [good, bad], bus.keys.scored)
    gate = gatekeeper_on(bus)
    gate.handle(bus.read(bus.keys.scored, count=10, block_ms=10))
    assert dead_letters(bus) == [("bad", f"gatekeeper: {reason}")]
    trained = bus.redis.xrange(bus.keys.train.stream)
    assert [decode_scored_group(f).job.group_id for _, f in trained] == ["good"]
    snap = bus.ledger()
    assert (snap.dead, snap.in_flight, snap.balanced) == (1, 1, True)
    assert bus.counters()[Counter.DEAD_LETTERS] == 1


@pytest.mark.parametrize(("corrupt", "reason"), NUMBERS + VOCABULARY)
def test_the_learner_dead_letters_a_bad_group_and_trains_the_others(
    bus: StreamBus, corrupt: Callable[[ScoredGroup], None], reason: str
) -> None:
    """Whatever reaches the train stream (a gatekeeper of an older version, an orphan taken over)
    is checked again, and the vocabulary only here."""
    groups = [scored(f"g{i}") for i in range(3)]
    corrupt(groups[1])
    forward(bus, groups, bus.keys.train)
    source = stream_source(bus, batch_groups=2)
    picked = source.collect(policy_version=3)
    assert picked is not None and [p.group.job.group_id for p in picked] == ["g0", "g2"]
    assert dead_letters(bus) == [("g1", f"learner: {reason}")]
    source.account(picked)
    snap = bus.ledger()
    assert (snap.trained, snap.dead, snap.in_flight, snap.balanced) == (2, 1, 0, True)


def test_a_group_whose_meta_nests_2000_deep_is_dead_lettered_and_the_others_train(
    bus: StreamBus,
) -> None:
    """The probe that crashed the learner on every restart: json.loads raised RecursionError,
    which neither the decode nor the dead-letter path (it reads the group id) caught."""
    groups = [scored(f"g{i}") for i in range(3)]
    assert bus.issue([encode_job(g.job) for g in groups]) == 3
    entries = bus.read(bus.keys.prompts, count=3, block_ms=10)
    for (entry_id, _), g in zip(entries, groups, strict=True):
        fields = encode_group(g)
        if g.job.group_id == "g1":
            fields["meta"] = b"[" * 2000 + b"]" * 2000
        assert bus.hop(bus.keys.prompts, entry_id, downstream=bus.keys.train.stream, fields=fields)
    source = stream_source(bus, batch_groups=2)
    picked = source.collect(policy_version=3)
    assert picked is not None and [p.group.job.group_id for p in picked] == ["g0", "g2"]
    assert dead_letters(bus) == [("g1", "learner: meta nests deeper than 32 levels")]
    source.account(picked)
    snap = bus.ledger()
    assert (snap.trained, snap.dead, snap.in_flight, snap.balanced) == (2, 1, 0, True)


def test_a_token_at_the_last_vocabulary_id_and_a_tiny_positive_logprob_are_accepted(
    bus: StreamBus,
) -> None:
    """The bounds are the vocabulary's last id and float rounding of a near-certain token."""
    g = scored("g0")
    set_token(0, 0, VOCAB - 1)(g)
    set_logprob(0, 1, 1e-6)(g)
    forward(bus, [g], bus.keys.train)
    picked = stream_source(bus, batch_groups=1).collect(policy_version=3)
    assert picked is not None and picked[0].group.responses[0].token_ids[0] == VOCAB - 1
    assert dead_letters(bus) == []


# --- the trainer ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def process_group(one_rank_group: None) -> None:
    """The trainer tests below: one gloo rank (tests/learner/conftest.py)."""


def groups(n_groups: int, seed: int = 0, reward: float | None = None) -> list[ScoredGroup]:
    """`n_groups` groups of 4 responses with mixed rewards (each group has signal); `reward`, when
    given, replaces the first response's reward (a NaN the decode would have rejected)."""
    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        job = PromptJob(
            group_id=f"g{g}",
            prompt_index=g,
            prompt_ids=[rng.randrange(3, 200) for _ in range(rng.randint(4, 9))],
            ground_truth="1",
            issued_version=0,
            issued_at=0.0,
        )
        responses = []
        for _ in range(4):
            n = rng.randint(1, 7)
            responses.append(
                Response(
                    token_ids=[rng.randrange(3, 200) for _ in range(n)],
                    logprobs=[-1.0] * n,
                    finish_reason="stop",
                )
            )
        rewards = [1.0, -1.0, rng.choice([1.0, -1.0]), rng.choice([1.0, -1.0])]
        if reward is not None:
            rewards[0] = reward
        out.append(
            ScoredGroup(
                job=job,
                policy_version=0,
                replica_id="r",
                responses=responses,
                scores=rewards,
                acc=[r > 0 for r in rewards],
                rewards=rewards,
                preds=[""] * 4,
            )
        )
    return out


def config(model_dir: Path, *overrides: str) -> DapoConfig:
    return load_config(
        REPO / "configs" / "tiny.yaml",
        [
            f"model.path={model_dir}",
            "learner.lr=1e-3",
            "learner.warmup_steps=0",
            "algorithm.train_batch_groups=4",
            "algorithm.mini_batch_groups=2",
            *overrides,
        ],
    )


def params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in trainer.named_full_params()}


def nan_batch(seed: int = 0) -> TrainBatch:
    batch = build_batch(groups(4, seed), pad_id=0)
    batch.advantages[:] = NAN
    return batch


def assert_unchanged(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert not changed, f"a skipped step changed {changed}"


@pytest.mark.usefixtures("process_group")
def test_a_nan_loss_skips_every_update_and_leaves_the_weights_and_optimizer_untouched(
    tiny_model_dir: Path,
) -> None:
    trainer = Trainer(
        config(tiny_model_dir, "learner.warmup_steps=4"), rank=0, world_size=1, backend="gloo"
    )
    before = params(trainer)
    metrics = trainer.train_step(nan_batch(), policy_version=0)
    assert_unchanged(before, params(trainer))
    assert metrics["actor/nonfinite_steps"] == 1.0 and metrics["actor/skipped_updates"] == 2.0
    assert metrics["actor/updates"] == 0.0
    assert all(math.isfinite(v) for v in metrics.values()), metrics  # the metrics stream is JSON
    assert (
        trainer.optimizer.state == {} and trainer.scheduler.last_epoch == 0
    )  # no AdamW step, no warm-up step
    assert all(p.grad is None for p in trainer.model.parameters())


@pytest.mark.usefixtures("process_group")
def test_an_infinite_gradient_with_a_finite_loss_is_skipped_too(tiny_model_dir: Path) -> None:
    """The gradient norm is checked, not just the loss: an overflow in the backward pass alone."""
    trainer = Trainer(config(tiny_model_dir), rank=0, world_size=1, backend="gloo")

    def blow_up_backward(_module: torch.nn.Module, _inputs: object, output: object) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        assert isinstance(hidden, torch.Tensor)
        if hidden.requires_grad:
            hidden.register_hook(lambda grad: grad * INF)

    trainer.model.model.layers[0].register_forward_hook(blow_up_backward)
    backward, nonfinite_losses = trainer._backward, []

    def spy(*args: Any) -> tuple[dict[str, float], torch.Tensor]:
        sums, nonfinite = backward(*args)
        nonfinite_losses.append(float(nonfinite))
        return sums, nonfinite

    trainer._backward = spy  # type: ignore[method-assign]
    before = params(trainer)
    metrics = trainer.train_step(build_batch(groups(4), pad_id=0), policy_version=0)
    assert_unchanged(before, params(trainer))
    assert nonfinite_losses == [0.0, 0.0]  # every loss was finite: the norm caught it
    assert metrics["actor/skipped_updates"] == 2.0 and metrics["actor/nonfinite_steps"] == 1.0


@pytest.mark.usefixtures("process_group")
def test_a_finite_step_after_a_skipped_one_trains_as_if_the_skip_never_happened(
    tiny_model_dir: Path,
) -> None:
    """Same parameters and learning rate (the warm-up did not advance) as a trainer that never
    saw the NaN batch."""
    cfg = config(tiny_model_dir, "learner.warmup_steps=4")
    good = build_batch(groups(4, seed=1), pad_id=0)
    skipped, fresh = (Trainer(cfg, rank=0, world_size=1, backend="gloo") for _ in range(2))
    start = params(fresh)
    skipped.train_step(nan_batch(), policy_version=0)
    results = []
    for trainer in (skipped, fresh):
        trainer.rng = random.Random(5)  # the same mini-batch split
        results.append((trainer.train_step(good, policy_version=0), params(trainer)))
    (m_skipped, p_skipped), (m_fresh, p_fresh) = results
    assert m_skipped["actor/nonfinite_steps"] == 0.0 and m_skipped["actor/updates"] == 2.0
    assert m_skipped["actor/lr"] == m_fresh["actor/lr"] == pytest.approx(1e-3 / 4)
    assert any(not torch.equal(start[n], p_skipped[n]) for n in start)
    for name, tensor in p_fresh.items():
        torch.testing.assert_close(p_skipped[name], tensor, rtol=0, atol=1e-7)
    assert skipped.nonfinite_in_a_row == 0


@pytest.mark.usefixtures("process_group")
def test_max_nonfinite_steps_in_a_row_raise_and_a_finite_step_resets_the_count(
    tiny_model_dir: Path,
) -> None:
    trainer = Trainer(
        config(tiny_model_dir, "learner.max_nonfinite_steps=2"),
        rank=0,
        world_size=1,
        backend="gloo",
    )
    before = params(trainer)
    assert trainer.train_step(nan_batch(), policy_version=0)["actor/nonfinite_steps"] == 1.0
    assert (
        trainer.train_step(build_batch(groups(4, seed=1), pad_id=0), policy_version=0)[
            "actor/nonfinite_steps"
        ]
        == 0.0
    )
    trained = params(trainer)
    assert (
        trainer.train_step(nan_batch(), policy_version=0)["actor/nonfinite_steps"] == 1.0
    )  # 1 in a row again
    with pytest.raises(
        NonFiniteTrainingError, match=r"2 training steps in a row .*learner\.max_nonfinite_steps=2"
    ):
        trainer.train_step(nan_batch(), policy_version=0)
    assert_unchanged(trained, params(trainer))  # neither skipped step moved the weights
    assert any(not torch.equal(before[n], trained[n]) for n in before)


@pytest.mark.usefixtures("process_group")
def test_the_loop_publishes_a_skipped_step_as_the_next_version_counts_it_and_stops_after_k(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The simplest correct choice: a skipped step still advances the policy version (versions
    keep matching steps), with the weights unchanged; the K-th in a row publishes nothing."""
    cfg = load_config(
        REPO / "configs" / "tiny.yaml",
        [
            f"output_dir={tmp_path}",
            "eval.every_steps=0",
            "checkpoint.every_steps=0",
            f"model.path={tiny_model_dir}",
            "algorithm.train_batch_groups=4",
            "algorithm.mini_batch_groups=2",
            "learner.max_nonfinite_steps=2",
        ],
    )
    trainer = Trainer(cfg, rank=0, world_size=1, backend="gloo")
    nan_groups = tuple(Picked(f"e{i}", g) for i, g in enumerate(groups(4, reward=NAN)))
    loop, p = rank0(cfg, trainer=trainer, source=FakeSource([]))
    loop.start()
    published = {n: t.clone() for n, t in p["publisher"].weights.items()}
    loop.execute(Train(nan_groups))
    assert loop.progress == Progress(step=1, policy_version=1)
    assert p["publisher"].staged_versions == [0, 1]
    assert_unchanged(published, p["publisher"].weights)
    assert p["control"].counters == {Counter.NONFINITE_STEPS: 1}
    ((_, metrics),) = p["reporter"].reports
    assert metrics["actor/nonfinite_steps"] == 1.0
    with pytest.raises(NonFiniteTrainingError):
        loop.execute(Train(nan_groups))
    assert p["control"].counters == {Counter.NONFINITE_STEPS: 2}  # the last one counted too
    assert p["publisher"].staged_versions == [0, 1]  # nothing published after the error


def test_every_rank_skips_the_update_one_rank_saw_a_nan_loss_in() -> None:
    """2 gloo ranks, a NaN advantage in one row (one rank's loss): both ranks skip that update and
    apply the other, ending where 1 rank does."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        build_model(model_dir)
        results = {}
        for world in (1, 2):
            out = Path(tmp) / f"w{world}.pt"
            launch_ranks(
                str(REPO / "tests" / "learner" / "nonfinite_ranks.py"),
                world,
                str(model_dir),
                str(out),
            )
            results[world] = torch.load(out, weights_only=True)
    for world, r in results.items():
        assert (
            r["metrics"]["actor/skipped_updates"] == 1.0 and r["metrics"]["actor/updates"] == 1.0
        ), world
        assert all(torch.isfinite(t).all() for t in r["after"].values()), world
        assert any(not torch.equal(r["before"][n], r["after"][n]) for n in r["before"]), world
    for name, tensor in results[1]["after"].items():
        torch.testing.assert_close(results[2]["after"][name], tensor, rtol=0, atol=1e-5)
