"""A stage's state at an epoch as one content-addressed shard: safetensors bytes plus their SHA-256.

The shard holds every tensor of the stage's training state under stable names (``param/<name>``,
``opt/<param name>/<state key>``) and, in the safetensors header, the metadata needed to resume: run id,
stage, epoch, schedule position and data position, as strings (safetensors metadata is ``str -> str``).
Tensors are written and read by the ``safetensors`` library. Its Python API reads the metadata map only from
files, so :func:`_metadata` reads it from the format's documented header (8-byte little-endian length, then
JSON) of the bytes in memory.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from swarm.model import build_stage

FORMAT = "swarm-stage-shard/1"


class ShardError(ValueError):
    """Shard bytes that do not match their hash, do not parse, or belong to another run or stage."""


@dataclass
class StageShard:
    """The training state of one stage at one epoch.

    :param tensors: name -> tensor (any dtype/shape; stored contiguous on CPU).
    :param meta: JSON-serialisable resume information (epoch, schedule position, data position, ...).
    """

    run_id: str
    stage: int
    epoch: int
    tensors: dict[str, torch.Tensor]
    meta: dict = field(default_factory=dict)


def encode_shard(shard: StageShard) -> tuple[bytes, str]:
    """Serialize ``shard`` with safetensors; returns ``(bytes, sha256 hex)``.

    :raises ShardError: a tensor name is empty or ``meta`` is not JSON-serialisable.
    """
    if any(not name for name in shard.tensors):
        raise ShardError("tensor names must be non-empty")
    try:
        # one metadata entry with sorted keys: safetensors keeps metadata in a hash map, so several entries
        # would be written in a varying order and equal states would get different bytes and hashes
        header = json.dumps({"format": FORMAT, "run_id": shard.run_id, "stage": shard.stage, "epoch": shard.epoch,
                             "meta": shard.meta}, sort_keys=True)
    except TypeError as e:
        raise ShardError(f"shard metadata must be JSON-serialisable: {e}") from None
    tensors = {name: t.detach().cpu().contiguous() for name, t in shard.tensors.items()}
    blob = st_save(tensors, metadata={"swarm": header})
    return blob, hashlib.sha256(blob).hexdigest()


def decode_shard(blob: bytes, sha256: str, *, run_id: str | None = None, stage: int | None = None) -> StageShard:
    """Verify and parse shard bytes.

    :param sha256: the hash the manifest promised; checked before anything is parsed.
    :raises ShardError: hash mismatch, unparsable bytes, another format version, run or stage.
    """
    got = hashlib.sha256(blob).hexdigest()
    if got != sha256:
        raise ShardError(f"shard hash {got[:16]}... does not match the manifest's {sha256[:16]}...; "
                         "a fragment or the file is corrupt: fetch it again from another holder")
    try:
        tensors = st_load(blob)
        header = json.loads(_metadata(blob).get("swarm", "{}"))
    except Exception as e:
        raise ShardError(f"shard does not parse as safetensors ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ShardError(f"shard is not in format {FORMAT!r} (another version or not a swarm shard); upgrade the peer")
    held, epoch, meta = header.get("stage", -1), header.get("epoch", -1), header.get("meta") or {}
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (held, epoch)) or not isinstance(meta, dict):
        raise ShardError("shard header's stage, epoch or meta has the wrong type; the shard is not a swarm shard")
    shard = StageShard(run_id=str(header.get("run_id", "")), stage=held, epoch=epoch, tensors=tensors, meta=meta)
    if run_id is not None and shard.run_id != run_id:
        raise ShardError(f"shard is from run {shard.run_id!r}, not {run_id!r}")
    if stage is not None and shard.stage != stage:
        raise ShardError(f"shard holds stage {shard.stage}, not {stage}")
    return shard


def _metadata(blob: bytes) -> dict[str, str]:
    """The safetensors header's ``__metadata__`` (the format's documented 8-byte length + JSON header)."""
    n = int.from_bytes(blob[:8], "little")
    if n <= 0 or n > len(blob) - 8:
        raise ValueError("bad header length")
    return json.loads(blob[8:8 + n]).get("__metadata__", {}) or {}


def max_shard_bytes(model, optimizer_states: int = 2) -> int:
    """Upper bound of the bytes of any stage's shard of ``model`` (a :class:`~swarm.config.ModelSpec`): its
    parameters and ``optimizer_states`` tensors like each (AdamW's two moments), in fp32, plus 1 MiB of header
    and scalars. The stages are built on the ``meta`` device, so nothing is allocated."""
    with torch.device("meta"):
        largest = max(sum(p.numel() for p in build_stage(model, k).parameters()) for k in range(model.num_stages))
    return 4 * (1 + optimizer_states) * largest + (1 << 20)
