"""Gradient compression for intra-stage averaging: compressors with error feedback over the wire codecs.

The codecs themselves (fp32, fp16, 8-bit blockwise) live in :mod:`swarm.net.codecs`, shared with the activation
transport. A :class:`Compressor` decides *what* vectors a peer all-reduces in a round, through
:meth:`Compressor.phases`, a generator that yields one :class:`Phase` per all-reduce and receives its
:class:`PhaseResult`. Elementwise compressors run one phase and keep the per-peer **error feedback**
residual (Seide et al. 2014; Karimireddy et al., "Error Feedback Fixes SignSGD", ICML 2019): what the codec
dropped this round is added to the next round's vector, so the accumulated error stays bounded and the
sum of what was sent tracks the sum of the gradients. :class:`PowerSGD` runs two phases (Vogels et al.,
"PowerSGD", NeurIPS 2019, Algorithm 1, with error feedback): ``P = M Q`` is aggregated and orthonormalised,
then ``Q = Mᵀ P`` (with the small tensors, in fp16) is aggregated; the result is ``P Qᵀ``. :class:`SharedTopK`
runs two phases too: the chunks' scores, then the values of the chunks the aggregated scores rank highest, in
2 to 4 bits (top-k sparsification with error feedback and low-bit values, as SparseLoCo: Sarfi et al. 2025;
with one index set that every peer of the round derives from the same aggregate, so the robust aggregators work
on it unchanged: see ``docs/averaging.md``). :class:`ChunkTopK` is SparseLoCo's own: every peer keeps the
largest values of every chunk and sends them with their positions; reducers aggregate on the union.

The same code runs in the real swarm (:mod:`swarm.averaging.allreduce`) and in the in-process harness of the
benchmarks (``bench/harness.py``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Generator, Sequence

import torch

from swarm.net.codecs import Blockwise8Bit, BlockwiseLowBit, Float16Codec, Float32Codec, SparseLowBit, WireCodec


@dataclass
class Phase:
    """One all-reduce of a round: this peer's float32 ``(numel,)`` vector and the codec for its parts."""

    vector: torch.Tensor
    codec: WireCodec


@dataclass
class PhaseResult:
    """What the all-reduce gave back: the float32 ``(numel,)`` aggregate and the decoded vector this peer sent."""

    aggregate: torch.Tensor
    sent: torch.Tensor


PhaseGenerator = Generator[Phase, PhaseResult, list[torch.Tensor]]


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors into one float32 vector."""
    return torch.cat([t.detach().float().flatten() for t in tensors]) if tensors else torch.zeros(0)


def unflatten(vector: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Cut a vector back into tensors shaped (and typed) like ``like``."""
    out, offset = [], 0
    for t in like:
        out.append(vector[offset:offset + t.numel()].view_as(t).to(t.dtype))
        offset += t.numel()
    return out


class Compressor(ABC):
    """A peer's strategy for averaging a list of tensors; stateful (error feedback), one instance per peer."""

    name: str

    @abstractmethod
    def phases(self, tensors: Sequence[torch.Tensor], seed: int) -> PhaseGenerator:
        """Yield the :class:`Phase` of each all-reduce, receive its :class:`PhaseResult`, return the averaged
        tensors (same shapes and dtypes as ``tensors``). ``seed`` is equal on all peers of the round."""

    def reset(self) -> None:
        """Forget error-feedback state (after this peer's parameters were replaced, e.g. by a state download)."""

    def stateless(self) -> "Compressor":
        """A compressor for the later hops of bounded groups (:mod:`swarm.averaging.groups`), whose input, a block's
        aggregate, is the same on every member of the block: it must encode equal inputs to equal bytes, so it
        keeps no error feedback. Here fp16, one phase; an elementwise compressor keeps its own codec."""
        return ElementwiseCompressor("float16", Float16Codec(), error_feedback=False)


