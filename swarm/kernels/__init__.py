"""Local compute kernels for a stage's hot path, each beside the plain-PyTorch reference it must match.

* :mod:`swarm.kernels.backend` — :class:`KernelBackend`, the one interface the model calls (norms, GELU, SwiGLU,
  RoPE, the last stage's head + loss), and its ``torch`` and ``compiled`` backends.
* :mod:`swarm.kernels.selection` — :func:`select_backend`, which picks ``reference``, ``torch``, ``compiled`` or
  ``triton`` for a device (or takes the ``SWARM_KERNELS`` setting).
* :mod:`swarm.kernels.reference` — the references, and the ``blockwise8bit`` codec's quantization.
* :mod:`swarm.kernels.cross_entropy` — the LM head and loss fused, chunked so that the full ``(tokens,
  vocabulary)`` logits never exist (:func:`linear_cross_entropy`; reference
  :func:`linear_cross_entropy_reference`).
* :mod:`swarm.kernels.triton_ops` — the Triton kernels (imported only when the ``triton`` backend is picked).
* :mod:`swarm.kernels.flops` — model FLOPs per token and the device's measured peak, for MFU.
"""

from swarm.kernels.backend import BACKENDS, REFERENCE, CompiledBackend, KernelBackend, TorchBackend
from swarm.kernels.selection import BackendUnavailable, select_backend, triton_usable
from swarm.kernels.cross_entropy import linear_cross_entropy, linear_cross_entropy_reference

__all__ = ["BACKENDS", "REFERENCE", "BackendUnavailable", "CompiledBackend", "KernelBackend", "TorchBackend",
           "linear_cross_entropy", "linear_cross_entropy_reference", "select_backend", "triton_usable"]
