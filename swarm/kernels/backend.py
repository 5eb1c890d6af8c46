"""Kernel backends: the one interface the model calls for its hot-path ops, and how a peer picks one.

A :class:`KernelBackend` is the plain-PyTorch reference (:mod:`swarm.kernels.reference`, the full-logit loss).
The faster backends compute the same functions within float rounding (``tests/test_kernels.py`` states the
tolerances):

* ``torch`` — the reference ops, and the last stage's head + loss fused and chunked so the ``(tokens,
  vocabulary)`` logits never exist (:func:`~swarm.kernels.cross_entropy.linear_cross_entropy`). The CPU's
  default: on a 2-core CPU ``torch.compile`` of the small ops measured 0.52× (LayerNorm) to 2.5× (RMSNorm) eager
  and the whole bf16 stage 0.93× the ``torch`` backend's tokens/s (``bench/kernels.py``); bf16 autocast
  (``training.precision``) is what speeds a stage up there.
* ``compiled`` — ``torch`` with the norms, activations and RoPE through ``torch.compile`` (Inductor; needs a C++
  compiler on the CPU). Compiles at the first call of each shape family: a server's throughput measurement at
  join pays it (seconds), not a trainer's request.
* ``triton`` — ``torch`` with fused Triton kernels for RMSNorm (forward and backward), bias + GELU, SwiGLU and
  RoPE (:mod:`swarm.kernels.triton_ops`); LayerNorm stays PyTorch's own fused kernel, which measured faster on a
  GPU (``TritonBackend`` says by how much). The CUDA default when Triton is installed; runs on the CPU only under
  ``TRITON_INTERPRET=1`` (slowly: for tests).

:func:`~swarm.kernels.selection.select_backend` picks one per device (``auto``) or takes a forced name (the
``SWARM_KERNELS`` setting).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from swarm.kernels import reference
from swarm.kernels.cross_entropy import linear_cross_entropy, linear_cross_entropy_reference

BACKENDS = ("reference", "torch", "compiled", "triton")
"""Names a peer may force (``SWARM_KERNELS``); ``auto`` picks per device
(:func:`~swarm.kernels.selection.select_backend`)."""


class KernelBackend:
    """The reference backend: every op its plain-PyTorch reference. Subclasses override ops with fused ones.

    Shapes: ``x`` is ``(..., D)`` for norms and activations and ``(B, H, T, Dh)`` for :meth:`rope`; dtypes float32
    or bfloat16 (autocast), results in the input's dtype.
    """

    name = "reference"

    def layer_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float):
        return reference.layer_norm(x, weight, bias, eps)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float):
        return reference.rms_norm(x, weight, eps)

    def bias_gelu(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None):
        return reference.bias_gelu(x, bias)

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor):
        return reference.swiglu(gate, up)

    def rope(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(B, H, T, Dh)`` rotated by position (:func:`~swarm.kernels.reference.rope`)."""
        cos, sin = _angles(x.shape[-2], x.shape[-1], x.device)
        return self._rope(x, cos, sin)

    def _rope(self, x, cos, sin):
        return reference.rope(x, cos, sin)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal scaled dot-product attention of ``(B, H, T, Dh)`` queries, keys and values (PyTorch's SDPA:
        FlashAttention's algorithm where the device has it, Dao et al., 2022)."""
        return reference.causal_attention(q, k, v)

    def linear_cross_entropy(self, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (nats/token, float32 scalar) of ``x (N, D) @ weightᵀ (V, D)`` against
        int64 ``targets (N,)``."""
        return linear_cross_entropy_reference(x, weight, targets)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


@functools.lru_cache(maxsize=16)
def _angles(t: int, dh: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.rope_angles(t, dh, device)


class TorchBackend(KernelBackend):
    """The reference ops with the fused, chunked linear + cross-entropy (module docstring)."""

    name = "torch"

    def attention(self, q, k, v):
        """On a CPU, bfloat16 attention runs in float32: PyTorch's CPU flash attention measured 2.6x slower in
        bfloat16 than in float32 in its backward (``bench/kernels.py``'s stage, 2 cores, AVX512-BF16)."""
        if q.device.type != "cpu" or q.dtype != torch.bfloat16:
            return reference.causal_attention(q, k, v)
        with torch.autocast("cpu", enabled=False):
            return reference.causal_attention(q.float(), k.float(), v.float()).to(q.dtype)

    def linear_cross_entropy(self, x, weight, targets):
        return linear_cross_entropy(x, weight, targets)


class CompiledBackend(TorchBackend):
    """:class:`TorchBackend` with the small ops through ``torch.compile`` (dynamic shapes: one compile per op)."""

    name = "compiled"

    def __init__(self):
        compile_ = functools.partial(torch.compile, dynamic=True)
        self._ops: dict[str, Callable] = {name: compile_(getattr(reference, name))
                                          for name in ("layer_norm", "rms_norm", "bias_gelu", "swiglu", "rope")}

    def layer_norm(self, x, weight, bias, eps):
        return self._ops["layer_norm"](x, weight, bias, eps)

    def rms_norm(self, x, weight, eps):
        return self._ops["rms_norm"](x, weight, eps)

    def bias_gelu(self, x, bias=None):
        return self._ops["bias_gelu"](x, bias)

    def swiglu(self, gate, up):
        return self._ops["swiglu"](gate, up)

    def _rope(self, x, cos, sin):
        return self._ops["rope"](x, cos, sin)


REFERENCE = KernelBackend()
"""The reference backend (stateless; shared)."""

__all__ = ["BACKENDS", "CompiledBackend", "KernelBackend", "REFERENCE", "TorchBackend"]
