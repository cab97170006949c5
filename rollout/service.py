"""`dapo rollout`: one rollout replica.

Loop: between generation batches, sync weights (`rollout.weight_receiver.WeightReceiver`:
broadcasts, catch-up from the checkpoint store), and between decode steps too (in-flight updates:
a broadcast is taken mid-batch, responses continue under the new weights, and each records the
lowest and highest version that sampled it); take up to `rollout.prompts_per_batch` prompt
jobs; make sure the weights held are at least as new as each job's `policy_version` (waiting for
the learner's catch-up broadcast if not); generate `group_size` responses per job with behaviour
log-probs (an evaluation job: `eval.samples` responses with the eval sampling settings); forward
each group to the rollouts stream with one atomic hop. The heartbeat reports the policy version held
and the idle fraction. On SIGTERM the current batch finishes (a batch is short), unstarted jobs are
handed back, and the process exits.

An evaluation batch takes no in-flight update when the engine receives broadcasts in the
background (the transformers engine): an evaluation round then measures one policy, every token
of its responses comes from the weights held when the batch started, and that version is what its
groups record (it may be newer than the job's `policy_version`). An engine that receives a
broadcast only between its decode steps (vLLM's) would keep the learner's broadcast waiting for
the whole batch (up to `learner.collective_timeout_s`, then a failed broadcast), so its
evaluation batches take updates as training batches do; either way each group records the
lowest and highest version that sampled it, and the learner's round reports that spread
(`eval/policy_version_min`, `eval/policy_version_max`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from contracts.bus import Entry, RunState, Transport
from contracts.config import DapoConfig
from contracts.faults import slowdown
from contracts.model_source import with_local_model
from contracts.runtime import (
    ServiceContext,
    StageLoop,
    StopFlag,
    run_stage_loop,
    serve_stage,
    service_context,
)
from contracts.schemas import (
    PromptJob,
    Response,
    RolloutGroup,
    SchemaError,
    decode_job,
    encode_group,
)
from contracts.signing import weights_public_key
from rollout.engine import BetweenSteps, Engine, eval_seeds, make_engine, seed_name
from rollout.tool_use import ToolBox, generate_with_tools
from rollout.weight_receiver import WeightReceiver

log = logging.getLogger(__name__)

RECLAIM_EVERY_S = 5.0
"""How often the loop takes over prompt jobs left pending by a dead replica."""
IDLE_WAIT_S = 1.0
"""An idle replica wakes when a prompt job or a weight announcement is appended (the watcher
thread rings), and at least this often."""


class RolloutReplica:
    """The replica's loop; everything about its weights is `self.weights` (a WeightReceiver)."""

    def __init__(
        self,
        cfg: DapoConfig,
        engine: Engine,
        replica_id: str,
        stop: StopFlag,
        *,
        transport: Transport,
        run_state: RunState,
        beat_now: Callable[[], None] = lambda: None,
        tools: ToolBox | None = None,
    ) -> None:
        """The parts of the bus a replica touches: `transport` (its prompt jobs in, its groups
        out) and `run_state` (the published policy version, and its weights' announcements)."""
        self.cfg, self.engine, self.id, self.stop = cfg, engine, replica_id, stop
        self.transport, self.run_state = transport, run_state
        self.tools = tools  # `rollout.tools`: multi-turn generation (rollout/tool_use.py)
        # A new policy version is reported at once: the learner's catch-up reads it from heartbeats.
        self.weights = WeightReceiver.from_config(
            cfg,
            run_state,
            engine,
            replica_id,
            stop,
            on_change=beat_now,
            watch_also=(transport.keys.prompts.stream,),
        )
        self.groups_done = 0
        self.busy_s = 0.0
        self._step_at = 0.0  # when the engine's last decode step began (the slowdown fault)
        self.slowdown = slowdown("rollout.slowdown")  # None outside the fault suite
        self._step_hook = self._slowed_between_steps if self.slowdown else self._between_steps
        self.started = time.monotonic()
        self.in_round = False
        """The last batch held evaluation jobs: a round's jobs are appended together, so more of
        it may follow; a background-receiving engine applies no new weights until they stop."""

    @property
    def loop(self) -> StageLoop:
        """Read without blocking, a batch at a time; apply weight updates before each read; when
        there is no job, sleep until a job or a weight announcement is appended."""
        return StageLoop(
            self.transport.keys.prompts,
            batch=self.cfg.rollout.prompts_per_batch,
            block=False,
            reclaim_every_s=RECLAIM_EVERY_S,
            start=self.weights.start,
            before_read=self._sync_before_read,
            idle=self._wait_for_activity,
        )

    def _wait_for_activity(self) -> None:
        self.in_round = False  # nothing left to read: no round of ours is still being served
        self.weights.activity.wait(IDLE_WAIT_S)

    def _sync_before_read(self) -> None:
        self.weights.activity.clear()  # before looking: anything appended from now on rings
        # An evaluation round runs at one policy version: a broadcast received meanwhile waits
        # (in host buffers, costing the learner nothing) until the round's jobs stop coming. A
        # training job that needs newer weights still gets them (`handle`'s `wait_for`).
        if not (self.in_round and self.weights.background):
            self.weights.sync()

    def close(self) -> None:
        if self.tools is not None:
            self.tools.close()
        self.engine.close()

    @property
    def policy_version(self) -> int:
        return self.weights.policy_version

    def status(self) -> dict[str, Any]:
        wall = max(time.monotonic() - self.started, 1e-9)
        sync_s = self.weights.sync_s
        return {
            "policy_version": self.policy_version,
            "groups": self.groups_done,
            "idle_fraction": round(1.0 - (self.busy_s + sync_s) / wall, 4),
            "busy_seconds": round(self.busy_s, 3),
            "sync_seconds": round(sync_s, 3),
        }

    # --- work ------------------------------------------------------------------------------
    def handle(self, entries: list[Entry]) -> None:
        stage = self.transport.keys.prompts
        jobs: list[tuple[str, PromptJob]] = []
        for entry_id, fields in entries:
            try:
                jobs.append((entry_id, decode_job(fields)))
            except SchemaError as exc:
                self.transport.dead_letter(stage, entry_id, fields, f"rollout: {exc}")
        # The learner publishes a version before it issues jobs at it, so a job read here at a
        # version newer than the published one was not issued by the learner: waiting for that
        # version would park this replica for good.
        published, fields_of = self.run_state.published_policy_version(), dict(entries)
        if published is not None:  # None: no valid value to judge by, so none is refused
            for entry_id, job in [(e, j) for e, j in jobs if j.issued_version > published]:
                reason = f"issued at version {job.issued_version}, past the published {published}"
                self.transport.dead_letter(
                    stage, entry_id, fields_of[entry_id], f"rollout: {reason}"
                )
            jobs = [(e, j) for e, j in jobs if j.issued_version <= published]
        if not jobs:
            return
        need = max(job.issued_version for _, job in jobs)
        if not self.weights.wait_for(need):  # stopping: give the work back untouched
            for entry_id, fields in entries:
                self.transport.hand_back(stage, entry_id, fields)
            return
        # Training and evaluation jobs sample differently (group_size vs eval.samples, the eval
        # temperature and top_p): one engine call per kind, each batched.
        for batch in _by_sampling(jobs):
            self._generate(batch)
        self.in_round = any(job.eval is not None for _, job in jobs)

    def _generate(self, jobs: list[tuple[str, PromptJob]]) -> None:
        ro, ev, tag = self.cfg.rollout, self.cfg.eval, jobs[0][1].eval
        n, temperature, top_p = (
            (ro.group_size, ro.temperature, ro.top_p)
            if tag is None
            else (tag.samples, ev.temperature, ev.top_p)
        )
        stage, start, synced, held = (
            self.transport.keys.prompts,
            time.monotonic(),
            self.weights.sync_s,
            self.policy_version,
        )
        self._step_at = start
        # An evaluation measures one policy where holding costs the learner nothing (docstring).
        hold = tag is not None and self.weights.background
        between_steps = self._holding(held) if hold else self._step_hook
        generate = (
            self.engine.generate
            if self.tools is None
            else functools.partial(generate_with_tools, self.engine, self.tools)
        )
        outputs = generate(
            [job.prompt_ids for _, job in jobs],
            n=n,
            max_tokens=ro.max_response_len,
            temperature=temperature,
            top_p=top_p,
            # Paired evaluation: a sample's seed is its problem's and index's, not the replica's.
            seeds=None if tag is None else [_eval_seeds(self.cfg, job) for _, job in jobs],
            between_steps=between_steps,
            stop=ro.stop,
        )
        seconds = time.monotonic() - start
        self.busy_s += seconds - (self.weights.sync_s - synced)  # in-flight syncs count as syncing
        for (entry_id, job), samples in zip(jobs, outputs, strict=True):
            # An engine that did not report versions never called the hook: no weights changed.
            versions = [s.versions or (held, held) for s in samples]
            group = RolloutGroup(
                job=job,
                policy_version=min(oldest for oldest, _ in versions),
                replica_id=self.id,
                gen_seconds=seconds / len(jobs),
                responses=[
                    Response(
                        token_ids=s.token_ids,
                        logprobs=s.logprobs,
                        finish_reason=s.response_finish,
                        versions=v,
                        tool_spans=s.tool_spans,
                        tool_calls=s.tool_calls,
                        tool_errors=s.tool_errors,
                        tool_timeouts=s.tool_timeouts,
                        tool_seconds=s.tool_seconds,
                    )
                    for s, v in zip(samples, versions, strict=True)
                ],
            )
            self.groups_done += self.transport.hop(
                stage,
                entry_id,
                downstream=self.transport.keys.rollouts.stream,
                fields=encode_group(group),
            )

    def _between_steps(self) -> int:
        """The engine's hook between decode steps: in-flight weight updates."""
        return self.weights.between_steps()

    def _slowed_between_steps(self) -> int:
        """The same in the fault suite, each decode step slowed, taking updates while it lasts."""
        assert self.slowdown is not None
        self.slowdown.after(
            time.monotonic() - self._step_at,
            self.stop.event,
            wake=self.weights.announced,
            on_wake=self.weights.between_steps,
        )
        version = self.weights.between_steps()
        self._step_at = time.monotonic()
        return version

    def _holding(self, held: int) -> BetweenSteps:
        """The hook for an evaluation batch: keeps the weights of version `held` (a broadcast
        announced meanwhile is taken after the batch); only the fault suite's slowdown runs."""

        def between_steps() -> int:
            if self.slowdown is not None:
                self.slowdown.after(time.monotonic() - self._step_at, self.stop.event)
                self._step_at = time.monotonic()
            return held

        return between_steps

    def run(self) -> None:
        """The stage loop alone, until asked to stop (tests; a process runs `serve_stage`)."""
        run_stage_loop(self.transport, self.loop, self.handle, queue=self.cfg.queue, stop=self.stop)


