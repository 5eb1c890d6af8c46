"""Fused Triton kernels for the stage's hot path, each with its backward (the references are in
:mod:`swarm.kernels.reference`; ``tests/test_kernels.py`` checks them under ``TRITON_INTERPRET=1`` on the CPU).

* LayerNorm and RMSNorm: one program per row computes the statistics in float32 and writes ``y`` and ``rstd``;
  the backward recomputes ``x̂`` from them and writes ``dx``, while each program sums ``dw``/``db`` over its own
  rows into one partial row (summed by torch after), as Liger-Kernel does (Hsu et al., 2024, sec. 3.1).
* bias + GELU (tanh) and SwiGLU: elementwise, forward and backward in one pass each; nothing but the inputs
  is saved for the backward.
* RoPE: the half-split rotation in place of ``cat`` of four products; the backward is the rotation by ``-θ``.
* 8-bit blockwise absmax quantization with error feedback: one program per block, reading ``x`` and the
  residual once and writing codes, scale and the new residual (the ``blockwise8bit`` codec's math).

Every wrapper takes float32 or bfloat16 and returns the input's dtype; the arithmetic is float32.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from swarm.kernels.backend import TorchBackend

NORM_PARTIALS = 64
"""Programs of a norm backward on a CPU (the interpreter): each sums dw/db over its share of the rows. On a GPU,
4 per multiprocessor (:func:`_norm_programs`), as Liger-Kernel's RMSNorm: 64 would leave most of an H200's 132
idle."""


def _norm_programs(n: int, device: torch.device) -> int:
    """Programs of a norm backward over ``n`` rows: enough to fill the GPU, few enough to sum their partials."""
    if device.type != "cuda":
        return min(n, NORM_PARTIALS)
    return min(n, 4 * torch.cuda.get_device_properties(device).multi_processor_count)


def _warps(block: int) -> int:
    """Warps of a program over one row of ``block`` values (Triton's tutorial heuristic, as Liger-Kernel's)."""
    return 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4


@triton.jit
def _tanh(u):
    return 2.0 * tl.sigmoid(2.0 * u) - 1.0


# ---- LayerNorm / RMSNorm ----------------------------------------------------------------------------------
@triton.jit
def _norm_fwd(X, W, B, Y, Mean, Rstd, D, eps, RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(X + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    if RMS:
        mean = tl.sum(x, axis=0) * 0.0
    else:
        mean = tl.sum(x, axis=0) / D
    xc = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / D + eps)
    y = xc * rstd * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * D + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(Mean + row, mean)
    tl.store(Rstd + row, rstd)


@triton.jit
def _norm_bwd(X, W, DY, DX, Mean, Rstd, DW, DB, N, D, rows_per, RMS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, rows_per):
        row = pid * rows_per + i
        m = mask & ((cols * 0 + row) < N)
        x = tl.load(X + row * D + cols, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * D + cols, mask=m, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + row, mask=row < N, other=0.0)
        mean = tl.load(Mean + row, mask=row < N, other=0.0)
        xhat = tl.where(m, (x - mean) * rstd, 0.0)
        wdy = w * dy
        c1 = tl.sum(xhat * wdy, axis=0) / D
        if RMS:
            c2 = c1 * 0.0
        else:
            c2 = tl.sum(wdy, axis=0) / D
        dx = (wdy - xhat * c1 - c2) * rstd
        tl.store(DX + row * D + cols, dx.to(DX.dtype.element_ty), mask=m)
        dw += dy * xhat
        db += dy
    tl.store(DW + pid * D + cols, dw, mask=mask)
    tl.store(DB + pid * D + cols, db, mask=mask)


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms):
        shape, d = x.shape, x.shape[-1]
        x2 = x.reshape(-1, d).contiguous()
        n = x2.shape[0]
        y = torch.empty_like(x2)
        mean = torch.empty(n, dtype=torch.float32, device=x.device)
        rstd = torch.empty_like(mean)
        block = triton.next_power_of_2(d)
        _norm_fwd[(n,)](x2, weight, bias if bias is not None else weight, y, mean, rstd, d, eps,
                        RMS=rms, HAS_BIAS=bias is not None, BLOCK=block, num_warps=_warps(block))
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.rms, ctx.has_bias, ctx.shape = rms, bias is not None, shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, mean, rstd = ctx.saved_tensors
        n, d = x2.shape
        dy2 = dy.reshape(-1, d).contiguous()
        dx = torch.empty_like(x2)
        programs = _norm_programs(n, x2.device)
        rows_per = triton.cdiv(n, programs)
        dw = torch.empty(programs, d, dtype=torch.float32, device=x2.device)
        db = torch.empty_like(dw)
        block = triton.next_power_of_2(d)
        _norm_bwd[(programs,)](x2, weight, dy2, dx, mean, rstd, dw, db, n, d, rows_per, RMS=ctx.rms,
                               BLOCK=block, num_warps=_warps(block))
        grad_b = db.sum(0).to(weight.dtype) if ctx.has_bias else None
        return dx.view(ctx.shape), dw.sum(0).to(weight.dtype), grad_b, None, None


# ---- bias + GELU, SwiGLU --------------------------------------------------------------------------------
@triton.jit
def _gelu_fwd(X, B, Y, N, F, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(B + offs % F, mask=mask, other=0.0).to(tl.float32)
    c = 0.7978845608028654  # sqrt(2/pi): the tanh approximation (Hendrycks and Gimpel, "GELUs", 2016, sec. 2)
    t = _tanh(c * (x + 0.044715 * x * x * x))
    tl.store(Y + offs, (0.5 * x * (1.0 + t)).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_bwd(X, B, DY, DX, N, F, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(B + offs % F, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    c = 0.7978845608028654  # sqrt(2/pi), as in _gelu_fwd
    t = _tanh(c * (x + 0.044715 * x * x * x))
    grad = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x)
    tl.store(DX + offs, (dy * grad).to(DX.dtype.element_ty), mask=mask)


ELEMENTWISE_BLOCK = 1024


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        xc = x.contiguous()
        y = torch.empty_like(xc)
        n, f = xc.numel(), xc.shape[-1]
        _gelu_fwd[(triton.cdiv(n, ELEMENTWISE_BLOCK),)](xc, bias if bias is not None else xc, y, n, f,
                                                        HAS_BIAS=bias is not None, BLOCK=ELEMENTWISE_BLOCK)
        ctx.save_for_backward(xc, bias)
        return y

    @staticmethod
    def backward(ctx, dy):
        xc, bias = ctx.saved_tensors
        dx = torch.empty_like(xc)
        n, f = xc.numel(), xc.shape[-1]
        _gelu_bwd[(triton.cdiv(n, ELEMENTWISE_BLOCK),)](xc, bias if bias is not None else xc, dy.contiguous(), dx,
                                                        n, f, HAS_BIAS=bias is not None, BLOCK=ELEMENTWISE_BLOCK)
        grad_b = dx.reshape(-1, f).float().sum(0).to(bias.dtype) if bias is not None else None
        return dx, grad_b


@triton.jit
def _swiglu_fwd(G, U, Y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, (g * tl.sigmoid(g) * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(G, U, DY, DG, DU, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(DG + offs, (dy * u * s * (1.0 + g * (1.0 - s))).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, (dy * g * s).to(DU.dtype.element_ty), mask=mask)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        g, u = gate.contiguous(), up.contiguous()
        y = torch.empty_like(g)
        _swiglu_fwd[(triton.cdiv(g.numel(), ELEMENTWISE_BLOCK),)](g, u, y, g.numel(), BLOCK=ELEMENTWISE_BLOCK)
        ctx.save_for_backward(g, u)
        return y

    @staticmethod
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        dg, du = torch.empty_like(g), torch.empty_like(u)
        _swiglu_bwd[(triton.cdiv(g.numel(), ELEMENTWISE_BLOCK),)](g, u, dy.contiguous(), dg, du, g.numel(),
                                                                 BLOCK=ELEMENTWISE_BLOCK)
        return dg, du


# ---- RoPE -----------------------------------------------------------------------------------------------
@triton.jit
def _rope_kernel(X, Cos, Sin, Y, T, HALF, SIGN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)  # one (b, h, t) row of Dh = 2 * HALF values
    t = row % T
    cols = tl.arange(0, BLOCK)
    mask = cols < HALF
    x1 = tl.load(X + row * 2 * HALF + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + row * 2 * HALF + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(Cos + t * HALF + cols, mask=mask, other=0.0)
    s = SIGN * tl.load(Sin + t * HALF + cols, mask=mask, other=0.0)
    tl.store(Y + row * 2 * HALF + cols, (x1 * c - x2 * s).to(Y.dtype.element_ty), mask=mask)
    tl.store(Y + row * 2 * HALF + HALF + cols, (x1 * s + x2 * c).to(Y.dtype.element_ty), mask=mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    xc = x.contiguous()
    y = torch.empty_like(xc)
    half = xc.shape[-1] // 2
    _rope_kernel[(xc.numel() // (2 * half),)](xc, cos.contiguous(), sin.contiguous(), y, xc.shape[-2], half,
                                               SIGN=sign, BLOCK=triton.next_power_of_2(half))
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _rotate(dy, cos, sin, -1.0), None, None


# ---- 8-bit blockwise quantization with error feedback -------------------------------------------------
@triton.jit
def _quantize_kernel(X, R, C, S, RO, N, HAS_R: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    v = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_R:
        v += tl.load(R + offs, mask=mask, other=0.0)
    scale = tl.max(tl.abs(v), axis=0)
    inv = tl.where(scale > 0, 127.0 / scale, 0.0)
    q = v * inv
    code = tl.minimum(tl.maximum(tl.where(q >= 0, tl.floor(q + 0.5), -tl.floor(-q + 0.5)), -127.0), 127.0)
    tl.store(C + offs, code.to(tl.int8), mask=mask)
    tl.store(S + pid, scale)
    if HAS_R:
        tl.store(RO + offs, v - code * (scale / 127.0), mask=mask)


def quantize_blockwise(x: torch.Tensor, residual: Optional[torch.Tensor] = None, block: int = 512):
    """:func:`swarm.kernels.reference.quantize_blockwise` in one pass (``block`` a power of two). Rounds half
    away from zero where torch rounds half to even: a value exactly between two codes may differ by one."""
    v = x.detach().reshape(-1).contiguous()
    n = v.numel()
    blocks = triton.cdiv(n, block)
    codes = torch.empty(n, dtype=torch.int8, device=v.device)
    scales = torch.empty(blocks, dtype=torch.float32, device=v.device)
    r = residual.detach().reshape(-1).float().contiguous() if residual is not None else None
    out = torch.empty(n, dtype=torch.float32, device=v.device) if r is not None else None
    _quantize_kernel[(blocks,)](v, r if r is not None else v, codes, scales, out if out is not None else v, n,
                                HAS_R=r is not None, BLOCK=block)
    return codes, scales, out.view(x.shape) if out is not None else None


def fused_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """This module's LayerNorm (as :func:`swarm.kernels.reference.layer_norm`: ``(..., D)`` float32 or bfloat16 in,
    the same shape and dtype out). :class:`TritonBackend` keeps PyTorch's own fused LayerNorm instead (its docstring
    says why); this one is tested and benchmarked beside it."""
    return _Norm.apply(x, weight, bias, eps, False)


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """This module's RMSNorm (as :func:`swarm.kernels.reference.rms_norm`)."""
    return _Norm.apply(x, weight, None, eps, True)


class TritonBackend(TorchBackend):
    """:class:`~swarm.kernels.backend.TorchBackend` with this module's fused kernels (module docstring), except
    LayerNorm: PyTorch's own is already one fused CUDA kernel each way, and on an H200 (float32, 8192 x 2048,
    forward + backward) it took 0.28 ms against 0.64 ms for :func:`fused_layer_norm`, whose backward loops over
    rows inside each program. RMSNorm has no fused PyTorch kernel; :func:`fused_rms_norm` ran 1.24x PyTorch's
    eager RMSNorm and 1.29x ``torch.compile`` of it there (``bench/kernels.py``)."""

    name = "triton"

    def rms_norm(self, x, weight, eps):
        return fused_rms_norm(x, weight, eps)

    def bias_gelu(self, x, bias=None):
        return _BiasGelu.apply(x, bias)

    def swiglu(self, gate, up):
        return _SwiGLU.apply(gate, up)

    def _rope(self, x, cos, sin):
        return _Rope.apply(x, cos, sin)


__all__ = ["TritonBackend", "fused_layer_norm", "fused_rms_norm", "quantize_blockwise"]
