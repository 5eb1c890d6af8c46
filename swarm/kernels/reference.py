"""The plain-PyTorch references of the stage's kernels: what every faster backend must compute.

Each function is differentiable through autograd and works on any device and floating dtype; the fused
backends (:mod:`swarm.kernels.backend`) are tested against these (``tests/test_kernels.py``). The full-logit
linear + cross-entropy reference lives beside its fused version in :mod:`swarm.kernels.cross_entropy`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """LayerNorm over the last dimension (Ba et al., 2016): ``(x - mean) / sqrt(var + eps) * weight + bias``.

    :param x: ``(..., D)`` float32 or bfloat16. :param weight: ``(D,)``. :param bias: ``(D,)`` or None.
    :returns: ``x``'s shape and dtype (statistics computed in float32).
    """
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension (Zhang and Sennrich, 2019, eq. 4): ``x / sqrt(mean(x²) + eps) * weight``.

    :param x: ``(..., D)`` float32 or bfloat16. :param weight: ``(D,)``.
    :returns: ``x``'s shape and dtype (the mean square computed in float32).
    """
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def bias_gelu(x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``gelu(x + bias)`` with the tanh approximation (GPT-2's). :param x: ``(..., F)``; :param bias: ``(F,)``."""
    return F.gelu(x if bias is None else x + bias, approximate="tanh")


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (Shazeer, "GLU Variants Improve Transformer", 2020, eq. 6); two ``(..., F)`` tensors."""
    return F.silu(gate) * up


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal ``softmax(q kᵀ / sqrt(Dh)) v`` of ``(B, H, T, Dh)`` tensors (Vaswani et al., 2017, eq. 1), through
    PyTorch's fused SDPA."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def rope_angles(t: int, dh: int, device: torch.device, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``(cos, sin)`` of shape ``(t, dh / 2)``: position ``i`` times ``theta^(-2j / dh)`` (RoFormer eq. 15)."""
    inv = 1.0 / theta ** (torch.arange(0, dh, 2, device=device, dtype=torch.float32) / dh)
    ang = torch.outer(torch.arange(t, device=device, dtype=torch.float32), inv)
    return ang.cos(), ang.sin()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(B, H, T, Dh)`` by position (Su et al., "RoFormer", 2021, eq. 34; half-split layout: pair
    ``(j, j + Dh/2)``). :param cos: :param sin: float32 ``(T, Dh/2)`` from :func:`rope_angles`."""
    h = x.shape[-1] // 2
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def quantize_blockwise(x: torch.Tensor, residual: Optional[torch.Tensor] = None, block: int = 512
                       ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """8-bit absmax quantization per ``block`` values (the ``blockwise8bit`` wire codec), with error feedback
    (Seide et al., "1-bit SGD", 2014; Karimireddy et al., "Error Feedback Fixes SignSGD", 2019, alg. 2).

    :param x: float, any shape (flattened; a last partial block is its own block).
    :param residual: float32 like ``x``: the error the previous call left, added before quantizing; or None.
    :returns: ``(codes int8 (n,), scales float32 (ceil(n / block),), residual)``: ``code = round(127 v / scale)``
        with ``scale = max|v|`` of the block (``v = x + residual``), and the new float32 residual ``v - decoded``
        shaped like ``x`` (None when ``residual`` is None: no error feedback asked).
    """
    v = x.detach().reshape(-1).float()
    if residual is not None:
        v = v + residual.reshape(-1).float()
    n = v.numel()
    padded = F.pad(v, (0, -n % block)).view(-1, block)
    scales = padded.abs().amax(dim=1)
    inv = torch.where(scales > 0, 127.0 / scales, torch.zeros_like(scales))
    codes = torch.round(padded * inv[:, None]).clamp_(-127, 127).to(torch.int8).reshape(-1)[:n]
    if residual is None:
        return codes, scales, None
    return codes, scales, (v - dequantize_blockwise(codes, scales, block)).view(x.shape)


def dequantize_blockwise(codes: torch.Tensor, scales: torch.Tensor, block: int = 512) -> torch.Tensor:
    """float32 ``(n,)`` values of int8 ``codes`` ``(n,)`` with per-block float32 ``scales`` (the inverse of
    :func:`quantize_blockwise` up to its rounding: at most ``scale / 254`` off per value)."""
    n = codes.numel()
    padded = F.pad(codes.float(), (0, -n % block)).view(-1, block)
    return (padded * (scales / 127.0)[:, None]).reshape(-1)[:n]


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` (any float dtype and shape) is finite: a finite sum says so in one pass
    without a mask (20-40x faster than ``torch.isfinite(t).all()`` on 2e5-2e6 float32 values on one core,
    measured); a sum that is not finite (a NaN or Inf, or finite values whose sum overflows) is checked value by
    value."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


__all__ = ["all_finite", "bias_gelu", "causal_attention", "dequantize_blockwise", "layer_norm", "quantize_blockwise",
           "rms_norm", "rope", "rope_angles", "swiglu"]

