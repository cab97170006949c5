"""Memory-light token entropy and sampled-token log-probs from logits.

Logits of a long response batch are the largest activation in the learner ([B, T, V] with
V ~ 150k). A plain ``log_softmax`` materialises a second tensor of that size, and autograd
keeps it alive until backward. Here both functions walk over chunks of ``chunk_size`` rows of
the flattened [B*T, V] logits: the forward pass keeps only per-row results ([B*T]), and the
backward pass recomputes each chunk's softmax and writes its gradient straight into the
single [B*T, V] gradient buffer. Extra memory is therefore one chunk's worth, on top of the
logits and their gradient. Each chunk is computed in float32 (float64 logits stay float64)
and results are returned in that dtype, not the logits' dtype: the PPO ratio
``exp(logp - old_logp)`` needs more than bf16's 8 mantissa bits.

`log_probs_from_hidden` goes one step further and never builds the logits at all: it takes the
final hidden states and the output projection, and computes each chunk's logits with one matmul
in the weights' dtype (bf16 on a GPU, as the model's own head would), then that chunk's softmax,
log-probs and entropy in float32. Forward keeps no more than one chunk of logits; backward
recomputes them chunk by chunk and sums the output weight's gradient over the chunks in a
float32 [V, H] buffer, cast once to the weights' dtype (summed in bf16 it would round at every
chunk). The learner's `ResponseHead` uses it, on the response positions only, so the [B, T, V]
logits of a long-response batch never exist.

Not guaranteed: a non-contiguous ``logits`` is copied once by ``reshape``; double backward
(gradient of a gradient) is not supported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = ["entropy_from_logits", "log_probs_from_hidden", "log_probs_from_logits"]


def _row_chunks(n_rows: int, chunk_size: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk_size, n_rows)) for s in range(0, n_rows, chunk_size)]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision logits, float64 kept as is."""
    return torch.promote_types(dtype, torch.float32)


def _finite(z: Tensor) -> Tensor:
    """Replace -inf logits (vocabulary masking) by the lowest finite value, so that
    ``p * z`` is 0 rather than ``0 * -inf = nan`` for impossible tokens."""
    return z.clamp(min=torch.finfo(z.dtype).min)


class _ChunkedEntropy(torch.autograd.Function):
    """H = logsumexp(z) - sum(p * z) per row; dH/dz = -p * (z - sum(p * z)), p = softmax(z)."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, chunk_size: int) -> Tensor:
        # logits: (N, V) -> (N,)
        dtype = _compute_dtype(logits.dtype)
        out = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)  # (N,)
        lse_all = torch.empty_like(out)  # (N,)
        for s, e in _row_chunks(logits.shape[0], chunk_size):
            z = _finite(logits[s:e].to(dtype))  # (c, V)
            lse = torch.logsumexp(z, dim=-1)  # (c,)
            p = (z - lse.unsqueeze(-1)).exp()  # (c, V)
            out[s:e] = lse - (p * z).sum(dim=-1)
            lse_all[s:e] = lse
        ctx.save_for_backward(logits, lse_all)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None]:
        logits, lse_all = ctx.saved_tensors
        dtype = lse_all.dtype
        grad = torch.empty_like(logits)  # (N, V)
        for s, e in _row_chunks(logits.shape[0], ctx.chunk_size):
            z = _finite(logits[s:e].to(dtype))  # (c, V)
            p = (z - lse_all[s:e].unsqueeze(-1)).exp()  # (c, V)
            mean_z = (p * z).sum(dim=-1, keepdim=True)  # (c, 1)
            g = grad_out[s:e].to(dtype).unsqueeze(-1)  # (c, 1)
            grad[s:e] = (-g * p * (z - mean_z)).to(grad.dtype)
        return grad, None


class _ChunkedLogProb(torch.autograd.Function):
    """log p(y) = z_y - logsumexp(z) per row; d/dz = onehot(y) - softmax(z)."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, labels: Tensor, chunk_size: int) -> Tensor:
        # logits: (N, V), labels: (N,) -> (N,)
        dtype = _compute_dtype(logits.dtype)
        out = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)  # (N,)
        lse_all = torch.empty_like(out)  # (N,)
        for s, e in _row_chunks(logits.shape[0], chunk_size):
            z = logits[s:e].to(dtype)  # (c, V)
            lse = torch.logsumexp(z, dim=-1)  # (c,)
            picked = z.gather(-1, labels[s:e].unsqueeze(-1)).squeeze(-1)  # (c,)
            out[s:e] = picked - lse
            lse_all[s:e] = lse
        ctx.save_for_backward(logits, labels, lse_all)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None]:
        logits, labels, lse_all = ctx.saved_tensors
        dtype = lse_all.dtype
        grad = torch.empty_like(logits)  # (N, V)
        for s, e in _row_chunks(logits.shape[0], ctx.chunk_size):
            g = grad_out[s:e].to(dtype).unsqueeze(-1)  # (c, 1)
            p = (logits[s:e].to(dtype) - lse_all[s:e].unsqueeze(-1)).exp()  # (c, V)
            chunk = -g * p  # (c, V)
            chunk.scatter_add_(-1, labels[s:e].unsqueeze(-1), g)
            grad[s:e] = chunk.to(grad.dtype)
        return grad, None, None


