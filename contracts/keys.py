"""Every Redis key name the system uses, in one place.

All keys live under a namespace (`queue.namespace`, default `dapo`) so several runs can share a
server. Streams carry whole prompt groups between stages; each has one consumer group named after
the stage that consumes it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

NAMESPACE_PATTERN = r"[A-Za-z0-9_.\-]{1,64}"
"""What a namespace may be: no glob character (`*`, `?`, `[`), so a key pattern under it (the
fresh run's SCAN-and-delete of `<ns>:*`, a Redis user's ACL patterns) reaches only its own run."""

# Ledger fields: every prompt job issued ends in exactly one outcome of its lane, or is still in
# flight. Training lane: issued -> trained | filtered | stale | dead. Evaluation lane:
# eval_issued -> evaluated | eval_dead.
LEDGER_ISSUED = "issued"
LEDGER_TRAINED = "trained"
LEDGER_FILTERED = "filtered"
LEDGER_STALE = "stale"
LEDGER_DEAD = "dead"
LEDGER_EVAL_ISSUED = "eval_issued"
LEDGER_EVALUATED = "evaluated"
LEDGER_EVAL_DEAD = "eval_dead"
LEDGER_TRAIN_OUTCOMES = (LEDGER_TRAINED, LEDGER_FILTERED, LEDGER_STALE, LEDGER_DEAD)
LEDGER_EVAL_OUTCOMES = (LEDGER_EVALUATED, LEDGER_EVAL_DEAD)
LEDGER_OUTCOMES = (*LEDGER_TRAIN_OUTCOMES, *LEDGER_EVAL_OUTCOMES)
LEDGER_FIELDS = frozenset({LEDGER_ISSUED, LEDGER_EVAL_ISSUED, *LEDGER_OUTCOMES})
"""Every count the ledger holds."""
LEDGER_DAMAGED = "damaged"
"""Not a count: set once a count in the ledger held a planted value and was restarted, so the
ledger is known not to balance for the rest of the run."""


class Counter(StrEnum):
    """Every counter in the run's counters hash (`Keys.counters`); /status and /metrics show them.

    Counters record events the ledger does not (the ledger counts prompt jobs by outcome).
    """

    GATEKEEPER_KEPT = "gatekeeper_kept"
    """Groups the gatekeeper forwarded to the learner (filtered ones are in the ledger)."""
    RESPONSES_JUDGED = "responses_judged"
    """Training responses the gatekeeper saw, kept or filtered (evaluation excluded)."""
    RESPONSES_TRUNCATED = "responses_truncated"
    """Of those, the ones cut at `rollout.max_response_len`: the run's truncation rate counts
    every generated response, not only the trained ones (dynamic sampling filters some)."""
    DEAD_LETTERS = "dead_letters"
    """Issued work dead-lettered with a reason (also counted `dead` in the ledger)."""
    POISON_MESSAGES = "poison_messages"
    """Entries that were never issued by the feeder (garbage in a stream), dead-lettered."""
    BAD_CONTROL_REQUESTS = "bad_control_requests"
    """Operator requests in the control hash that did not parse; skipped."""
    BAD_REDIS_VALUES = "bad_redis_values"
    """Other values read from Redis that did not parse
    (heartbeats, weight announcements); skipped."""
    REWARD_TIMEOUTS = "reward_timeouts"
    """Responses whose verifier ran past `reward.timeout_s` (scored -1)."""
    TRAINED_TWICE = "trained_twice"
    """A group id trained a second time (must stay 0)."""
    NONFINITE_STEPS = "nonfinite_steps"
    """Training steps that skipped an update because its loss or gradient norm was not finite
    (`learner.max_nonfinite_steps` in a row stop the learner)."""
    RESTORES = "restores"
    """Operator restores of a checkpoint."""
    RESTORES_REFUSED = "restores_refused"
    """Operator restores refused because the checkpoint failed verification (its manifest)."""
    REDIS_DATA_LOSS = "redis_data_loss"
    """Times the learner found Redis had lost the run's state (restart without AOF)."""
    REDIS_OOM_PAUSES = "redis_oom_pauses"
    """Times a client paused because Redis was at maxmemory."""
    WEIGHT_SYNC_FAILURES = "weight_sync_failures"
    """Weight broadcasts that failed (a replica died or hung mid-broadcast)."""
    WEIGHT_SYNC_DROPPED_REPLICAS = "weight_sync_dropped_replicas"
    """Replicas set aside because they did not join a weight sync in time."""
    REPLICA_VERSION_REGRESSIONS = "replica_version_regressions"
    """A replica ended up on an older policy version than it held (must stay 0 in a healthy run)."""
    REPLICA_STORE_CATCH_UPS = "replica_store_catch_ups"
    """Replicas that caught up by loading the newest checkpoint instead of a broadcast."""
    PROMPTS_SKIPPED = "prompts_skipped"
    """Training prompts the feeder passed over without issuing them: their recent groups all
    carried no learning signal (`algorithm.prompt_skip`). Not in the ledger: never issued."""
    ZERO_ADVANTAGE_EASY = "zero_advantage_easy"
    """Training groups the gatekeeper decided carried no learning signal, every response right
    (GRESO's easy zero-variance prompts), counted whether or not the gatekeeper is on: their
    share of the groups decided steers prompt skipping's easy keep probability."""
    ZERO_ADVANTAGE_HARD = "zero_advantage_hard"
    """The other training groups without learning signal (all wrong, in practice): GRESO's hard
    zero-variance prompts, steering the hard keep probability."""
    REPLICA_REFUSED_CHECKPOINTS = "replica_refused_checkpoints"
    """Checkpoints a replica refused to load because their `hf/` export did not match the
    manifest (or had none); each counted once per replica. Must stay 0 in a healthy run."""


