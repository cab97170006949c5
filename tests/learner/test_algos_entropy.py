"""Chunked entropy and log-probs against torch.distributions.Categorical, values and grads."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch.distributions import Categorical

from learner.algos import entropy_from_logits, log_probs_from_hidden, log_probs_from_logits

B, T, V = 3, 4, 11  # B*T = 12 rows


def _logits(seed: int = 0, dtype: torch.dtype = torch.float64) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(B, T, V, generator=gen)).to(dtype)


def _labels(seed: int = 0) -> Tensor:
    gen = torch.Generator().manual_seed(seed + 100)
    return torch.randint(0, V, (B, T), generator=gen)


@pytest.mark.parametrize("chunk_size", [1, 5, 12, 1024])
def test_entropy_matches_categorical(chunk_size: int) -> None:
    base = _logits()
    weights = torch.randn(B, T, dtype=torch.float64)  # a non-trivial upstream gradient

    ref_in = base.clone().requires_grad_(True)
    ref = Categorical(logits=ref_in).entropy()  # (B, T)
    (ref * weights).sum().backward()

    got_in = base.clone().requires_grad_(True)
    got = entropy_from_logits(got_in, chunk_size=chunk_size)
    (got * weights).sum().backward()

    assert got.shape == (B, T)
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(got_in.grad, ref_in.grad)


@pytest.mark.parametrize("chunk_size", [1, 5, 12, 1024])
def test_log_probs_match_categorical(chunk_size: int) -> None:
    base, labels = _logits(1), _labels(1)
    weights = torch.randn(B, T, dtype=torch.float64)

    ref_in = base.clone().requires_grad_(True)
    ref = Categorical(logits=ref_in).log_prob(labels)  # (B, T)
    (ref * weights).sum().backward()

    got_in = base.clone().requires_grad_(True)
    got = log_probs_from_logits(got_in, labels, chunk_size=chunk_size)
    (got * weights).sum().backward()

    assert got.shape == (B, T)
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(got_in.grad, ref_in.grad)


def test_gradcheck() -> None:
    x = _logits(2)[:, :2, :5].clone().requires_grad_(True)
    labels = _labels(2)[:, :2] % 5
    assert torch.autograd.gradcheck(lambda z: entropy_from_logits(z, chunk_size=4), (x,))
    assert torch.autograd.gradcheck(lambda z: log_probs_from_logits(z, labels, chunk_size=4), (x,))


def test_half_precision_logits_return_float32_and_grad_in_input_dtype() -> None:
    x = _logits(3, torch.bfloat16).requires_grad_(True)
    ent = entropy_from_logits(x, chunk_size=5)
    lp = log_probs_from_logits(x, _labels(3), chunk_size=5)
    assert ent.dtype == torch.float32 and lp.dtype == torch.float32
    (ent.sum() + lp.sum()).backward()
    assert x.grad is not None and x.grad.dtype == torch.bfloat16
    ref = Categorical(logits=x.detach().float()).entropy()
    torch.testing.assert_close(ent, ref)


def test_non_contiguous_logits() -> None:
    base = _logits(4)
    transposed = base.transpose(0, 1).contiguous().transpose(0, 1)  # same values, odd strides
    assert not transposed.is_contiguous()
    torch.testing.assert_close(
        entropy_from_logits(transposed, chunk_size=5), entropy_from_logits(base)
    )


def test_entropy_with_masked_vocabulary_is_finite() -> None:
    x = _logits(5)
    x[..., :3] = float("-inf")
    got = entropy_from_logits(x, chunk_size=5)
    torch.testing.assert_close(got, Categorical(logits=x[..., 3:]).entropy())


def test_no_grad_input_gives_plain_tensor() -> None:
    out = log_probs_from_logits(_logits(), _labels())
    assert not out.requires_grad


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits(_logits(), chunk_size=0)
    with pytest.raises(ValueError, match="B, T, V"):
        entropy_from_logits(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="labels"):
        log_probs_from_logits(_logits(), torch.zeros(B, T + 1, dtype=torch.long))


# --- straight from the hidden states --------------------------------------------------------------
def test_the_fused_head_matches_the_logits_path_values_and_gradients() -> None:
    """log_probs_from_hidden == log_softmax(h W^T / t) gathered, and entropy, with the same
    gradients w.r.t. h and W through both outputs, for chunks that do not divide the rows."""
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(2, 5, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    weights = torch.randn(2, 5, generator=gen, dtype=torch.float64)
    logp, ent = log_probs_from_hidden(h, w, labels, temperature=0.7, chunk_size=3)
    ((logp * weights).sum() + 0.3 * ent.sum()).backward()
    got = (logp.detach(), ent.detach(), h.grad.clone(), w.grad.clone())
    h.grad, w.grad = None, None
    logits = h @ w.T / 0.7
    ref_logp = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    p = torch.softmax(logits, -1)
    ref_ent = -(p * torch.log_softmax(logits, -1)).sum(-1)
    ((ref_logp * weights).sum() + 0.3 * ref_ent.sum()).backward()
    for a, b in zip(got, (ref_logp, ref_ent, h.grad, w.grad), strict=True):
        torch.testing.assert_close(a, b.detach())
    assert torch.autograd.gradcheck(
        lambda x, y: log_probs_from_hidden(x, y, labels, chunk_size=4),
        (h.detach().requires_grad_(), w.detach().requires_grad_()),
    )


def test_the_fused_head_skips_the_entropy_gradient_when_the_loss_does_not_use_it() -> None:
    h = torch.randn(1, 4, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 7, (1, 4))
    logp, _ = log_probs_from_hidden(h, w, labels)
    logp.sum().backward()
    ref = torch.log_softmax(h @ w.T, -1).gather(-1, labels.unsqueeze(-1)).sum()
    g_h, g_w = torch.autograd.grad(ref, (h, w))
    torch.testing.assert_close(h.grad, g_h)
    torch.testing.assert_close(w.grad, g_w)


def test_the_fused_head_sums_the_weight_gradient_of_many_bf16_chunks_in_float32() -> None:
    """In bf16 the chunked head's weight gradient, a sum over chunks, is about as close to a
    float64 reference as the plain path's single matmul; summed in bf16 chunk by chunk it was
    about three times further (its error grows with the number of chunks)."""
    gen = torch.Generator().manual_seed(0)
    n, hidden, vocab = 512, 64, 1000
    h = torch.randn(1, n, hidden, generator=gen, dtype=torch.float64)
    w = 0.1 * torch.randn(vocab, hidden, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, vocab, (1, n), generator=gen)
    upstream = torch.randn(1, n, generator=gen, dtype=torch.float64)

    def weight_grad(dtype: torch.dtype, chunk_size: int | None) -> Tensor:
        weight = w.to(dtype).detach().requires_grad_(True)
        if chunk_size is None:  # the plain path: logits, then log_softmax
            logits = (h.to(dtype) @ weight.T).to(torch.promote_types(dtype, torch.float32))
            logp = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        else:
            logp, _ = log_probs_from_hidden(h.to(dtype), weight, labels, chunk_size=chunk_size)
        (logp * upstream.to(logp.dtype)).sum().backward()
        assert weight.grad is not None and weight.grad.dtype == dtype
        return weight.grad.double()

    ref = weight_grad(torch.float64, None)

    def error(grad: Tensor) -> float:
        return float((grad - ref).norm() / ref.norm())

    plain = error(weight_grad(torch.bfloat16, None))
    chunked = error(weight_grad(torch.bfloat16, 4))  # 128 chunks
    assert chunked < 1.5 * plain, (chunked, plain)