class _ChunkedHead(torch.autograd.Function):
    """Log-prob of the label and entropy per row, from hidden states h (N, H) and the output
    projection W (V, H): z = h W^T / t. Gradients: d logp/dz = onehot(y) - p and
    dH/dz = -p (z - sum(p z)) = -p (log p + H); then dh = dz W / t and dW = dz^T h / t, chunk by
    chunk. Each chunk's (c, V) work is done in place where it can be: on a CPU these passes over
    memory cost about as much as the matmuls (issue 39: SmolLM2's head, 185 rows, backward 0.14 s
    before, 0.11 s after, of which 0.07 s matmuls)."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        temperature: float,
        chunk_size: int,
    ) -> tuple[Tensor, Tensor]:
        # hidden: (N, H), weight: (V, H), labels: (N,) -> logp (N,), entropy (N,)
        # The projection runs in the weights' dtype, like the model's own lm_head (bf16 on a GPU);
        # the softmax and everything after it in float32. No float32 copy of W is made.
        dtype = _compute_dtype(hidden.dtype)
        logp = torch.empty(hidden.shape[0], dtype=dtype, device=hidden.device)  # (N,)
        ent, lse_all = torch.empty_like(logp), torch.empty_like(logp)  # (N,)
        for s, e in _row_chunks(hidden.shape[0], chunk_size):
            z = _chunk_logits(hidden[s:e], weight, dtype, temperature)  # (c, V)
            lse = torch.logsumexp(z, dim=-1)  # (c,)
            lse_all[s:e] = lse
            log_p = z.sub_(lse.unsqueeze(-1))  # (c, V): log-softmax, in z's memory
            logp[s:e] = log_p.gather(-1, labels[s:e].unsqueeze(-1)).squeeze(-1)
            ent[s:e] = -(log_p.exp().mul_(log_p)).sum(dim=-1)  # -sum p log p
        # A copy of the entropy (N floats): the output itself may be changed by the caller.
        ctx.save_for_backward(hidden, weight, labels, lse_all, ent.clone())
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None, not zeros
        return logp, ent

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, grad_logp: Tensor | None, grad_ent: Tensor | None
    ) -> tuple[Tensor, Tensor, None, None, None]:
        hidden, weight, labels, lse_all, ent = ctx.saved_tensors
        dtype, t = lse_all.dtype, ctx.temperature
        chunks = _row_chunks(hidden.shape[0], ctx.chunk_size)
        grad_h = torch.empty_like(hidden)  # (N, H)
        # dW is a sum over every chunk: summed in bf16 it rounds at each chunk (about 1e-2
        # relative error against 3e-3 for Linear's single matmul), so it is accumulated in
        # float32 and cast once to the weights' dtype at the end. One chunk needs no buffer: its
        # matmul is Linear's. dh needs no such care: each chunk writes its own rows.
        grad_w = torch.zeros_like(weight, dtype=dtype) if len(chunks) > 1 else None  # (V, H)
        for s, e in chunks:
            h = hidden[s:e]  # (c, H)
            log_p = _chunk_logits(h, weight, dtype, t).sub_(lse_all[s:e].unsqueeze(-1))  # (c, V)
            p = log_p.exp()  # (c, V)
            if grad_ent is not None:  # -g p (log p + H), in log_p's memory
                g = grad_ent[s:e].to(dtype).unsqueeze(-1)  # (c, 1)
                dz = log_p.add_(ent[s:e].unsqueeze(-1)).mul_(p).mul_(-g)
                if grad_logp is not None:
                    dz.addcmul_(p, grad_logp[s:e].to(dtype).unsqueeze(-1), value=-1)
            elif grad_logp is not None:
                dz = p.mul_(-grad_logp[s:e].to(dtype).unsqueeze(-1))
            else:
                dz = p.zero_()
            if grad_logp is not None:
                g = grad_logp[s:e].to(dtype).unsqueeze(-1)  # (c, 1)
                dz.scatter_add_(-1, labels[s:e].unsqueeze(-1), g)
            if t != 1.0:
                dz.div_(t)
            dz = dz.to(weight.dtype)
            grad_h[s:e] = (dz @ weight).to(grad_h.dtype)
            chunk_w = dz.T @ h.to(weight.dtype)  # (V, H)
            if grad_w is None:  # the only chunk
                return grad_h, chunk_w, None, None, None
            grad_w += chunk_w.to(dtype)
        assert grad_w is not None
        return grad_h, grad_w.to(weight.dtype), None, None, None


def _chunk_logits(h: Tensor, weight: Tensor, dtype: torch.dtype, temperature: float) -> Tensor:
    """h W^T / t of one chunk, (c, V) in `dtype`, a new tensor the caller may change in place.
    The matmul runs in the weights' dtype, the rest in `dtype`."""
    z = (h @ weight.T).to(dtype)  # (c, V): a copy, or the matmul's own output
    if temperature != 1.0:
        z.div_(temperature)
    return z.clamp_(min=torch.finfo(z.dtype).min)  # -inf logits (vocabulary masking): `_finite`