def restarts_counter(service: str) -> str:
    """Per-service restart counter written by the supervisor: `restarts:<service>`."""
    return f"restarts:{service}"


class RunField(StrEnum):
    """Fields of the run-info hash (`Keys.run_info`), written by learner rank 0 and the launcher."""

    RUN_NAME = "run_name"
    ALIVE_MARKER = "alive_marker"
    """Written at learner start; its absence later means Redis lost the run's state."""
    DATA_CURSOR = "data_cursor"
    RECENT_PASS_RATE = "recent_pass_rate"
    """JSON: the feeder's moving average of the gatekeeper's pass rate and the counts it has
    seen (`learner.feeder.RecentPassRate`), so a restarted learner admits as the last one did."""
    PROMPT_SKIP = "prompt_skip"
    """JSON: prompt skipping's easy and hard keep probabilities as adapted so far, and where the
    current step's window of decisions starts (`learner.prompt_skip.SkipState`)."""
    EVAL_HISTORY = "eval_history"
    """JSON list of [step, accuracy, RL seconds]."""
    TASK_EVAL_HISTORY = "task_eval_history"
    """JSON list of [step, {task: accuracy}]: each evaluation round's per-task accuracy
    (`task/<name>/eval_acc`), for the API and the run summary."""
    BASE_EVAL_ACC = "base_eval_acc"
    FINAL_EVAL_ACC = "final_eval_acc"
    REDIS_DATA_LOST_AT = "redis_data_lost_at"
    FINISHED = "finished"
    """"1" once the learner completed `total_steps` (not when merely stopped)."""
    STEPS = "steps"
    POLICY_VERSION = "policy_version"
    LEARNER_IDLE_FRACTION = "learner_idle_fraction"
    LEARNER_WALL_S = "learner_wall_s"
    MEAN_VERSION_LAG = "mean_version_lag"
    FINAL_MODEL = "final_model"


@dataclass(frozen=True)
class Stage:
    """One hop of the pipeline: the stream it reads and the consumer group reading it."""

    stream: str
    group: str


