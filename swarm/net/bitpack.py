"""Integer codes bit-packed into bytes: what the low-bit wire codecs (:mod:`swarm.net.codecs`,
:mod:`swarm.net.lowrank`) send. It imports only torch."""

from __future__ import annotations

import torch


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes ``(n,)``, each below ``2**bits`` (1 to 31 bits) -> their bits packed into uint8
    ``(ceil(n * bits / 8),)``."""
    if 8 % bits == 0:  # whole codes per byte: shifts of the codes themselves
        per = 8 // bits
        lanes = torch.nn.functional.pad(codes, (0, -codes.numel() % per)).view(-1, per).to(torch.int32)
        return (lanes << torch.arange(0, 8, bits, dtype=torch.int32)).sum(dim=1).to(torch.uint8)
    stream = ((codes[:, None].to(torch.int32) >> torch.arange(bits, dtype=torch.int32)) & 1).flatten()
    stream = torch.nn.functional.pad(stream, (0, -stream.numel() % 8)).view(-1, 8)
    return (stream << torch.arange(8, dtype=torch.int32)).sum(dim=1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``n`` codes, int64 ``(n,)``."""
    if 8 % bits == 0:
        lanes = (packed[:, None].to(torch.int32) >> torch.arange(0, 8, bits, dtype=torch.int32)) & (2 ** bits - 1)
        return lanes.flatten()[:n].long()
    stream = ((packed[:, None].to(torch.int32) >> torch.arange(8, dtype=torch.int32)) & 1).flatten()[:n * bits]
    return (stream.view(n, bits).long() << torch.arange(bits)).sum(dim=1)


__all__ = ["pack_bits", "unpack_bits"]
