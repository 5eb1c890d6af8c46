"""Erasure coding of shard bytes into ``n`` fragments, any ``k`` of which restore them (``zfec``).

``zfec`` (Reed-Solomon over GF(2^8), the Tahoe-LAFS codec) does the coding; this module adds what a swarm
needs around it: each fragment carries its index and the SHA-256 of its bytes (listed in the manifest),
fragments are verified before use, and the restored bytes are checked against the shard's hash.
Storage overhead is ``n / k`` (e.g. k=4, n=8: any 4 of 8 holders suffice, 2x the shard's size in total).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable

from zfec.easyfec import Decoder, Encoder


class FragmentError(ValueError):
    """Fragments that are too few, corrupt (hash mismatch), duplicated or inconsistent, or a holder that
    cannot serve or take one."""


class CorruptFragment(FragmentError):
    """Fragment bytes that do not match their hash (the holder that served them is distrusted)."""


@dataclass(frozen=True)
class Fragment:
    """Fragment ``index`` (0..n-1) of a shard: its bytes and their SHA-256 (hex)."""

    index: int
    data: bytes
    sha256: str

    def verify(self) -> None:
        if hashlib.sha256(self.data).hexdigest() != self.sha256:
            raise CorruptFragment(f"fragment {self.index} does not match its hash; its holder served corrupt data")


def split_into_fragments(blob: bytes, k: int, n: int) -> list[Fragment]:
    """Erasure-code ``blob`` into ``n`` fragments of ``ceil(len / k)`` bytes each.

    :raises ValueError: unless ``1 <= k <= n <= 256``.
    """
    if not 1 <= k <= n <= 256:
        raise ValueError(f"need 1 <= k <= n <= 256, got k={k}, n={n}")
    blocks = Encoder(k, n).encode(blob)
    return [Fragment(i, bytes(b), hashlib.sha256(b).hexdigest()) for i, b in enumerate(blocks)]


def join_fragments(fragments: Iterable[Fragment], k: int, n: int, size: int, sha256: str) -> bytes:
    """Restore the shard bytes from any ``k`` verified fragments.

    :param size: the shard's length in bytes; ``sha256``: its hash (both from the manifest).
    :raises FragmentError: fewer than ``k`` distinct valid fragments, or the result does not match ``sha256``.
    """
    good: dict[int, Fragment] = {}
    for f in fragments:
        if not 0 <= f.index < n:
            raise FragmentError(f"fragment index {f.index} outside 0..{n - 1}")
        f.verify()
        good.setdefault(f.index, f)
    if len(good) < k:
        raise FragmentError(f"{len(good)} valid fragments, {k} needed; fetch more from other holders")
    chosen = sorted(good.values(), key=lambda f: f.index)[:k]
    lengths = {len(f.data) for f in chosen}
    if len(lengths) != 1:
        raise FragmentError("fragments of different lengths: they belong to different shards")
    padlen = lengths.pop() * k - size
    if padlen < 0:
        raise FragmentError(f"fragments too short for a shard of {size} bytes")
    blob = Decoder(k, n).decode([f.data for f in chosen], [f.index for f in chosen], padlen)
    if hashlib.sha256(blob).hexdigest() != sha256:
        raise FragmentError("restored bytes do not match the shard hash; a fragment set is inconsistent")
    return bytes(blob)
