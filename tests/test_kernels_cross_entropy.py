"""The fused linear + cross-entropy against its eager reference: loss and both gradients, fp32 and bf16."""

import pytest
import torch

from swarm.kernels import cross_entropy
from swarm.kernels.cross_entropy import (IGNORE_INDEX, chunk_rows, linear_cross_entropy,
                                         linear_cross_entropy_reference)

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-3)}
"""Loss and gradients of the fused path against the reference: float32 rounding only in fp32; in bf16 both round
the matmuls' outputs to bf16, in different orders (the weight's gradient sums chunks in float32)."""


def _case(n, v, d, dtype, seed=0, ignored=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, d, generator=gen) * 2).to(dtype)
    w = (torch.randn(v, d, generator=gen) * 0.05).to(dtype)
    t = torch.randint(0, v, (n,), generator=gen)
    t[:ignored] = IGNORE_INDEX
    return x, w, t


def _loss_and_grads(fn, x, w, t):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fn(x, w, t)
    (loss * 3.0).backward()  # a non-unit incoming gradient: the backward must scale the stored ones
    return loss.detach(), x.grad, w.grad


@pytest.mark.parametrize("rows", [None, 3], ids=["chunks", "3-row-chunks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,v,d,ignored", [(1, 7, 3, 0), (37, 1000, 24, 5), (300, 32768, 16, 7), (64, 33, 128, 64)])
def test_fused_linear_cross_entropy_matches_the_reference(dtype, n, v, d, ignored, rows, monkeypatch):
    """Odd sizes, ignored targets, one row; the chunking as chosen (300 rows at V = 32768: 3 chunks) and forced
    to 3 rows (the last chunk shorter)."""
    if rows:
        monkeypatch.setattr(cross_entropy, "chunk_rows", lambda n, v, d: rows)
    x, w, t = _case(n, v, d, dtype, ignored=min(ignored, n - 1))
    fused = _loss_and_grads(linear_cross_entropy, x, w, t)
    ref = _loss_and_grads(linear_cross_entropy_reference, x, w, t)
    for got, want, name in zip(fused, ref, ("loss", "grad x", "grad weight")):
        assert got.dtype == want.dtype, name
        torch.testing.assert_close(got.float(), want.float(), **TOL[dtype], msg=name)
    if ignored:  # ignored rows get no gradient
        assert not fused[1][: min(ignored, n - 1)].any()


def test_chunks_cover_the_rows_with_logits_about_the_size_of_the_input():
    assert chunk_rows(1, 7, 3) == 1
    assert chunk_rows(8192, 32768, 256) == 128  # Liger's 64 rows, raised to 2**22 logits
    assert chunk_rows(65536, 32768, 64) == 128  # 128 x 32768 logits = 65536 x 64 hidden states
    assert chunk_rows(65536, 32768, 4096) == 8192  # Liger's rule
    assert chunk_rows(10, 100, 1000) == 10  # never more than the rows there are


def test_without_gradients_only_the_loss_is_computed_and_bad_shapes_are_refused():
    x, w, t = _case(20, 50, 8, torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(x, w, t), linear_cross_entropy_reference(x, w, t))
    with pytest.raises(ValueError, match="x \\(N, D\\) and weight \\(V, D\\)"):
        linear_cross_entropy(x, w[:, :4], t)
    with pytest.raises(ValueError, match="targets must be int64"):
        linear_cross_entropy(x, w, t.int())
