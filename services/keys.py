"""Every Redis key name the system uses, in one place.

All keys live under a namespace (`queue.namespace`, default `dapo`) so several runs can share a
server. Streams carry whole prompt groups between stages; each has one consumer group named after
the stage that consumes it.
"""

from __future__ import annotations

from dataclasses import dataclass

# Ledger fields: every prompt job issued ends in exactly one of these, or is still in flight.
LEDGER_ISSUED = "issued"
LEDGER_TRAINED = "trained"
LEDGER_FILTERED = "filtered"
LEDGER_STALE = "stale"
LEDGER_DEAD = "dead"
LEDGER_OUTCOMES = (LEDGER_TRAINED, LEDGER_FILTERED, LEDGER_STALE, LEDGER_DEAD)


@dataclass(frozen=True)
class Stage:
    """One hop of the pipeline: the stream it reads and the consumer group reading it."""

    stream: str
    group: str


@dataclass(frozen=True)
class Keys:
    ns: str = "dapo"

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
    def stages(self) -> tuple[Stage, ...]:
        return (self.prompts, self.rollouts, self.scored, self.train)

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
        """Hash: issued / trained / filtered / stale / dead."""
        return self._k("ledger")

    @property
    def counters(self) -> str:
        """Hash of service counters (reward timeouts, gatekeeper kept, dead reasons...)."""
        return self._k("counters")

    @property
    def trained_ids(self) -> str:
        """Set of trained group ids: a group trained twice is detected, counted and reported."""
        return self._k("trained_ids")

    @property
    def policy_version(self) -> str:
        """The learner's current policy version (string int)."""
        return self._k("policy_version")

    @property
    def learner_state(self) -> str:
        """Hash: state, step, updated_at, written by learner rank 0."""
        return self._k("learner", "state")

    @property
    def run_info(self) -> str:
        """Hash written by the learner at start: run_name, started_at, summary fields."""
        return self._k("run")

    def heartbeat(self, kind: str, instance_id: str) -> str:
        """TTL key per live service instance; value is its JSON status."""
        return self._k("hb", kind, instance_id)

    def heartbeat_pattern(self, kind: str = "*") -> str:
        return self._k("hb", kind, "*")

    def final_stats(self, kind: str, instance_id: str) -> str:
        """Hash a service writes as it exits (idle fraction, counts) for the run summary."""
        return self._k("final", kind, instance_id)

    def final_stats_pattern(self, kind: str = "*") -> str:
        return self._k("final", kind, "*")

    @property
    def weight_group(self) -> str:
        """Hash describing the current weight-broadcast group (generation, members, store)."""
        return self._k("weights", "group")

    def weight_join(self, group_key: str) -> str:
        """Set of replica ids ready to join the broadcast group `group_key`."""
        return self._k("weights", "joined", group_key)

    def weight_decision(self, group_key: str) -> str:
        """`go` (everyone joined: build the group) or `abort` for the broadcast group `group_key`."""
        return self._k("weights", "decision", group_key)

    @property
    def control(self) -> str:
        """Hash of operator requests (pause, stop)."""
        return self._k("control")
