"""Fused linear + cross-entropy for the last stage: the loss of ``x @ weightᵀ`` without the full logits.

An LM head at a 32k vocabulary turns ``N`` tokens of width ``D`` into ``N × V`` logits, and autograd keeps them
and their gradient (``2 × N × V`` floats: at N = 8192, V = 32768 that is 2 GiB in fp32) when the hidden states
and the head are ``(N + V) × D``. :func:`linear_cross_entropy` computes the loss and both gradients chunk by chunk
of rows in the forward pass, so only one chunk's logits ever exist, and the backward only scales the stored
gradients by the incoming one (the loss is a scalar). This is Liger-Kernel's fused linear cross-entropy (Hsu et
al., "Liger Kernel: Efficient Triton Kernels for LLM Training", 2024, sec. 3.4), written in plain PyTorch: the
saving is in memory; the matmuls are the same, in the inputs' dtype. On a 2-core CPU, one thread, bf16, loss and
backward through a 4096 × 192 head (median of 25): 1024 rows (the demo's micro-batch, one chunk) 38.2 ms, the
eager path 37.8; 4096 rows (4 chunks) 145 ms against 250. (It took 49 and 183 ms while it computed the weight's
gradient in float32 and the softmax in separate max, exp, sum and divide passes.)

Chunk size (as Liger): ``N / ceil(V / D)`` rows, rounded up to a power of two, so a chunk's logits take about
as much memory as the hidden states themselves; but at least 16 MiB of logits, below which the CPU is slow.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""Targets with this value contribute neither loss nor gradient (PyTorch's convention)."""


def linear_cross_entropy_reference(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                   ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean cross-entropy (nats/token) of ``x @ weightᵀ`` against ``targets``, through full logits (eager).

    :param x: hidden states ``(N, D)``, float32 or bfloat16.
    :param weight: the LM head ``(V, D)``, the same dtype.
    :param targets: int64 ``(N,)`` in ``[0, V)`` or ``ignore_index``.
    :returns: float32 scalar; the logits are upcast to float32 before the softmax.
    """
    return F.cross_entropy((x @ weight.t()).float(), targets, ignore_index=ignore_index)


MIN_CHUNK_LOGITS = 2 ** 22
"""Fewest logits per chunk (16 MiB in float32): smaller chunks make the CPU's matmuls and the weight gradient's
accumulation slow (at V = 32768, 4096 tokens of width 256 on a 2-core CPU: 32-row chunks took 3.25 s against
the eager 1.55 s, 128-row chunks 1.63 s)."""


def chunk_rows(n: int, v: int, d: int) -> int:
    """Rows per chunk for ``n`` tokens, vocabulary ``v`` and width ``d`` (module docstring): Liger's
    ``n / ceil(v / d)``, at least :data:`MIN_CHUNK_LOGITS` logits, rounded up to a power of two, at most ``n``."""
    rows = max(math.ceil(n / math.ceil(v / d)), MIN_CHUNK_LOGITS // v, 1)
    return min(n, 2 ** math.ceil(math.log2(rows)))


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, ignore_index):
        n, d = x.shape
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = torch.empty_like(x) if want_x else None
        valid = targets != ignore_index
        count = valid.sum().clamp(min=1).float()
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        step = chunk_rows(n, weight.shape[0], d)
        # one chunk: the weight's gradient is one matmul in x's dtype, as autograd's through the full logits; more:
        # each chunk's product (in x's dtype) is summed in float32
        grad_w = None if not want_w or step >= n else torch.zeros(weight.shape, dtype=torch.float32,
                                                                     device=weight.device)
        for a in range(0, n, step):
            xc, tc, vc = x[a:a + step], targets[a:a + step], valid[a:a + step]
            logits = (xc @ weight.t()).float()  # (c, V): the only logits alive at a time
            # PyTorch's fused log-softmax, not max/exp/sum/log passes of our own (3 ms against ~8 at 1024 x 4096)
            log_p = torch.log_softmax(logits, dim=-1)
            del logits
            rows = torch.arange(len(tc), device=x.device)
            total -= log_p[rows, tc.clamp(min=0)].mul_(vc).sum()
            if not (want_x or want_w):
                continue
            # d(mean loss)/d(logits) = (softmax - one_hot(target)) / count on valid rows, 0 on ignored ones; the
            # row scale is applied to the (c, D) matmul operands and results, not to the (c, V) gradient
            g = log_p.exp_()
            g[rows, tc.clamp(min=0)] -= 1.0
            g = g.to(x.dtype)  # the matmuls run in x's dtype (bf16: 2.4x faster than float32 on a CPU with AVX512-BF16)
            scale = (vc.float() / count)[:, None]
            if want_x:
                grad_x[a:a + step] = (g @ weight).float().mul_(scale)
            if want_w:
                part = g.t() @ (xc.float() * scale).to(x.dtype)
                grad_w = part if grad_w is None else grad_w.add_(part)
        ctx.save_for_backward(grad_x, grad_w.to(weight.dtype) if want_w else None)
        return total / count

    @staticmethod
    def backward(ctx, grad_out):
        grad_x, grad_w = ctx.saved_tensors
        return (grad_x * grad_out.to(grad_x.dtype) if grad_x is not None else None,
                grad_w * grad_out.to(grad_w.dtype) if grad_w is not None else None, None, None)


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean cross-entropy (nats/token) of ``x @ weightᵀ`` against ``targets``, never holding all the logits.

    Same arguments and result as :func:`linear_cross_entropy_reference` (differences are float rounding: the
    weight's gradient is summed over chunks in float32); differentiable in ``x`` and ``weight``. Peak extra
    memory is one chunk's float32 logits plus the gradients, instead of two ``(N, V)`` tensors.

    :raises ValueError: shapes or dtypes that do not fit (``x`` not ``(N, D)``, ``weight`` not ``(V, D)`` of
        ``x``'s dtype, ``targets`` not int64 ``(N,)``).
    """
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1] or weight.dtype != x.dtype:
        raise ValueError(f"linear cross-entropy needs x (N, D) and weight (V, D) of one dtype, got {x.dtype}"
                         f"{tuple(x.shape)} and {weight.dtype}{tuple(weight.shape)}")
    if targets.dtype != torch.int64 or targets.shape != x.shape[:1]:
        raise ValueError(f"targets must be int64 ({x.shape[0]},), got {targets.dtype}{tuple(targets.shape)}")
    return _FusedLinearCrossEntropy.apply(x, weight, targets, ignore_index)
