"""A stage server: forward/backward RPCs over libp2p, gradient accumulation and the stage's optimizer.

RPCs (streams of ``runtime_pb2.ExpertRequest``, namespace ``<run_id>``; see :mod:`swarm.net.transport`):

* ``rpc_forward`` — :class:`~swarm.protocol.ForwardRequest`. A middle stage returns its outputs and keeps
  the autograd graph for the micro-batch (bounded cache, keyed by caller and micro-batch id). The last stage
  takes targets too, returns the loss and, when training, backpropagates at once and returns the input
  gradient (SWARM, Ryabinin et al. 2023, sec. 3.2: the last stage starts backward).
* ``rpc_backward`` — :class:`~swarm.protocol.BackwardRequest`. Uses the cached graph, or recomputes the
  forward from inputs sent along (a retry on a server that did not run the forward), backpropagates the
  output gradient and returns the input gradient.
* ``rpc_ping`` — :class:`~swarm.protocol.PingRequest`: answers with its epoch, so a peer can tell a live
  server from a stale record (:func:`is_serving`).

A trainer's spot check (:mod:`swarm.trust.spotcheck`) sends a forward with ``mode="check"`` or a backward with
``check`` set: the server answers what a training call would (outputs, loss, input gradient) from the inputs
sent along and keeps nothing (no cache, no gradient accumulated, no samples counted). A server with an identity
signs every forward and backward reply (:class:`~swarm.protocol.StageReceipt`, :mod:`swarm.trust.receipts`), stating
the epoch of the parameters it computed with.

All compute runs on one worker thread, in arrival order. After each backward the micro-batch's parameter
gradients go to the stage's collaborative optimizer with the trainer that sent it
(:meth:`swarm.averaging.optimizer.StageOptimizer.step`), which averages with the other servers of the stage
and steps once per epoch; when an epoch ends the server reports it to its owner (:attr:`StageServer.on_epoch`,
an :class:`EpochEnd`), still on the compute thread, so the owner sees the state right after the step. Bad
requests (wrong shape/dtype/range, NaN/Inf, oversized, other run or protocol version) are refused with an
error naming the cause; they never touch the accumulated gradients. Peers on the run's ban list
(:mod:`swarm.trust.banlist`) are refused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.performance_ema import PerformanceEMA

from swarm.net.admission import PeerAdmission
from swarm.aio import periodic
from swarm.net.codecs import ACTIVATION_CODECS, pack_tensors, unpack_tensors
from swarm.config import RunSpec
from swarm.identity import Identity
from swarm.model import build_stage
from swarm.protocol import (
    BackwardRequest,
    ForwardRequest,
    PingRequest,
    Refusal,
    StageResponse,
    StateDigestRequest,
    pack_message,
    unpack_message,
)
from swarm.trust.receipts import sign_receipt, tensors_digest
from swarm.net.transport import ProtocolServicer, gather, stream_out

logger = logging.getLogger(__name__)


class StageError(RuntimeError, Refusal):
    """A request the stage refuses; the message is returned to the caller."""


@dataclass(frozen=True)
class EpochEnd:
    """An epoch transition of a server, reported on its compute thread right after the optimizer stepped.

    :param epoch: the epoch that just began (the optimizer's epoch now).
    :param loss: mean training loss (nats/token) of the micro-batches of the epoch that ended (last stage), or
        None.
    :param samples: samples this server processed in the epoch that ended.
    :param seconds: the transition itself (matchmaking, all-reduce, optimizer step).
    """

    epoch: int
    loss: Optional[float]
    samples: int
    seconds: float


class StageServer(ProtocolServicer):
    """Serves stage ``stage`` of ``spec``; see the module docstring for the RPCs.

    :param optimizer: the stage's :class:`~swarm.averaging.optimizer.StageOptimizer` (set before serving);
        ``None`` runs forward/backward only (tests of the RPC layer).
    :param bans: the run's ban list (:class:`~swarm.trust.banlist.RunBans`); requests from banned peers are refused.
    :param cache_size: micro-batches whose autograd graph is kept between forward and backward.
    :param identity: signs a receipt for every forward and backward reply (:mod:`swarm.trust.receipts`); None sends
        none (trainers that spot-check treat such a server's sampled replies as unverifiable).
    """

    wire_name = "StageServer"

    def __init__(self, spec: RunSpec, run_id: str, stage: int, module: Optional[torch.nn.Module] = None, *,
                 bans=None, cache_size: int = 16, identity: Optional[Identity] = None):
        self.spec, self.run_id, self.stage, self.identity = spec, run_id, stage, identity
        self.module = module if module is not None else build_stage(spec.model, stage,
                                                                    precision=spec.training.precision)
        self.device = next(self.module.parameters()).device  # the module's: inputs go there, outputs come back
        self.is_last = stage == spec.model.num_stages - 1
        self.optimizer = None
        self.bans = bans
        self.on_epoch: Optional[Callable[[EpochEnd], None]] = None  # the owner's handler (compute thread)
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]] = OrderedDict()
        # results of micro-batches already accumulated: a retried request (the reply was lost) gets the same
        # reply again instead of counting the micro-batch twice
        self._done: OrderedDict[tuple[str, str], tuple[Optional[torch.Tensor], Optional[float]]] = OrderedDict()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"stage{stage}-compute")
        self.throughput = PerformanceEMA(alpha=0.1)
        self.samples = 0
        self.loss_ema: Optional[float] = None
        self.state_digests: dict[int, str] = {}  # epoch -> digest of the full state after its step (recent ones)
        self.rounds, self.round_seconds = 0, 0.0
        self.leaving = False  # paused or draining: new forward/backward requests are refused
        self._epoch_losses: list[float] = []
        self._epoch_samples = 0
        self.max_batch = max_batch(spec)
        self.max_message_bytes = max_message_bytes(spec)
        self.codec = ACTIVATION_CODECS[spec.training.activation_compression]
        self.admission = PeerAdmission()  # requests in flight per peer (swarm.net.admission)

    @property
    def epoch(self) -> int:
        return self.optimizer.epoch if self.optimizer is not None else 0

    # ---- validation --------------------------------------------------------------------------------
    def _check_inputs(self, x: torch.Tensor) -> None:
        try:
            self.module.check_input(x)
        except ValueError as e:
            raise StageError(f"stage {self.stage}: {e}") from None
        if x.shape[0] > self.max_batch:
            raise StageError(f"stage {self.stage}: micro-batch of {x.shape[0]} samples exceeds {self.max_batch}")

    def _check_like(self, name: str, t: torch.Tensor, ref: torch.Tensor) -> None:
        if t.shape != ref.shape or t.dtype != ref.dtype:
            raise StageError(f"stage {self.stage}: {name} must be {ref.dtype} {tuple(ref.shape)}, got {t.dtype} {tuple(t.shape)}")
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise StageError(f"stage {self.stage}: {name} holds NaN or Inf values")

    def _check_request(self, run_id: str, stage: int) -> None:
        if run_id != self.run_id or stage != self.stage:
            raise StageError(f"this server serves run {self.run_id} stage {self.stage}, not run {run_id} stage {stage}")

    # ---- compute (worker thread) -------------------------------------------------------------------
    def _leaf(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (checked, on the CPU) on the module's device, a leaf that collects its gradient if float."""
        x = x.to(self.device)
        return x if x.dtype == torch.int64 else x.detach().requires_grad_(True)

    @staticmethod
    def _host(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """A result for the wire or the averager: on the CPU (no copy if it is there)."""
        return None if t is None else t.detach().cpu()

    def _check_forward(self, x: torch.Tensor, targets: Optional[torch.Tensor]) -> None:
        self._check_inputs(x)
        if self.is_last:
            if targets is None:
                raise StageError("the last stage needs targets (int64, same shape as the token ids)")
            self._check_like("targets", targets, torch.empty(x.shape[:2], dtype=torch.int64))
            if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= self.spec.model.vocab_size):
                raise StageError(f"targets must lie in [0, {self.spec.model.vocab_size})")

    def forward(self, key: tuple[str, str], x: torch.Tensor, targets: Optional[torch.Tensor], train: bool):
        """Run the stage on ``x``. Returns ``(outputs or input grad or None, loss or None)``."""
        self._check_forward(x, targets)
        if not train:
            with torch.no_grad():
                x = x.to(self.device)
                if self.is_last:
                    return None, float(self.module.loss(x, targets.to(self.device)))
                return self._host(self.module(x)), None
        if key in self._done:
            return self._done[key]
        start = time.perf_counter()
        leaf = self._leaf(x)
        with torch.enable_grad():
            if not self.is_last:
                out = self.module(leaf)
                self._remember(key, leaf, out)
                return self._host(out), None
            loss = self.module.loss(leaf, targets.to(self.device))
            if not torch.isfinite(loss):
                raise StageError(f"stage {self.stage}: loss is not finite; the inputs are corrupt")
            loss.backward()
        value = loss.item()
        self.loss_ema = value if self.loss_ema is None else 0.9 * self.loss_ema + 0.1 * value
        self._epoch_losses.append(value)
        grad = self._host(leaf.grad) if leaf.requires_grad else None
        self._accumulate(key[0], x.shape[0], time.perf_counter() - start)
        self._finish(key, (grad, value))
        return grad, value

    def backward(self, key: tuple[str, str], grad_out: torch.Tensor, x: Optional[torch.Tensor]):
        """Backpropagate ``grad_out`` for micro-batch ``key``; returns the input gradient (None for stage 0)."""
        if key in self._done:
            return self._done[key][0]
        start = time.perf_counter()
        entry = self._cache.pop(key, None)
        if entry is not None and entry[2] != self._param_versions():
            # an optimizer step changed the parameters in place since the forward: the saved graph is stale,
            # so recompute the forward from the saved inputs with the current parameters
            x, entry = entry[0].detach(), None
        if entry is None:
            if x is None:
                raise StageError(f"stage {self.stage}: micro-batch {key[1]} is not cached here; resend with inputs")
            self._check_inputs(x)
            leaf = self._leaf(x)
            with torch.enable_grad():
                out = self.module(leaf)
        else:
            leaf, out, _ = entry
        self._check_like("grad_outputs", grad_out, out)
        out.backward(grad_out.to(self.device))
        grad = self._host(leaf.grad) if leaf.requires_grad else None
        self._accumulate(key[0], grad_out.shape[0], time.perf_counter() - start)
        self._finish(key, (grad, None))
        return grad

    def check_forward(self, x: torch.Tensor, targets: Optional[torch.Tensor]):
        """A spot check's forward: what a training forward returns — outputs (middle stage) or the input gradient
        and loss (last stage) — with nothing cached or accumulated. Returns ``(tensor or None, loss or None)``."""
        if not self.is_last:
            return self.forward(("", ""), x, None, train=False)
        self._check_forward(x, targets)
        leaf = self._leaf(x)
        with torch.enable_grad():
            loss = self.module.loss(leaf, targets.to(self.device))
            if not torch.isfinite(loss):
                raise StageError(f"stage {self.stage}: loss is not finite; the inputs are corrupt")
            grad = torch.autograd.grad(loss, leaf)[0] if leaf.requires_grad else None
        return self._host(grad), loss.item()

    def check_backward(self, grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """A spot check's backward: the input gradient for ``grad_out`` recomputed from ``x``, nothing
        accumulated. :raises StageError: stage 0 (its inputs are token ids: it returns nothing to check)."""
        self._check_inputs(x)
        leaf = self._leaf(x)
        if not leaf.requires_grad:
            raise StageError(f"stage {self.stage} takes token ids: its backward returns nothing to check")
        with torch.enable_grad():
            out = self.module(leaf)
            self._check_like("grad_outputs", grad_out, out)
            return self._host(torch.autograd.grad(out, leaf, grad_out.to(self.device))[0])

    def _at_epoch(self, fn, *args):
        """(compute thread) ``(epoch of the parameters fn computes with, fn(*args))``."""
        epoch = self.epoch
        return epoch, fn(*args)

    def _finish(self, key, result) -> None:
        self._done[key] = result
        while len(self._done) > self.cache_size:
            self._done.popitem(last=False)

    def _param_versions(self) -> tuple[int, ...]:
        return tuple(p._version for p in self.module.parameters())

    def _remember(self, key, leaf, out) -> None:
        self._cache[key] = (leaf, out, self._param_versions())
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    def _accumulate(self, trainer: str, batch_size: int, seconds: float) -> None:
        """Count the micro-batch of ``trainer`` and hand its gradients to the optimizer (per-trainer accounts)."""
        self.samples += batch_size
        self._epoch_samples += batch_size
        self.throughput.update(task_size=batch_size, interval=seconds)
        grads = [self._host(p.grad) if p.grad is not None else torch.zeros(p.shape, dtype=p.dtype)
                 for p in self.module.parameters()]
        for p in self.module.parameters():
            p.grad = None
        if self.optimizer is None:
            return
        start = time.perf_counter()
        if self.optimizer.step(grads, batch_size, trainer):
            self._epoch_ended(time.perf_counter() - start)

    def finish_epoch_if_ready(self) -> bool:
        """Join the epoch's averaging round as soon as the stage's servers together reached the target.

        The collaborative optimizer only acts when a micro-batch is handed over, which happens after a
        backward. Without this, a server whose peers already entered the round (their trainers' micro-batches
        waiting on them) would get no work to trigger its own step, and the round would wait for its timeout
        without it. Returns True if an epoch ended.
        """
        if self.optimizer is None:
            return False
        start = time.perf_counter()
        if self.optimizer.finish_epoch_if_ready():
            self._epoch_ended(time.perf_counter() - start)
            return True
        return False

    async def watch_epochs(self, stop: asyncio.Event, period_s: float = 0.25) -> None:
        """Run :meth:`finish_epoch_if_ready` on the compute thread every ``period_s`` seconds until ``stop``."""
        async def tick() -> None:
            await self._compute(self.finish_epoch_if_ready)

        await periodic(stop, period_s, tick, f"stage {self.stage}: finishing an idle epoch", logger)

    @property
    def mean_round_s(self) -> float:
        """Mean seconds of an epoch transition (matchmaking, all-reduce, optimizer step)."""
        return self.round_seconds / self.rounds if self.rounds else 0.0

    def _epoch_ended(self, seconds: float) -> None:
        """(compute thread) Record the transition, then report it to the owner (:attr:`on_epoch`)."""
        self.rounds += 1
        self.round_seconds += seconds
        epoch = self.optimizer.epoch
        losses, self._epoch_losses = self._epoch_losses, []
        samples, self._epoch_samples = self._epoch_samples, 0
        self.state_digests[epoch] = self.optimizer.state_digest()  # stage-mates ask for it (rpc_state_digest)
        for old in sorted(self.state_digests)[:-DIGESTS_KEPT]:
            del self.state_digests[old]
        if self.on_epoch is not None:
            self.on_epoch(EpochEnd(epoch=epoch, loss=sum(losses) / len(losses) if losses else None,
                                   samples=samples, seconds=seconds))

    def recent_digests(self, n: int) -> dict[int, str]:
        """The state digests of this server's last ``n`` epochs (any thread: the dict is copied at once)."""
        held = dict(self.state_digests)  # one C-level copy: the compute thread may add an epoch meanwhile
        return {e: held[e] for e in sorted(held)[-n:]}

    def measure_throughput(self, repeats: int = 2) -> float:
        """Samples/s of forward+backward on a random micro-batch (gradients discarded)."""
        m, b = self.spec.model, self.spec.training.micro_batch_size
        t = self.spec.data.seq_len
        x = torch.randint(0, m.vocab_size, (b, t)) if self.stage == 0 else torch.randn(b, t, m.d_model)
        targets = torch.randint(0, m.vocab_size, (b, t), device=self.device)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            leaf = self._leaf(x)
            out = self.module.loss(leaf, targets) if self.is_last else self.module(leaf).square().mean()
            out.backward()
            out.item()  # waits for the device
            best = min(best, time.perf_counter() - start)
        for p in self.module.parameters():
            p.grad = None
        self.throughput.update(task_size=b, interval=best)
        return b / best

    async def compute(self, fn, *args):
        """Run ``fn(*args)`` on the compute thread, between micro-batches (state changes go through here)."""
        return await self._compute(fn, *args)

    async def _compute(self, fn, *args):
        try:
            future = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        except RuntimeError:  # the pool is shut down: a request that arrived while the server drains
            raise StageError(f"stage {self.stage} server is shutting down; retry on another server") from None
        return await future

    # ---- RPC handlers ------------------------------------------------------------------------------
    def _admit(self, context: P2PContext, mb_id: Optional[str] = None) -> None:
        """Refuse banned peers, and new work while leaving the stage (the backward of a micro-batch whose forward
        ran here, ``mb_id``, is in-flight work and still accepted)."""
        if self.leaving and (mb_id is None or (str(context.remote_id), mb_id) not in self._cache):
            raise StageError(f"stage {self.stage} server is leaving the stage (paused or draining); retry on another "
                             "server")
        reason = self.bans.banned_p2p_ids.get(str(context.remote_id)) if self.bans is not None else None
        if reason is not None:
            raise StageError(f"refused: the run's coordinator banned this peer ({reason})")
        excluded = self.optimizer.trainer_exclusion(str(context.remote_id)) if self.optimizer is not None else None
        if excluded is not None:
            raise StageError(f"refused: this server excluded your gradients ({excluded}); train through other "
                             "servers (their operators can raise averaging.trainer_outlier_ratio)")

    async def _receive(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], cls):
        """Gather a request stream into ``(message, tensors, digest of their wire form)``; refuses other runs,
        stages and versions, and tensors sent with a message that carries none (:class:`PingRequest`, refused at
        the first chunk), streams larger than :func:`max_message_bytes` and streams that take longer than the
        trainer waits for a reply (``timeouts.forward_s`` or ``backward_s``)."""
        timeouts = self.spec.timeouts
        meta, tensors = await gather(requests, self.max_message_bytes, max_tensors=MAX_WIRE_TENSORS if "codec" in
                                     cls.model_fields else 0, deadline_s=max(timeouts.forward_s, timeouts.backward_s))
        req = unpack_message(meta, cls)
        self._check_request(req.run_id, req.stage)
        codec = getattr(req, "codec", None)
        if codec is None:
            if tensors:
                raise StageError(f"a {cls.__name__} carries no tensors, got {len(tensors)}")
            return req, [], ""
        digest = tensors_digest(tensors) if self.identity is not None else ""
        return req, unpack_tensors(tensors, codec), digest

    def _respond(self, tensor: Optional[torch.Tensor], loss: Optional[float] = None, *, epoch: Optional[int] = None,
                 receipt: Optional[dict] = None):
        """The reply stream; with ``receipt`` (``mb_id``, ``call``, ``request_sha256``) and an identity, signed."""
        wire = [] if tensor is None else pack_tensors([tensor], self.codec)
        epoch = self.epoch if epoch is None else epoch
        sealed = b""
        if receipt is not None and self.identity is not None:
            sealed = sign_receipt(self.identity, self.run_id, stage=self.stage, epoch=epoch, loss=loss,
                                  reply_sha256=tensors_digest(wire), time=get_dht_time(), **receipt)
        reply = pack_message(StageResponse(loss=loss, epoch=epoch, codec=self.codec, receipt=sealed))
        return stream_out(runtime_pb2.ExpertResponse, reply, wire)

    async def rpc_forward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        with self.admission.admit(str(context.remote_id)):
            self._admit(context)
            req, tensors, digest = await self._receive(requests, ForwardRequest)
            if len(tensors) != (2 if self.is_last else 1):
                raise StageError(f"stage {self.stage} forward takes "
                                 f"{'inputs and targets' if self.is_last else 'inputs'}")
            targets = tensors[1] if self.is_last else None
            if req.mode == "check":
                epoch, (out, loss) = await self._compute(self._at_epoch, self.check_forward, tensors[0], targets)
            else:
                key = (str(context.remote_id), req.mb_id)
                epoch, (out, loss) = await self._compute(self._at_epoch, self.forward, key, tensors[0], targets,
                                                         req.mode == "train")
            receipt = dict(mb_id=req.mb_id, call="forward", request_sha256=digest)
            async for msg in self._respond(out, loss, epoch=epoch, receipt=receipt):
                yield msg

    async def rpc_backward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        with self.admission.admit(str(context.remote_id)):
            req, tensors, digest = await self._receive(requests, BackwardRequest)
            self._admit(context, req.mb_id)
            if self.is_last:
                raise StageError("the last stage backpropagates inside rpc_forward; do not call rpc_backward on it")
            if len(tensors) != (2 if req.with_inputs else 1):
                raise StageError("backward takes grad_outputs, plus inputs when with_inputs is set")
            if req.check:
                if not req.with_inputs:
                    raise StageError("a check backward recomputes from the inputs: set with_inputs and send them")
                epoch, grad = await self._compute(self._at_epoch, self.check_backward, tensors[0], tensors[1])
            else:
                key = (str(context.remote_id), req.mb_id)
                epoch, grad = await self._compute(self._at_epoch, self.backward, key, tensors[0],
                                                  tensors[1] if req.with_inputs else None)
            receipt = dict(mb_id=req.mb_id, call="backward", request_sha256=digest)
            async for msg in self._respond(grad, epoch=epoch, receipt=receipt):
                yield msg

    async def rpc_ping(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        with self.admission.admit(str(context.remote_id)):
            await self._receive(requests, PingRequest)
            async for msg in self._respond(None):
                yield msg

    async def rpc_state_digest(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """This server's epoch now and the digest of its state at the asked epoch (:class:`StateDigestRequest`)."""
        with self.admission.admit(str(context.remote_id)):
            req, _, _ = await self._receive(requests, StateDigestRequest)
            reply = StageResponse(epoch=self.epoch, state_sha256=self.state_digests.get(req.epoch, ""))
            async for msg in stream_out(runtime_pb2.ExpertResponse, pack_message(reply), []):
                yield msg

    @property
    def in_flight(self) -> int:
        """Micro-batches whose forward ran here and whose backward has not come yet."""
        return len(self._cache)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


DIGESTS_KEPT = 64
"""Epochs whose state digest a server keeps (:attr:`StageServer.state_digests`, asked by ``rpc_state_digest``)."""
MAX_WIRE_TENSORS = 4
"""Most wire tensors in a stage request or reply: two tensors, each at most two on the wire (blockwise 8-bit
sends codes and scales, :mod:`swarm.net.codecs`)."""


def max_batch(spec: RunSpec) -> int:
    """Most samples a stage accepts in one micro-batch: ``8 x micro_batch_size``."""
    return 8 * spec.training.micro_batch_size


def max_message_bytes(spec: RunSpec) -> int:
    """Most tensor bytes a stage request or reply may carry (bytes): two float32 tensors of the largest accepted
    micro-batch (:func:`max_batch` sequences of ``max_seq_len`` tokens, ``d_model`` wide), plus 1 MiB."""
    m = spec.model
    return 2 * max_batch(spec) * m.max_seq_len * max(4 * m.d_model, 8) + (1 << 20)


async def is_serving(p2p, server, run_id: str, timeout: float = 3.0) -> bool:
    """True if ``server`` (a :class:`~swarm.protocol.ServerInfo`) answers ``rpc_ping`` within ``timeout``
    seconds: its record is not a stale one left by a process that died (a restarted peer keeps its peer id
    but gets a new libp2p id)."""
    return await ping_seconds(p2p, server, run_id, timeout) is not None


async def ping_seconds(p2p, server, run_id: str, timeout: float = 3.0) -> Optional[float]:
    """Seconds ``server`` (a :class:`~swarm.protocol.ServerInfo`) took to answer ``rpc_ping`` (a network round
    trip, plus a new connection's handshakes the first time), or None if it did not answer within ``timeout``
    (dead, unreachable, or not serving this stage)."""
    from hivemind.p2p import PeerID

    stub = StageServer.get_stub(p2p, PeerID.from_base58(server.p2p_id), namespace=run_id)
    meta = pack_message(PingRequest(run_id=run_id, stage=server.stage))

    async def call():
        replies = await stub.rpc_ping(stream_out(runtime_pb2.ExpertRequest, meta, []))
        return unpack_message((await gather(replies, max_tensors=0))[0], StageResponse)
    started = time.perf_counter()
    try:
        await asyncio.wait_for(call(), timeout)
        return time.perf_counter() - started
    except Exception as e:  # dead, unreachable, or not serving this stage: all mean "not a source"
        logger.debug("stage %d server %s does not answer rpc_ping: %r", server.stage, server.peer_id, e)
        return None


async def ask_state_digest(p2p, server, run_id: str, epoch: int, timeout: float = 3.0) -> tuple[int, str]:
    """Ask ``server`` (a :class:`~swarm.protocol.ServerInfo`) for its state digest at ``epoch``: returns ``(its
    epoch now, the SHA-256 hex digest or "")``.

    :raises ProtocolError: a malformed reply. :raises TimeoutError: no reply within ``timeout`` seconds.
    :raises Exception: hivemind's errors for an unreachable peer (P2PDaemonError, P2PHandlerError).
    """
    from hivemind.p2p import PeerID

    stub = StageServer.get_stub(p2p, PeerID.from_base58(server.p2p_id), namespace=run_id)
    meta = pack_message(StateDigestRequest(run_id=run_id, stage=server.stage, epoch=epoch))

    async def call() -> StageResponse:
        replies = await stub.rpc_state_digest(stream_out(runtime_pb2.ExpertRequest, meta, []))
        return unpack_message((await gather(replies, max_tensors=0))[0], StageResponse)

    reply = await asyncio.wait_for(call(), timeout)
    return reply.epoch, reply.state_sha256


__all__ = ["EpochEnd", "StageServer", "StageError", "ask_state_digest", "is_serving", "ping_seconds"]