def _eval_seeds(cfg: DapoConfig, job: PromptJob) -> list[int]:
    assert job.eval is not None
    return eval_seeds(cfg.eval.seed, job.eval.problem, job.eval.samples)


def _by_sampling(jobs: list[tuple[str, PromptJob]]) -> list[list[tuple[str, PromptJob]]]:
    """Split a batch into runs that sample alike: training jobs, and evaluation jobs per sample
    count."""
    kinds: dict[int | None, list[tuple[str, PromptJob]]] = {}
    for item in jobs:
        kinds.setdefault(None if item[1].eval is None else item[1].eval.samples, []).append(item)
    return list(kinds.values())


def build_replica(cfg: DapoConfig, ctx: ServiceContext) -> RolloutReplica:
    """A rollout replica as every host builds one (`dapo rollout`, which `dapo run`, compose and
    Kubernetes start; Ray Serve's `RolloutHost`): its engine with a seed of its own that survives
    a restart, the tools the config enables, weight swaps that beat at once."""
    weights_public_key()  # only announcements it verifies are taken: refuse to start without it
    log.info("loading %s engine from %s", cfg.rollout.engine, cfg.model.path)
    engine = make_engine(cfg, replica_id=seed_name(ctx.inst))
    tools = None
    if cfg.rollout.tools.enabled:
        from transformers import AutoTokenizer

        tools = ToolBox(cfg.rollout.tools, AutoTokenizer.from_pretrained(cfg.model.path))
        log.info("tools %s in sandboxes (%s)", list(tools.sandboxes), tools.isolation)
    return RolloutReplica(
        cfg,
        engine,
        ctx.inst,
        ctx.stop,
        transport=ctx.bus,
        run_state=ctx.bus,
        beat_now=ctx.beat_now,
        tools=tools,
    )


def main(cfg: DapoConfig) -> int:
    cfg = with_local_model(cfg)  # an hf:// model: its snapshot in the Hugging Face cache
    weights_public_key()  # refuse to start without it, before connecting
    ctx = service_context(cfg, "rollout")
    worker = build_replica(cfg, ctx)
    log.info("rollout replica %s ready", ctx.inst)
    serve_stage(ctx, worker, cfg.queue)
    log.info("rollout replica %s stopped after %d groups", ctx.inst, worker.groups_done)
    return 0
