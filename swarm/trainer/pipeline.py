"""A trainer's view of the model: a chain of remote stages, one server per stage per micro-batch.

:meth:`RemotePipeline.forward_loss` streams int64 tokens ``(B, T+1)`` forward through stages ``0..S-1``
(servers picked by :class:`~swarm.trainer.routing.Router`), the last stage returns the loss and the gradient of
its input, and the gradient flows back through the servers that ran the forward. Any failed call (error reply,
timeout, unreachable peer) backs off from that server (exponentially) and retries the same step on another
server of the stage; a backward retried elsewhere carries the stage inputs so the new server recomputes the
forward (SWARM, sec. 3.2). The trainer keeps every stage input of a micro-batch until its backward is done.
Servers on the run's ban list are never used.

The pipeline owns its stage calls (:meth:`RemotePipeline.call`, each answered with a :class:`StageReply`) and
tells a listener (:class:`PipelineListener`) about them: spot checks (:class:`~swarm.trust.spotcheck.SpotChecker`,
the default; the trainer passes its own), which re-run a sample of the training calls on other servers of the
stage through :meth:`RemotePipeline.call` and refuse the servers that verified evidence convicted.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional, TypeVar

import torch
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from swarm.config import RunSpec
from swarm.net.codecs import ACTIVATION_CODECS, pack_tensors, unpack_tensors
from swarm.net.directory import AsyncRunDirectory, read_period_s, stripes_to_read
from swarm.net.stage_rpc import MAX_WIRE_TENSORS, max_batch, max_message_bytes, stage_stub
from swarm.net.transport import gather, stream_out
from swarm.protocol import BackwardRequest, ForwardRequest, ServerInfo, StageResponse, pack_message, unpack_message
from swarm.trainer.routing import NoServerError, Router
from swarm.trust.spotcheck import SpotChecker

logger = logging.getLogger(__name__)

T = TypeVar("T")

NOT_CACHED = "is not cached here"


class PipelineError(RuntimeError):
    """A micro-batch that failed on every server tried within the attempt budget."""


@dataclass
class StageReply:
    """One stage call as the trainer saw it: the server, the reply, its tensors (decoded), and the wire form of
    what was sent and received (what the server's receipt states, :mod:`swarm.trust.receipts`)."""

    server: ServerInfo
    msg: StageResponse
    tensors: list[torch.Tensor]
    request_wire: list[torch.Tensor]
    reply_wire: list[torch.Tensor]


class PipelineListener:
    """What listens to a pipeline's calls from outside and may refuse servers (the trainer's spot checks,
    :class:`~swarm.trust.spotcheck.SpotChecker`, a pipeline's default). This base listens to nothing and refuses
    no server."""

    def refuses(self, server: ServerInfo) -> bool:
        """Never route to ``server``."""
        return False

    def saw(self, stage: int, servers: list[ServerInfo]) -> None:
        """The records of ``stage``'s servers were just read (banned servers already left out)."""

    def vote(self, peer_id: str) -> float:
        """The weight of ``peer_id``'s record when its stage's records say which servers it excluded
        (:func:`~swarm.trainer.routing.excluded_by_stage`): 1 here, one vote per record."""
        return 1.0

    def forwarded(self, caller: "RemotePipeline", stage: int, request: ForwardRequest, tensors: list[torch.Tensor],
                  reply: StageReply) -> None:
        """A training forward of ``stage`` with ``tensors`` was answered with ``reply``."""

    def backwarded(self, caller: "RemotePipeline", stage: int, mb_id: str, grad: torch.Tensor, inputs: torch.Tensor,
                   reply: StageReply, forward: StageReply) -> None:
        """A backward of ``stage`` (output gradient ``grad``, stage inputs ``inputs``) was answered with ``reply``;
        ``forward`` is the reply to the micro-batch's forward of the stage."""

    async def drain(self) -> None:
        """Wait for work the listener runs beside training."""


class RemotePipeline:
    """Runs micro-batches through the run's stage servers with routing, back-off and retries.

    :param directory: the run's records (the servers of each stage).
    :param bans: the run's ban list (:class:`~swarm.trust.banlist.RunBans`): servers on it are never used.
    :param log: the trainer's log (its retries are logged there).
    :param max_attempts: tries per stage call before the micro-batch fails with :class:`PipelineError`.
    :param refresh_s: seconds between reads of a stage's server records from the DHT while the stage is small
        (default: a sixth of the spec's record TTL, 5 s at 30 s; servers re-announce every third of it, and a failed
        call reads at once); a stage of many servers is read less often, up to every third of the TTL
        (:func:`~swarm.net.directory.read_period_s`).
    :param listener: told of every training call and every read of a stage's records (:class:`PipelineListener`);
        default: spot checks (:class:`~swarm.trust.spotcheck.SpotChecker`), which also keep the pipeline off the
        servers that verified evidence convicted.
    """

    def __init__(self, spec: RunSpec, run_id: str, directory: AsyncRunDirectory, p2p: P2P, *, bans=None, log=None,
                 max_attempts: int = 8, refresh_s: Optional[float] = None,
                 listener: Optional[PipelineListener] = None):
        self.spec, self.run_id, self.directory, self.p2p = spec, run_id, directory, p2p
        self.bans, self.log = bans, log if log is not None else logger
        self.codec = ACTIVATION_CODECS[spec.training.activation_compression]
        self.max_reply_bytes = max_message_bytes(spec)
        self.router = Router(backoff_s=spec.timeouts.backoff_s, backoff_max_s=spec.timeouts.backoff_max_s)
        self.timeouts = spec.timeouts  # forward_s, backward_s: the spec's ceilings until the links are timed
        self.max_attempts = max_attempts
        self.refresh_s = spec.timeouts.record_ttl_s / 6 if refresh_s is None else refresh_s
        self._announce_s = spec.timeouts.record_ttl_s / 3  # (servers re-announce this often)
        self.num_stages = spec.model.num_stages
        self.listener = listener if listener is not None else SpotChecker(spec, run_id, p2p, log=self.log)
        self.router.weight = getattr(self.listener, "vote", None)  # exclusion votes weighed by the checks passed
        self._servers: dict[int, tuple[float, list[ServerInfo]]] = {}
        self._reading: dict[int, asyncio.Task] = {}  # stage -> its records' read in the background
        self._last_read: dict[int, tuple[int, int]] = {}  # stage -> (records, stripes) its last read found / read
        self.failures = 0

    async def servers(self, stage: int, force: bool = False) -> list[ServerInfo]:
        """ServerInfo records of ``stage``, read from the DHT at most every ``refresh_s`` seconds. A read that is due
        runs in the background while callers route with the records they have: a DHT read takes a few round trips
        (0.3 s at 150 ms), which no micro-batch should wait for. The first read, and ``force``, wait for it."""
        cached = self._servers.get(stage)
        if force or cached is None:
            found = await self._read_servers(stage)
        else:
            found = cached[1]
            period = read_period_s(len(cached[1]), self.refresh_s, max(self.refresh_s, self._announce_s))
            if time.monotonic() - cached[0] > period and stage not in self._reading:
                task = self._reading[stage] = asyncio.create_task(self._read_servers(stage))
                task.add_done_callback(functools.partial(self._read_done, stage))
        return [s for s in found if not self.listener.refuses(s)]

    def is_backed_off(self, peer_id: str) -> bool:
        """Whether this pipeline avoids ``peer_id`` now (a call to it failed lately)."""
        return self.router.is_backed_off(peer_id)

    async def _read_servers(self, stage: int) -> list[ServerInfo]:
        """Read ``stage``'s server records: every stripe, or on a large striped stage a random few holding about
        :data:`~swarm.net.directory.ROUTING_SERVERS` of them (:func:`~swarm.net.directory.stripes_to_read`)."""
        stripes = stripes_to_read(*self._last_read.get(stage, (0, 0)), self.directory.stage_stripe_bits)
        found = await self.directory.servers(stage, stripes)
        every = 2 ** self.directory.stage_stripe_bits
        self._last_read[stage] = (len(found), every if stripes is None else len(stripes))
        if self.bans is not None:
            found = [s for s in found if not self.bans.is_banned(s.peer_id)]
        self._servers[stage] = (time.monotonic(), found)
        self.listener.saw(stage, found)
        return found

    def _read_done(self, stage: int, task: asyncio.Task) -> None:
        self._reading.pop(stage, None)
        if not task.cancelled() and task.exception() is not None:
            self.log.warning("reading stage %d's servers failed: %r; the next call reads again", stage,
                             task.exception())

    async def call(self, server: ServerInfo, method: str, message, tensors: list[torch.Tensor],
                   timeout: float) -> StageReply:
        """Call stage RPC ``method`` (``rpc_forward`` or ``rpc_backward``) of ``server`` with ``message`` (a
        :class:`~swarm.protocol.ForwardRequest` or :class:`~swarm.protocol.BackwardRequest`), its float tensors sent
        with this pipeline's activation codec.

        :raises TimeoutError: no reply within ``timeout`` seconds.
        :raises Exception: the server's refusal, hivemind's errors for an unreachable peer, or a malformed reply
            (:class:`~swarm.protocol.ProtocolError`).
        """
        stub = stage_stub(self.p2p, server, self.run_id)
        meta = pack_message(message.model_copy(update={"codec": self.codec}))
        request = pack_tensors(tensors, self.codec)

        async def call():
            responses = await getattr(stub, method)(stream_out(runtime_pb2.ExpertRequest, meta, request))
            reply, out = await gather(responses, self.max_reply_bytes, max_tensors=MAX_WIRE_TENSORS)
            reply = unpack_message(reply, StageResponse)
            return StageReply(server, reply, unpack_tensors(out, reply.codec), request, out)

        return await asyncio.wait_for(call(), timeout)

    async def _on_stage(self, stage: int, work: float, attempt_fn: Callable[[ServerInfo], Awaitable[T]],
                        prefer: Optional[ServerInfo] = None) -> tuple[T, ServerInfo]:
        """Run ``attempt_fn`` on a server of ``stage``, retrying on others; returns ``(result, server)``."""
        last_error: Optional[BaseException] = None
        for attempt in range(self.max_attempts):
            if prefer is not None and not self.router.is_backed_off(prefer.peer_id):
                server, prefer = prefer, None
            else:
                try:
                    server = self.router.choose(await self.servers(stage, force=attempt > 0), work)
                except NoServerError as e:
                    last_error = e
                    await asyncio.sleep(min(1.0 * (attempt + 1), 5.0))
                    continue
            started = time.monotonic()
            try:
                result = await attempt_fn(server)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                last_error = e
                self.failures += 1
                backoff = self.router.report_failure(server.peer_id)
                self.log.warning("stage %d server %s failed (%s: %s); backing off %.0f s, retrying elsewhere",
                                 stage, server.peer_id, type(e).__name__, str(e)[:200], backoff)
                continue
            self.router.report_success(server.peer_id, work, time.monotonic() - started)
            return result, server
        raise PipelineError(f"stage {stage}: {self.max_attempts} attempts failed, last: {last_error}")

    async def forward_loss(self, batch: torch.Tensor, *, train: bool) -> float:
        """Mean loss (nats/token) of int64 tokens ``(B, T+1)``; with ``train`` also backpropagates.

        :raises ValueError: ``batch`` is not int64 ``(B, T+1)`` with ``T >= 1``.
        :raises PipelineError: a stage failed on every server tried.
        """
        if batch.dtype != torch.int64 or batch.dim() != 2 or batch.shape[1] < 2:
            raise ValueError(f"batch must be int64 (B, T+1) token ids, got {batch.dtype} {tuple(batch.shape)}")
        return await self.run(batch[:, :-1].contiguous(), batch[:, 1:].contiguous(), train=train)

    async def run(self, inputs: torch.Tensor, targets: torch.Tensor, *, train: bool) -> float:
        """Forward int64 token ids ``inputs`` ``(B, T)`` through every stage, the last one scoring ``targets``
        ``(B, T)``; with ``train`` the gradient then flows back (:meth:`backward`). Returns the mean loss.

        :raises PipelineError: a stage failed on every server tried.
        """
        mb_id, work, t = uuid.uuid4().hex, float(inputs.shape[0]), self.timeouts
        mode = "train" if train else "eval"
        acts, replies = [inputs], []
        for k in range(self.num_stages - 1):
            meta = ForwardRequest(run_id=self.run_id, stage=k, mb_id=mb_id, mode=mode)

            async def fwd(s: ServerInfo, k=k, meta=meta):
                return await self.call(s, "rpc_forward", meta, [acts[k]], t.forward_s)

            reply, _ = await self._on_stage(k, work, fwd)
            if train:
                self.listener.forwarded(self, k, meta, [acts[k]], reply)
            acts.append(reply.tensors[0])
            replies.append(reply)
        meta = ForwardRequest(run_id=self.run_id, stage=self.num_stages - 1, mb_id=mb_id, mode=mode)

        async def fwd_last(s: ServerInfo):
            reply = await self.call(s, "rpc_forward", meta, [acts[-1], targets], t.forward_s + t.backward_s)
            if reply.msg.loss is None:
                raise PipelineError(f"last-stage server {s.peer_id} returned no loss")
            return reply

        last, _ = await self._on_stage(self.num_stages - 1, work, fwd_last)
        if train:
            self.listener.forwarded(self, self.num_stages - 1, meta, [acts[-1], targets], last)
        grad = last.tensors[0] if last.tensors else None
        if train:
            for k in reversed(range(self.num_stages - 1)):
                reply = await self.backward(k, mb_id, grad, acts[k], replies[k].server)
                self.listener.backwarded(self, k, mb_id, grad, acts[k], reply, replies[k])
                grad = reply.tensors[0] if reply.tensors else None
        return last.msg.loss

    async def backward(self, stage: int, mb_id: str, grad: torch.Tensor, inputs: torch.Tensor,
                       forward_server: ServerInfo) -> StageReply:
        """Send ``grad`` (float32, the gradient of ``stage``'s outputs) back through ``stage``, preferring the
        server that ran its forward (another one recomputes the forward from ``inputs``); the reply's tensors
        are the gradient of the stage's inputs (none for stage 0)."""
        bwd = self._backward_fn(stage, mb_id, grad, inputs, forward_peer=forward_server.peer_id)
        return (await self._on_stage(stage, float(inputs.shape[0]), bwd, prefer=forward_server))[0]

    def _backward_fn(self, stage: int, mb_id: str, grad: torch.Tensor, inputs: torch.Tensor, forward_peer: str):
        t = self.timeouts

        async def bwd(s: ServerInfo):
            resend = s.peer_id != forward_peer  # another server recomputes the forward from the inputs
            try:
                return await self._send_backward(s, stage, mb_id, grad, inputs, with_inputs=resend,
                                                 timeout=t.backward_s)
            except Exception as e:
                if NOT_CACHED not in str(e):
                    raise
                # the server evicted the micro-batch: not its fault; resend with inputs to recompute
                return await self._send_backward(s, stage, mb_id, grad, inputs, with_inputs=True, timeout=t.backward_s)

        return bwd

    async def _send_backward(self, s, stage, mb_id, grad, inputs, *, with_inputs: bool, timeout: float) -> StageReply:
        meta = BackwardRequest(run_id=self.run_id, stage=stage, mb_id=mb_id, with_inputs=with_inputs)
        return await self.call(s, "rpc_backward", meta, [grad, inputs] if with_inputs else [grad], timeout)


def validation_samples(dataset, max_samples: Optional[int] = None) -> int:
    """How many validation samples :func:`validation_loss` scores: the whole split, or its first ``max_samples``."""
    total = dataset.num_samples("val")
    return total if max_samples is None else min(total, max_samples)


async def validation_loss(pipeline: RemotePipeline, dataset, max_samples: Optional[int] = None,
                          batch_size: int = 0) -> float:
    """Mean loss (nats/token) of the swarm's current model over the validation split: all of it, or its first
    ``max_samples`` samples (:func:`validation_samples`), in batches of ``batch_size`` samples (default: the most a
    stage accepts, :func:`~swarm.net.stage_rpc.max_batch`; the last batch may be smaller), each weighted by its
    samples.

    :raises ValueError: no validation sample to score.
    :raises PipelineError: a stage's forward failed on every server tried.
    """
    n = validation_samples(dataset, max_samples)
    if n < 1:
        raise ValueError("the validation split holds no sample; raise data.val_fraction")
    b = batch_size or max_batch(pipeline.spec)
    total = 0.0
    for start in range(0, n, b):
        rows = list(range(start, min(n, start + b)))
        total += len(rows) * await pipeline.forward_loss(dataset.batch(rows, "val"), train=False)
    return total / n


__all__ = ["PipelineError", "PipelineListener", "RemotePipeline", "StageReply", "validation_loss",
           "validation_samples"]