# torch types ``Function.apply`` as untyped; these aliases give the calls their real signature.
_entropy_rows: Callable[[Tensor, int], Tensor] = _ChunkedEntropy.apply
_log_prob_rows: Callable[[Tensor, Tensor, int], Tensor] = _ChunkedLogProb.apply
_head_rows: Callable[[Tensor, Tensor, Tensor, float, int], tuple[Tensor, Tensor]] = (
    _ChunkedHead.apply
)


def _check_chunk_size(chunk_size: int) -> None:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def entropy_from_logits(logits: Tensor, *, chunk_size: int = 1024) -> Tensor:
    """Entropy of the softmax distribution at every position; [B, T, V] -> [B, T].

    Differentiable w.r.t. ``logits``. ``chunk_size`` rows of the flattened [B*T, V] logits
    are processed at a time (module docstring).
    """
    _check_chunk_size(chunk_size)
    if logits.ndim != 3:
        raise ValueError(f"logits must be [B, T, V], got {tuple(logits.shape)}")
    b, t, v = logits.shape
    flat = logits.reshape(b * t, v)  # (B*T, V)
    out = _entropy_rows(flat, chunk_size)  # (B*T,)
    return out.view(b, t)


def log_probs_from_logits(logits: Tensor, labels: Tensor, *, chunk_size: int = 1024) -> Tensor:
    """``log_softmax(logits)`` gathered at ``labels``; logits [B, T, V], labels [B, T] -> [B, T].

    Differentiable w.r.t. ``logits``. ``labels`` must be valid token ids in ``[0, V)`` at
    every position, padding included (use the pad token id, then mask the result).
    """
    _check_chunk_size(chunk_size)
    if logits.ndim != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"expected logits [B, T, V] and labels [B, T], got {tuple(logits.shape)} "
            f"and {tuple(labels.shape)}"
        )
    b, t, v = logits.shape
    flat = logits.reshape(b * t, v)  # (B*T, V)
    out = _log_prob_rows(flat, labels.reshape(b * t).long(), chunk_size)  # (B*T,)
    return out.view(b, t)


def log_probs_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[Tensor, Tensor]:
    """(log-prob of ``labels``, entropy) under ``softmax(hidden @ weight.T / temperature)``;
    hidden [B, T, H], weight [V, H], labels [B, T] -> two [B, T] tensors in float32 (or float64).

    Differentiable w.r.t. ``hidden`` and ``weight`` through both outputs; the [B, T, V] logits are
    never built (module docstring). Pass ``chunk_size`` rows such that chunk_size x V floats fit.
    """
    _check_chunk_size(chunk_size)
    if (
        hidden.ndim != 3
        or labels.shape != hidden.shape[:2]
        or weight.ndim != 2
        or weight.shape[1] != hidden.shape[2]
    ):
        raise ValueError(
            "expected hidden [B, T, H], weight [V, H] and labels [B, T], got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)} and {tuple(labels.shape)}"
        )
    b, t, h = hidden.shape
    logp, ent = _head_rows(
        hidden.reshape(b * t, h),
        weight,
        labels.reshape(b * t).long(),
        float(temperature),
        chunk_size,
    )
    return logp.view(b, t), ent.view(b, t)
