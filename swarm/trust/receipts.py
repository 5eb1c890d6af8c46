"""Stage receipts: what a stage server signs for every reply, so a trainer's spot check yields evidence.

A receipt (:class:`~swarm.protocol.StageReceipt`) binds a server's key to ``(stage, epoch, mb_id, call,
SHA-256 of the request tensors, SHA-256 of the reply tensors, loss)``. The digests are taken over the tensors'
*wire form* (the codec's encoded tensors: dtype, shape, bytes; :func:`tensors_digest`), which the server and
the trainer both hold bit for bit, so a trainer checks a receipt against what it sent and received without
re-encoding anything. Signing costs one SHA-256 pass over the reply and one Ed25519 signature (~50 µs).
"""

from __future__ import annotations

import hashlib
import struct
from typing import Optional, Sequence

import torch

from swarm.identity import Identity
from swarm.protocol import ProtocolError, StageReceipt, open_record, seal


def tensors_digest(tensors: Sequence[torch.Tensor]) -> str:
    """Hex SHA-256 of wire tensors (as :func:`~swarm.net.codecs.pack_tensors` makes them) in order: each one's
    dtype, shape and bytes, length-prefixed (two lists hash equal only if every tensor is equal bit for bit)."""
    h = hashlib.sha256(struct.pack("<I", len(tensors)))
    for t in tensors:
        dtype = str(t.dtype).encode()
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        h.update(struct.pack("<II", len(dtype), t.dim()))
        h.update(dtype)
        h.update(struct.pack(f"<{t.dim()}q", *t.shape))
        h.update(struct.pack("<Q", data.nbytes))
        h.update(data)
    return h.hexdigest()


def sign_receipt(identity: Identity, run_id: str, *, stage: int, epoch: int, mb_id: str, call: str,
                 request_sha256: str, reply_sha256: str, loss: Optional[float], time: float,
                 synced: bool = True) -> bytes:
    """The sealed :class:`~swarm.protocol.StageReceipt` of one reply, signed by ``identity`` (bytes, < 1 KB)."""
    receipt = StageReceipt(run_id=run_id, peer_id=identity.peer_id, time=time, p2p_id=identity.p2p_id, stage=stage,
                           epoch=epoch, synced=synced, mb_id=mb_id, call=call, request_sha256=request_sha256,
                           reply_sha256=reply_sha256, loss=loss)
    return seal(receipt, identity)


def check_receipt(sealed: bytes, run_id: str, *, p2p_id: str, stage: int, mb_id: str, call: str,
                  request_sha256: str, reply_sha256: str, loss: Optional[float]) -> StageReceipt:
    """Open a server's receipt and check that it states exactly the reply the caller got.

    :param p2p_id: the libp2p id the caller sent the request to (the receipt's signer must own it).
    :returns: the receipt (its ``epoch`` says which parameters the server claims it used).
    :raises ProtocolError: missing, forged, or stating another request, reply or loss than the caller's.
    """
    if not sealed:
        raise ProtocolError("the reply carries no receipt: the server does not sign its replies (an old or "
                            "modified peer); spot checks need signed replies")
    receipt, _ = open_record(sealed, StageReceipt, run_id=run_id)
    expected = dict(p2p_id=p2p_id, stage=stage, mb_id=mb_id, call=call, request_sha256=request_sha256,
                    reply_sha256=reply_sha256)
    for field, value in expected.items():
        if getattr(receipt, field) != value:
            raise ProtocolError(f"the reply's receipt states {field}={str(getattr(receipt, field))[:80]!r}, "
                                f"not {str(value)[:80]!r}")
    if not _same_loss(receipt.loss, loss):
        raise ProtocolError(f"the reply's receipt states loss {receipt.loss}, the reply {loss}")
    return receipt


def _same_loss(a: Optional[float], b: Optional[float]) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a == b


__all__ = ["check_receipt", "sign_receipt", "tensors_digest"]
