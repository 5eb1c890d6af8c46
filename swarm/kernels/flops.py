"""Model FLOPs of a stage and the device's peak, for model FLOPs utilisation (MFU) per server.

Training FLOPs per token of a stage follow PaLM (Chowdhery et al., 2022, appendix B): ``6 N + 12 L H Q T``, where
``N`` counts the stage's matmul parameters (attention and MLP projections, and the LM head on the last stage,
which Megatron's count includes too: Narayanan et al., 2021, eq. 3; embeddings and norms are lookups and
elementwise work, excluded), ``L`` its blocks, ``H Q = d_model`` and ``T`` the sequence length: the forward's
``2 N`` plus the backward's ``4 N``, and the attention scores and values ``12 L d T`` (the causal mask's skipped
half counted, as PaLM does). These are *model* FLOPs: recomputation (a forward recomputed for a stale
backward, spot checks) is not counted.

The peak is measured, not looked up: square matmuls in the stage's compute dtype on this device, best of a
few (:func:`measure_peak_flops`), cached per device, dtype and thread count in the peer's state folder
(:class:`PeakCache`) so that a restart does not pay it again.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Optional

import torch

from swarm.config import ModelSpec

logger = logging.getLogger(__name__)


def stage_flops_per_token(spec: ModelSpec, stage: Optional[int], seq_len: int) -> float:
    """Training (forward + backward) model FLOPs per token of ``stage`` (``None``: the whole model) at
    ``seq_len`` tokens per sample (module docstring: PaLM appendix B)."""
    start, end = (0, spec.n_layers) if stage is None else spec.layer_range(stage)
    last = stage is None or stage == spec.num_stages - 1
    d, layers = spec.d_model, end - start
    glu = 2 if spec.mlp == "swiglu" else 1
    per_block = 4 * d * d + (glu + 1) * d * spec.ff_size()  # qkv + out projection; MLP in and out
    n = layers * per_block + (spec.vocab_size * d if last else 0)
    return 6.0 * n + 12.0 * layers * d * seq_len


def measure_peak_flops(device: torch.device, dtype: torch.dtype, size: int = 0, repeats: int = 5) -> float:
    """FLOP/s of the best of ``repeats`` ``size``² matmuls (``2 size³`` FLOPs each) in ``dtype`` on ``device``.

    ``size`` 0 picks 1024 on a CPU (~0.1 s each on 2 cores in float32), 8192 on a GPU. A lower bound of the
    device's peak (the vendor's figure assumes perfect kernels); MFU against it reads higher than against the
    datasheet, and says how well the stage uses what this device really does.
    """
    size = size or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    torch.mm(a, b)  # warm-up (threads, kernels, clocks)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size ** 3 / best


class PeakCache:
    """Measured peaks in ``path`` (JSON: ``"<device>|<dtype>|<threads>" -> FLOP/s``); a file that cannot be read
    is measured over, one that cannot be written only logs (the peak is then measured at each start)."""

    def __init__(self, path: Path):
        self.path = path

    def peak(self, device: torch.device, dtype: torch.dtype) -> float:
        """The cached peak for ``device``, ``dtype`` and torch's current thread count, measured if absent."""
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        key = f"{name}|{str(dtype).removeprefix('torch.')}|{torch.get_num_threads()}"
        try:
            known = json.loads(self.path.read_text())
            if not isinstance(known, dict):
                known = {}
        except (OSError, ValueError):
            known = {}
        value = known.get(key)
        if isinstance(value, (int, float)) and value > 0:
            return float(value)
        known[key] = measure_peak_flops(device, dtype)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(known, indent=1))
        except OSError as e:
            logger.info("could not cache the measured peak in %s (%s); it is measured again at the next start",
                        self.path, e)
        return known[key]


def compute_dtype(precision: str) -> torch.dtype:
    """The matmul dtype of a ``training.precision``."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


__all__ = ["PeakCache", "compute_dtype", "measure_peak_flops", "stage_flops_per_token"]
