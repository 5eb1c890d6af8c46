"""How a peer picks its kernel backend: per device (``auto``) or a forced name (the ``SWARM_KERNELS`` setting).

The backends themselves are :mod:`swarm.kernels.backend` and, for ``triton``, :mod:`swarm.kernels.triton_ops`
(imported only when picked: Triton is an optional dependency).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

from swarm.kernels.backend import BACKENDS, CompiledBackend, KernelBackend, TorchBackend


class BackendUnavailable(ValueError):
    """A forced backend this peer cannot run (the message names the cause and the fix)."""


def triton_usable(device: torch.device) -> Optional[str]:
    """None if Triton kernels can run on ``device``, else why not (one line)."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton; the CUDA peer image has it)"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"Triton runs on CUDA devices, not {device.type} (TRITON_INTERPRET=1 runs it on the CPU, slowly)"
    return None


def select_backend(choice: str, device: torch.device) -> KernelBackend:
    """The backend ``choice`` (one of :data:`BACKENDS` or ``auto``) for ``device``.

    ``auto``: ``triton`` on a CUDA device with Triton installed, else ``torch``.

    :raises BackendUnavailable: an unknown name, or a forced ``triton`` that cannot run here.
    """
    if choice == "auto":
        choice = "triton" if device.type == "cuda" and triton_usable(device) is None else "torch"
    if choice == "triton":
        why = triton_usable(device)
        if why is not None:
            raise BackendUnavailable(f"kernel backend 'triton' cannot run here: {why}; set SWARM_KERNELS=auto")
        from swarm.kernels.triton_ops import TritonBackend
        return TritonBackend()
    makers = {"reference": KernelBackend, "torch": TorchBackend, "compiled": CompiledBackend}
    if choice not in makers:
        raise BackendUnavailable(f"unknown kernel backend {choice!r}; pick auto or one of {', '.join(BACKENDS)}")
    return makers[choice]()


__all__ = ["BackendUnavailable", "select_backend", "triton_usable"]
