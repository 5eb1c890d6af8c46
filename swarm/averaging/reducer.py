"""What a reducer does with the parts of its partition: check them, bound weights, aggregate, flag outliers.

:func:`reduce_partition` is the one place that decides which senders' parts count; the real all-reduce
(:mod:`swarm.averaging.allreduce`) and the in-process harness of the benchmarks (``bench/harness.py``) both call it.

Checks, in order (BTARD, Gorbunov et al. 2022, sec. 3.2 lists the same kinds of misbehaviour):

1. the part decodes with the round's codec to the partition's size (dtype and shape right) — else rejected;
2. every value is finite — else rejected;
3. its L2 norm is at most ``reject_norm_ratio`` times the median norm of the partition's parts — else
   rejected (with one sender there is nothing to compare with and this check is skipped);
4. after aggregation, a part whose distance to the aggregate exceeds ``outlier_ratio`` times the median
   distance is *flagged* (counted, still used: the aggregator already bounded its influence).

Rejected and flagged senders feed :class:`swarm.averaging.exclusion.ExclusionBook`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence, Union

import torch
from pydantic import BaseModel, ConfigDict, Field

from swarm.averaging.aggregation import Aggregator, bound_weights, spread


class ReducePolicy(BaseModel):
    """Bounds a reducer applies to the parts it receives (from the run spec's ``[averaging]``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    reject_norm_ratio: float = Field(10.0, gt=1, description="Reject a part whose norm exceeds this x the median.")
    outlier_ratio: float = Field(3.0, gt=1, description="Flag a part this x farther from the aggregate than the median.")
    max_weight_ratio: float = Field(4.0, ge=1, description="Cap a sender's reported samples at this x the median.")


@dataclass
class Verdict:
    """What the reducer made of one sender's part."""

    accepted: bool
    reason: str = ""
    flagged: bool = False
    norm: float = 0.0


@dataclass
class Reduction:
    """A partition's float32 ``(numel,)`` aggregate and a verdict per sender (keyed like the input)."""

    aggregate: torch.Tensor
    verdicts: dict = field(default_factory=dict)

    @property
    def used(self) -> list:
        return [s for s, v in self.verdicts.items() if v.accepted]


class NoValidParts(RuntimeError):
    """Every part of the partition was rejected (or none arrived): there is nothing to aggregate."""


def reduce_partition(parts: Mapping[object, Union[torch.Tensor, Exception]], weights: Mapping[object, float],
                     numel: int, aggregator: Aggregator, policy: ReducePolicy) -> Reduction:
    """Check and aggregate one partition.

    :param parts: sender -> decoded float32 ``(numel,)`` part, or the exception its decoding raised.
    :param weights: sender -> reported samples (bounded here, never trusted as is).
    :raises NoValidParts: no part survived the checks.
    """
    verdicts: dict = {}
    good: dict = {}
    for sender, part in parts.items():
        if isinstance(part, Exception):
            verdicts[sender] = Verdict(False, f"malformed part: {part}")
        elif part.dtype != torch.float32 or part.shape != (numel,):
            verdicts[sender] = Verdict(False, f"part is {part.dtype}{tuple(part.shape)}, expected float32({numel},)")
        elif not torch.isfinite(part).all():
            verdicts[sender] = Verdict(False, "part has NaN or Inf values")
        else:
            good[sender] = part
    if not good:
        raise NoValidParts(f"no valid part among {len(parts)}: " + "; ".join(v.reason for v in verdicts.values()))
    senders = list(good)
    stacked = torch.stack([good[s] for s in senders])
    norms = stacked.norm(dim=1)
    if len(senders) > 1:
        limit = policy.reject_norm_ratio * float(norms.median())
        keep = [i for i, nrm in enumerate(norms.tolist()) if nrm <= limit or limit == 0]
        for i, s in enumerate(senders):
            if i not in keep:
                verdicts[s] = Verdict(False, f"part norm {norms[i]:.3g} exceeds {policy.reject_norm_ratio:g}x "
                                             f"the median {limit / policy.reject_norm_ratio:.3g}", norm=float(norms[i]))
        senders, stacked, norms = [senders[i] for i in keep], stacked[keep], norms[keep]
    w = bound_weights(torch.tensor([float(weights.get(s, 0.0)) for s in senders]), policy.max_weight_ratio)
    if not w.sum() > 0:
        w = torch.ones(len(senders))
    aggregate = aggregator.aggregate(stacked, w)
    dist = (stacked - aggregate).norm(dim=1)
    med = float(spread(dist))
    for i, s in enumerate(senders):
        flagged = len(senders) > 2 and med > 0 and float(dist[i]) > policy.outlier_ratio * med
        verdicts[s] = Verdict(True, "", flagged, float(norms[i]))
    return Reduction(aggregate, verdicts)


def partition_bounds(total: int, fractions: Sequence[float], block: int) -> list[tuple[int, int]]:
    """Cut ``total`` values into ``len(fractions)`` contiguous ranges proportional to ``fractions``.

    Cuts fall on multiples of ``block`` (so blockwise codecs encode each range like the whole vector);
    a zero fraction (a client-mode peer) gets an empty range.
    """
    if not fractions or sum(fractions) <= 0:
        raise ValueError("at least one peer must reduce a partition")
    blocks = -(-total // block)
    norm = [f / sum(fractions) for f in fractions]
    cuts, acc = [0], 0.0
    for f in norm[:-1]:
        acc += f
        cuts.append(min(total, int(round(acc * blocks)) * block))
    cuts.append(total)
    return [(a, max(a, b)) for a, b in zip(cuts[:-1], cuts[1:])]

