"""Local compute kernels for a stage's hot path, each beside the plain-PyTorch reference it must match.

* :mod:`swarm.kernels.cross_entropy` — the last stage's LM head and loss fused, chunked so that the full
  ``(tokens, vocabulary)`` logits never exist (:func:`linear_cross_entropy`; reference
  :func:`linear_cross_entropy_reference`).
"""

from swarm.kernels.cross_entropy import linear_cross_entropy, linear_cross_entropy_reference

__all__ = ["linear_cross_entropy", "linear_cross_entropy_reference"]