@dataclass(frozen=True)
class Keys:
    ns: str = "dapo"

    def __post_init__(self) -> None:
        if not re.fullmatch(NAMESPACE_PATTERN, self.ns):
            raise ValueError(
                f"namespace {self.ns!r}: letters, digits, _ . - only, 1 to 64 characters"
            )

    def _k(self, *parts: str) -> str:
        return ":".join((self.ns, *parts))

    # --- streams, in pipeline order -----------------------------------------------------------
    @property
    def prompts(self) -> Stage:
        """Prompt jobs issued by the learner's feeder; consumed by rollout replicas."""
        return Stage(self._k("stream", "prompts"), "rollout")

    @property
    def rollouts(self) -> Stage:
        """Generated groups; consumed by reward workers."""
        return Stage(self._k("stream", "rollouts"), "reward")

    @property
    def scored(self) -> Stage:
        """Scored groups; consumed by the gatekeeper."""
        return Stage(self._k("stream", "scored"), "gatekeeper")

    @property
    def train(self) -> Stage:
        """Groups kept by dynamic sampling; consumed by the learner."""
        return Stage(self._k("stream", "train"), "learner")

    @property
    def evals(self) -> Stage:
        """Evaluation results (one per eval job, counts only), made by the gatekeeper from scored
        evaluation groups; consumed by learner rank 0, which reports each round once complete."""
        return Stage(self._k("stream", "evals"), "evaluation")

    @property
    def stages(self) -> tuple[Stage, ...]:
        return (self.prompts, self.rollouts, self.scored, self.train, self.evals)

    @property
    def dead(self) -> str:
        """Dead-letter stream: undecodable or repeatedly failing entries, with the reason."""
        return self._k("stream", "dead")

    @property
    def weights(self) -> str:
        """Weight-sync announcements from the learner (read by every replica, no group)."""
        return self._k("stream", "weights")

    @property
    def metrics(self) -> str:
        """Per-step learner metrics (capped), read by the API and `dapo run`'s progress line."""
        return self._k("stream", "metrics")

    # --- counters and state -------------------------------------------------------------------
    @property
    def ledger(self) -> str:
        """Hash: issued / trained / filtered / stale / dead, eval_issued / evaluated / eval_dead."""
        return self._k("ledger")

    @property
    def counters(self) -> str:
        """Hash of `Counter` values (plus `restarts:<service>`)."""
        return self._k("counters")

    @property
    def task_stats(self) -> str:
        """Hash of per-task counts of the training lane, `<task>:<count>` -> int
        (`contracts.tasks.TaskStats`), added to by the gatekeeper as it decides each group."""
        return self._k("task_stats")

    @property
    def prompt_history(self) -> str:
        """String of fixed-width records, one per training prompt: how its groups fared
        (`contracts.bus.prompt_history`), read before issuing it again."""
        return self._k("prompt_history")

    @property
    def trained_ids(self) -> str:
        """Set of trained group ids: a group trained twice is detected, counted and reported."""
        return self._k("trained_ids")

    @property
    def policy_version(self) -> str:
        """The learner's current policy version (string int)."""
        return self._k("policy_version")

    @property
    def learner_lease(self) -> str:
        """The learner lease: the holder's fencing token, with a TTL the holder keeps renewing
        (`contracts.lease`). Only the learner whose token it holds may write."""
        return self._k("learner", "lease")

    @property
    def learner_fence(self) -> str:
        """Counter from which each lease takes its fencing token (tokens only grow)."""
        return self._k("learner", "fence")

    @property
    def learner_state(self) -> str:
        """Hash: state, step, updated_at, written by learner rank 0."""
        return self._k("learner", "state")

    @property
    def run_info(self) -> str:
        """Hash of `RunField` values: run name, data cursor, eval history,
        the end-of-run summary."""
        return self._k("run")

    def heartbeat(self, role: str, instance_id: str) -> str:
        """TTL key per live service instance (one process of a service);
        value is its JSON status."""
        return self._k("hb", role, instance_id)

    def heartbeat_pattern(self, role: str = "*") -> str:
        return self._k("hb", role, "*")

    def consumer_heartbeat(self, consumer: str) -> str:
        """The heartbeat key of the instance reading a stream under the consumer name `consumer`.

        A service reads under its instance id, `<role>-<host>-<pid>` (`runtime.instance_id`, which
        refuses a role with a `-`), and beats under `heartbeat(role, instance id)`, so the role
        is the name up to its first `-`. A consumer name of any other shape (the learner's drain
        reader, a test's) maps to a key nobody writes: to the bus it is a consumer that is gone.
        """
        return self.heartbeat(consumer.split("-", 1)[0], consumer)

    def final_stats(self, role: str, instance_id: str) -> str:
        """Hash a service writes as it exits (idle fraction, counts) for the run summary."""
        return self._k("final", role, instance_id)

    def final_stats_pattern(self, role: str = "*") -> str:
        return self._k("final", role, "*")

    def weight_join(self, group_key: str) -> str:
        """Set of replica ids ready to join the broadcast group `group_key`."""
        return self._k("weights", "joined", group_key)

    def weight_decision(self, group_key: str) -> str:
        """`go` (everyone joined: build the group)
        or `abort` for the broadcast group `group_key`."""
        return self._k("weights", "decision", group_key)

    @property
    def control(self) -> str:
        """Hash of operator requests by kind (pause, checkpoint, restore;
        see schemas.ControlRequest)."""
        return self._k("control")