class ElementwiseCompressor(Compressor):
    """One phase through ``codec``; with ``error_feedback`` the codec's error is carried to the next round."""

    def __init__(self, name: str, codec: WireCodec, error_feedback: bool = True):
        self.name, self.codec, self.error_feedback = name, codec, error_feedback
        self.residual: torch.Tensor | None = None

    def phases(self, tensors, seed):
        vector = flatten(tensors)
        if self.error_feedback and self.residual is not None and self.residual.shape == vector.shape:
            vector = vector + self.residual
        result = yield Phase(vector, self.codec)
        if self.error_feedback:
            self.residual = vector - result.sent
        return unflatten(result.aggregate, tensors)

    def reset(self):
        self.residual = None

    def stateless(self) -> "Compressor":
        return ElementwiseCompressor(self.name, self.codec, error_feedback=False)


class PowerSGD(Compressor):
    """Rank-``rank`` PowerSGD with error feedback (Vogels et al. 2019, Algorithm 1 + sec. 3 error feedback).

    A tensor is compressed as a matrix ``(shape[0], numel / shape[0])`` when ``rank * (rows + cols)`` is at most
    half its size; others ("small": biases, norms) travel uncompressed in fp16 in the second phase. ``Q``
    starts from this peer's aggregated ``Q`` of its previous round (warm start, Vogels et al. sec. 3: one power
    iteration per round refines the subspace over rounds), or is drawn from ``seed`` when the peer has none.
    Peers whose ``Q`` differ (a newcomer) still compute a valid result: ``P`` is agreed in the first phase
    and the second computes the mean of ``M_i^T P``, so the output is the mean gradient projected on ``P``.
    Per round and matrix the wire carries ``rank * (rows + cols)`` values in fp16 instead of ``rows * cols``.
    """

    def __init__(self, rank: int = 4):
        if rank < 1:
            raise ValueError("PowerSGD rank must be >= 1")
        self.name, self.rank = f"powersgd{rank}", rank
        self.codec = Float16Codec()
        self.residuals: dict[int, torch.Tensor] = {}
        self.warm_q: dict[int, torch.Tensor] = {}

    def _is_matrix(self, t: torch.Tensor) -> bool:
        if t.dim() < 2:
            return False
        rows, cols = t.shape[0], t.numel() // t.shape[0]
        return self.rank * (rows + cols) * 2 <= rows * cols

    def phases(self, tensors, seed):
        mats, small = [], []
        for i, t in enumerate(tensors):
            (mats if self._is_matrix(t) else small).append(i)
        m = {}
        for i in mats:
            t = tensors[i].detach().float().reshape(tensors[i].shape[0], -1)
            r = self.residuals.get(i)
            m[i] = t + r if r is not None and r.shape == t.shape else t.clone()
        gen = torch.Generator().manual_seed(seed & 0x7FFFFFFF)
        qs = {}
        for i in mats:
            warm = self.warm_q.get(i)
            fresh = torch.randn(m[i].shape[1], self.rank, generator=gen)  # drawn anyway: same stream on every peer
            qs[i] = warm if warm is not None and warm.shape == fresh.shape else fresh
        ps = [m[i] @ qs[i] for i in mats]
        result = yield Phase(flatten(ps), self.codec)
        p_agg = {}
        for i, p in zip(mats, unflatten(result.aggregate, ps)):
            p_agg[i] = torch.linalg.qr(p.float(), mode="reduced").Q  # orthonormal columns (rows, rank)
        q_local = [m[i].T @ p_agg[i] for i in mats]
        small_local = [tensors[i].detach().float() for i in small]
        small_vec = flatten(small_local)
        r_small = self.residuals.get(-1)
        if r_small is not None and r_small.shape == small_vec.shape:
            small_vec = small_vec + r_small
        vector = torch.cat([flatten(q_local), small_vec])
        result = yield Phase(vector, self.codec)
        nq = vector.numel() - small_vec.numel()
        q_agg = unflatten(result.aggregate[:nq], q_local)
        out: list[torch.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
        for i, q_i, q_a in zip(mats, q_local, q_agg):
            self.residuals[i] = m[i] - p_agg[i] @ q_i.T
            self.warm_q[i] = q_a.float().clone()
            out[i] = (p_agg[i] @ q_a.T).reshape(tensors[i].shape).to(tensors[i].dtype)
        self.residuals[-1] = small_vec - result.sent[nq:]
        for i, t in zip(small, unflatten(result.aggregate[nq:], small_local)):
            out[i] = t.view_as(tensors[i]).to(tensors[i].dtype)
        return out

    def reset(self):
        self.residuals.clear()
        self.warm_q.clear()


class _ChunkedWithResidual(Compressor):
    """A compressor that works on ``chunk``-value chunks of the flat vector plus its error-feedback residual."""

    chunk: int
    residual: torch.Tensor | None = None

    def _chunks(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(``v`` = the tensors flattened plus the residual, float32 ``(numel,)``; ``v`` zero-padded to whole
        chunks, ``(ceil(numel / chunk), chunk)``)."""
        v = flatten(tensors)
        if self.residual is not None and self.residual.shape == v.shape:
            v = v + self.residual
        return v, torch.nn.functional.pad(v, (0, -v.numel() % self.chunk)).view(-1, self.chunk)

    def reset(self):
        self.residual = None


class SharedTopK(_ChunkedWithResidual):
    """Top-k chunks with error feedback and ``bits``-bit values, on an index set shared by the round's peers.

    The flat vector ``v`` (the tensors plus this peer's residual, float32 ``(numel,)``) is cut into chunks of
    ``chunk`` values. Phase 1 all-reduces each chunk's RMS (8-bit blockwise, ``numel / chunk`` values), with the
    run's aggregator like any part. Every peer of the round holds the same aggregated scores (the all-reduce is
    bit-identical on honest peers), so each picks the same ``ceil(fraction * chunks)`` highest chunks (ties by
    position). Phase 2 all-reduces ``v`` on those chunks with :class:`~swarm.net.codecs.BlockwiseLowBit` (one scale per
    64 values); the result is the aggregate there and zero elsewhere. What this peer did not send (the other chunks,
    and the rounding of those it sent) stays in its residual for the next round (error feedback: Seide et al.
    2014; Stich et al., "Sparsified SGD with Memory", NeurIPS 2018; SparseLoCo, Sarfi et al. 2025, sec. 3).

    Bytes per round and peer: ``numel / chunk`` scores at ~1 byte plus ``fraction * numel`` values at
    ``bits / 8 + 2 / 64`` bytes, each sent and received about twice (as a sender and as a reducer); with the
    defaults (chunk 256, 1/32, 2 bits) ~0.013 bytes per value, ~300x fewer than fp32. No indices travel.
    """

    def __init__(self, fraction: float = 1 / 32, chunk: int = 256, bits: int = 2):
        if not 0 < fraction <= 1 or chunk < 1 or chunk % 64:
            raise ValueError(f"top-k: fraction {fraction} must be in (0, 1] and chunk {chunk} a multiple of 64")
        self.name, self.fraction, self.chunk = f"topk{bits}bit", fraction, chunk
        self.score_codec, self.value_codec = Blockwise8Bit(), BlockwiseLowBit(bits)
        self.residual: torch.Tensor | None = None

    def phases(self, tensors, seed):
        v, chunks = self._chunks(tensors)
        n = v.numel()
        scores = yield Phase(chunks.pow(2).mean(dim=1).sqrt(), self.score_codec)
        keep = max(1, math.ceil(self.fraction * chunks.shape[0]))
        order = torch.sort(scores.aggregate, descending=True, stable=True).indices[:keep]
        chosen = torch.sort(order).values
        values = yield Phase(chunks[chosen].flatten(), self.value_codec)
        out, sent = torch.zeros_like(chunks), torch.zeros_like(chunks)
        out[chosen] = values.aggregate.view(-1, self.chunk)
        sent[chosen] = values.sent.view(-1, self.chunk)
        self.residual = v - sent.flatten()[:n]
        return unflatten(out.flatten()[:n], tensors)


class ChunkTopK(_ChunkedWithResidual):
    """Per-chunk top-k with error feedback and ``bits``-bit values, positions on the wire (SparseLoCo's
    compressor: Sarfi et al. 2025, sec. 3; top-k with memory: Stich et al., NeurIPS 2018).

    The flat vector ``v`` (the tensors plus this peer's residual, float32 ``(numel,)``) is cut into chunks of
    ``chunk`` values; each peer keeps the ``k = round(fraction * chunk)`` largest magnitudes of every chunk, its
    own choice, and all-reduces that sparse vector in one phase with :class:`~swarm.net.codecs.SparseLowBit`. A reducer
    decodes each peer's part to a dense one (zeros where the peer kept nothing) and aggregates those with the
    run's aggregator, so the result lives on the union of the group's choices. What this peer did not send (the
    other values, the rounding of those it sent) stays in its residual.

    Every chunk sends every round, unlike :class:`SharedTopK`, whose chosen chunks may leave most of the vector
    waiting when rounds are few (outer steps). Bytes per round and peer: as a sender ``fraction * numel`` values
    at ``bits + log2(chunk)`` bits plus 4 bytes per chunk; as a reducer the partition's aggregate, on the union
    of up to ``group size`` choices. SparseLoCo's setting is chunks of 4096 with 1/64 kept at 2 bits.
    """

    def __init__(self, fraction: float = 1 / 32, chunk: int = 256, bits: int = 2):
        if not 0 < fraction <= 1 or not 1 <= chunk <= 65536:
            raise ValueError(f"chunk top-k: fraction {fraction} must be in (0, 1] and chunk {chunk} in 1..65536")
        self.name, self.chunk = f"chunk_topk{bits}bit", chunk
        self.k = max(1, round(fraction * chunk))
        self.codec = SparseLowBit(bits, chunk)
        self.residual: torch.Tensor | None = None

    def phases(self, tensors, seed):
        v, chunks = self._chunks(tensors)
        n = v.numel()
        kept = chunks.abs().topk(self.k, dim=1).indices
        sparse = torch.zeros_like(chunks).scatter_(1, kept, chunks.gather(1, kept))
        result = yield Phase(sparse.flatten()[:n], self.codec)
        self.residual = v - result.sent
        return unflatten(result.aggregate, tensors)


COMPRESSIONS = ("none", "float16", "blockwise8bit", "powersgd", "topk", "chunk_topk")


def make_compressor(name: str, *, rank: int = 4, fraction: float = 1 / 32, chunk: int = 256,
                    bits: int = 2) -> Compressor:
    """Compressor by spec name: ``none`` (fp32, no error needs feeding back), ``float16``, ``blockwise8bit``
    (both with error feedback), ``powersgd`` (of rank ``rank``), ``topk`` (:class:`SharedTopK`) or ``chunk_topk``
    (:class:`ChunkTopK`), both with ``fraction``, ``chunk`` and ``bits``. Raises ValueError for other names or
    settings."""
    if name == "none":
        return ElementwiseCompressor("none", Float32Codec(), error_feedback=False)
    if name == "float16":
        return ElementwiseCompressor("float16", Float16Codec())
    if name == "blockwise8bit":
        return ElementwiseCompressor("blockwise8bit", Blockwise8Bit())
    if name == "powersgd":
        return PowerSGD(rank)
    if name == "topk":
        return SharedTopK(fraction, chunk, bits)
    if name == "chunk_topk":
        return ChunkTopK(fraction, chunk, bits)
    raise ValueError(f"unknown compression {name!r}; choose one of {list(COMPRESSIONS)}")


def spec_compressor(avg) -> Compressor:
    """The compressor a run spec's ``[averaging]`` section (:class:`~swarm.config.AveragingSpec`) names."""
    return make_compressor(avg.compression, rank=avg.powersgd_rank, fraction=avg.topk_fraction, chunk=avg.topk_chunk,
                           bits=avg.topk_bits)


def run_locally(compressor: Compressor, tensors: Sequence[torch.Tensor], seed: int = 0) -> list[torch.Tensor]:
    """Drive ``compressor`` through a round with itself as the only peer (aggregate = what it sent).

    The reference for what one peer's compression does to its tensors, used by tests and benchmarks.
    """
    gen = compressor.phases(tensors, seed)
    phase = next(gen)
    while True:
        sent = phase.codec.roundtrip(phase.vector)
        try:
            phase = gen.send(PhaseResult(aggregate=sent, sent=sent))
        except StopIteration as stop:
            return stop.value
