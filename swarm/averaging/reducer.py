"""What a reducer does with the parts of its partition: check them, bound weights, aggregate, flag outliers.

:func:`reduce_partition` is the one place that decides which senders' parts count; the real all-reduce
(:mod:`swarm.averaging.allreduce`) and the in-process harness of the benchmarks (``bench/harness.py``) both call it.

Checks, in order (BTARD, Gorbunov et al. 2022, sec. 3.2 lists the same kinds of misbehaviour):

1. the part decodes with the round's codec to the partition's size (dtype and shape right) — else rejected;
2. every value is finite — else rejected;
3. a part whose sender claims no samples (weight 0, or a non-finite weight) is kept out of the vote: accepted,
   not counted, not scored (an idle server sends zeros with weight 0); when no part claims samples, all count;
4. its L2 norm is at most ``reject_norm_ratio`` times the median norm of the counted parts — else rejected (with
   one part there is nothing to compare with and this check is skipped). When a strict majority of the parts are
   exactly zero, the others are set aside: not counted, and not scored (an honest server may hold the only
   non-zero values of a partition, e.g. embedding rows of tokens only its trainers sent);
5. parts closer to each other than ``copy_ratio`` times the parts' typical distance to their nearest neighbour
   are copies (:func:`copy_blocks`) and vote once, as their mean (gradient rounds only);
6. the rule runs. A robust rule gets one vote per counted part: the sample counts are the senders' own claims,
   which nobody in the group saw them earn, so weighting by them would hand the weight to whoever claims most
   (a weighted rule with claims capped at 4x the median gave 2 of 7 attackers 62% of the weight). A part of weight
   0 shrinks the group that votes: a server that tags along with no samples has no say. The mean,
   which trusts every sender anyway, weighs them by their claims capped at ``max_weight_ratio`` times the
   median. An aggregate that overflows float32 is refused (:class:`NoValidParts`, naming the cause);
7. after aggregation, a part whose distance to the aggregate exceeds ``outlier_ratio`` times the median
   distance (a block of copies counts once in the median) is *flagged*, and a robust rule runs again without
   the flagged parts (a far part still moves CenteredClip by up to its radius; ten rounds of three such parts of
   seven at the start of a run cost 18% in the final loss, measured); the part is still counted. When half or
   more parts equal the aggregate exactly, nothing is flagged (the rule already ignored the rest).

Rejected and flagged senders feed :class:`swarm.averaging.exclusion.ExclusionBook`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional, Sequence, Union

import torch
from pydantic import BaseModel, ConfigDict, Field

from swarm.averaging.aggregation import (Aggregator, NonFiniteAggregate, all_finite, bound_weights, row_norms,
                                         spread)


class ReducePolicy(BaseModel):
    """Bounds a reducer applies to the parts it receives (from the run spec's ``[averaging]``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    reject_norm_ratio: float = Field(10.0, gt=1, description="Reject a part whose norm exceeds this x the median.")
    outlier_ratio: float = Field(3.0, gt=1, description="Flag a part this x farther from the aggregate than the median.")
    max_weight_ratio: float = Field(4.0, ge=1, description="Cap a sender's reported samples at this x the median.")
    copy_ratio: float = Field(0.5, ge=0, lt=1, description="Parts closer to each other than this x the median "
                              "distance of a part to its nearest neighbour are copies and vote once, as their mean "
                              "(0: off; state averaging turns it off: honest servers' parameters agree bit for bit).")


@dataclass
class Verdict:
    """What the reducer made of one sender's part."""

    accepted: bool
    reason: str = ""
    flagged: bool = False
    norm: float = 0.0
    counted: bool = True
    """False for an accepted part that had no vote: it claimed no samples, or it was set aside beside a strict
    majority of exactly zero parts. Such a part is not scored."""


@dataclass
class Reduction:
    """A partition's float32 ``(numel,)`` aggregate and a verdict per sender (keyed like the input)."""

    aggregate: torch.Tensor
    verdicts: dict = field(default_factory=dict)
    blocks: list = field(default_factory=list)
    """The senders that voted, grouped as the rule saw them: a block of copies votes once (step 5)."""

    @property
    def used(self) -> list:
        return [s for s, v in self.verdicts.items() if v.accepted and v.counted]


class NoValidParts(RuntimeError):
    """Every part of the partition was rejected (or none arrived): there is nothing to aggregate."""


def reduce_partition(parts: Mapping[object, Union[torch.Tensor, Exception]], weights: Mapping[object, float],
                     numel: int, aggregator: Aggregator, policy: ReducePolicy) -> Reduction:
    """Check and aggregate one partition (the module docstring's steps).

    :param parts: sender -> decoded float32 ``(numel,)`` part, or the exception its decoding raised.
    :param weights: sender -> reported samples (a vote for robust rules, bounded for the mean, never trusted as is).
    :raises NoValidParts: no part survived the checks, or their aggregate overflowed float32.
    """
    verdicts: dict = {}
    good = _well_formed(parts, numel, verdicts)
    if not good:
        raise NoValidParts(f"no valid part among {len(parts)}: " + "; ".join(v.reason for v in verdicts.values()))
    claims = {s: _claim(weights.get(s, 0.0)) for s in good}
    if any(c > 0 for c in claims.values()):
        for s in [s for s in good if claims[s] <= 0]:
            verdicts[s] = Verdict(True, "claimed no samples (weight 0): not counted", counted=False)
            del good[s]
    senders = list(good)
    stacked = torch.stack([good[s] for s in senders])
    norms = row_norms(stacked)
    if len(senders) > 1:
        keep = _norm_check(senders, norms, policy, verdicts)
        senders, stacked, norms = [senders[i] for i in keep], stacked[keep], norms[keep]
    claimed = torch.tensor([claims[s] for s in senders])
    w = bound_weights(claimed, policy.max_weight_ratio) if not aggregator.robust else (claimed > 0).float()
    if not w.sum() > 0:
        w = torch.ones(len(senders))
    aggregate, blocks = _rule(stacked, w, aggregator, policy)
    dist = row_norms(stacked, aggregate)
    med = float(spread(torch.stack([dist[b].mean() for b in blocks])))
    flagged = [len(senders) > 2 and med > 0 and float(d) > policy.outlier_ratio * med for d in dist]
    for i, s in enumerate(senders):
        verdicts[s] = Verdict(True, "", flagged[i], float(norms[i]))
    if aggregator.robust and any(flagged) and not all(flagged):  # the rule again, without the flagged parts
        keep = [i for i, f in enumerate(flagged) if not f]
        aggregate, _ = _rule(stacked[keep], w[keep], aggregator, policy)
    return Reduction(aggregate, verdicts, [[senders[i] for i in b] for b in blocks])


def as_scored_by(reduction: Reduction, own, parts: Optional[Mapping] = None, copy_ratio: float = 0.0) -> dict:
    """The verdicts a reducer scores (:class:`~swarm.averaging.exclusion.ExclusionBook`), knowing that its own part
    (sender ``own``) is honest. Scoring only: the aggregate stays what any auditor recomputes from the parts.

    * When its own part is flagged, the round's flags say more about the parts that set the scale than about the
      senders flagged, and no flag is scored (rejections are). Three of seven sending near copies of one honest
      part make a majority whose median distance is tiny: every other honest part is then flagged, and the honest
      reducers excluded one another (4 of 4 honest peers, measured).
    * Given ``parts`` (sender -> float32 ``(numel,)``) and ``copy_ratio`` > 0 (gradient rounds), senders whose parts
      are near copies that still vote apart are flagged (:func:`near_copies_at_own_scale`)."""
    verdicts = reduction.verdicts
    mine = verdicts.get(own)
    if mine is not None and mine.flagged:
        verdicts = {s: replace(v, flagged=False) if v.flagged else v for s, v in verdicts.items()}
    if parts is not None and copy_ratio > 0:
        copies = near_copies_at_own_scale(parts, reduction.blocks, own, copy_ratio)
        verdicts = {s: replace(v, flagged=True, reason=copies[s]) if s in copies else v for s, v in verdicts.items()}
    return verdicts


def near_copies_at_own_scale(parts: Mapping, blocks: Sequence[Sequence], own, ratio: float) -> dict:
    """Senders (-> the reason) whose parts nearly copy another sender's while voting apart (different
    ``blocks`` of :func:`copy_blocks`), at the scale the reducer's own honest part sets: closer than ``ratio``
    times the distance from its own part to the nearest other part, and than ``ratio`` times either part's norm.

    Honest servers' parts differ by their own samples' noise, so no two of them lie much closer to each other
    than the reducer's own part lies to its nearest one. Copies that evade :func:`copy_blocks` do so by shrinking
    its reference: at ``f + 1 > n / 2`` (three attackers copying one honest part, each moved a little) they are a
    majority that sets the round's scale, outvote the other honest parts, and the aggregate follows one honest
    server's gradient (+10.8% at 3 of 7 in ``bench/robustness.py``, ``near_copies``). Nothing in the parts alone
    tells which member of the cluster is the original, so all of them are flagged; that costs the copied honest
    server its seat with the three attackers. The reducer's own part is private (no other peer receives it), so
    attackers can neither copy it nor move the scale it sets. Nothing is flagged when every other part is such
    a copy (the own part is then the outlier: a rare token's embedding row, say) or when fewer than four blocks
    voted."""
    voters = [s for b in blocks for s in b]
    if ratio <= 0 or own not in voters or len(blocks) < 4 or any(s not in parts for s in voters):
        return {}
    rows = torch.stack([parts[s] for s in voters]).double()
    dist = torch.cdist(rows[None], rows[None])[0]
    norms = rows.norm(dim=1)
    me = voters.index(own)
    others = [i for i in range(len(voters)) if i != me]
    scale = float(dist[me, others].min())
    block_of = {s: k for k, b in enumerate(blocks) for s in b}
    close: dict[int, float] = {}
    for i in others:
        for j in others:
            d = float(dist[i, j])
            if i < j and block_of[voters[i]] != block_of[voters[j]] and d <= ratio * scale \
                    and d <= ratio * float(min(norms[i], norms[j])):
                close[i], close[j] = min(close.get(i, d), d), min(close.get(j, d), d)
    if not scale > 0 or len(close) >= len(others):
        return {}
    return {voters[i]: f"part nearly copies another sender's ({d / scale:.2f}x this reducer's own part's distance "
                       "to its nearest part; honest parts are never that close) while both vote"
            for i, d in close.items()}


def _rule(stacked: torch.Tensor, w: torch.Tensor, aggregator: Aggregator, policy: ReducePolicy):
    """Steps 5 and 6: the copies merged into blocks, then the rule on one row per block. Returns the float32
    ``(numel,)`` aggregate and the blocks (lists of row indices)."""
    blocks = copy_blocks(stacked, policy.copy_ratio)
    rows = torch.stack([stacked[b].mean(0) if len(b) > 1 else stacked[b[0]] for b in blocks])
    block_w = torch.stack([w[b].sum() if not aggregator.robust else w[b].max() for b in blocks])
    if not block_w.sum() > 0:
        block_w = torch.ones(len(blocks))
    try:
        return aggregator.aggregate(rows, block_w), blocks
    except NonFiniteAggregate as e:
        raise NoValidParts(str(e)) from e


def _well_formed(parts: Mapping, numel: int, verdicts: dict) -> dict:
    """Checks 1 and 2: the parts of the right dtype, shape and finite values; verdicts for the others."""
    good = {}
    for sender, part in parts.items():
        if isinstance(part, Exception):
            verdicts[sender] = Verdict(False, f"malformed part: {part}")
        elif part.dtype != torch.float32 or part.shape != (numel,):
            verdicts[sender] = Verdict(False, f"part is {part.dtype}{tuple(part.shape)}, expected float32({numel},)")
        elif not all_finite(part):
            verdicts[sender] = Verdict(False, "part has NaN or Inf values")
        else:
            good[sender] = part
    return good


def _claim(weight) -> float:
    """A sender's claimed samples as a float; 0 for a negative, non-finite or non-numeric claim."""
    try:
        w = float(weight)
    except (TypeError, ValueError):
        return 0.0
    return w if math.isfinite(w) and w > 0 else 0.0


def _norm_check(senders: list, norms: torch.Tensor, policy: ReducePolicy, verdicts: dict) -> list[int]:
    """Check 4: the indices of the parts within ``reject_norm_ratio`` x the median norm (the mean of the two middle
    norms for an even count); verdicts for the rest. When a strict majority of the parts are exactly zero, the
    others are set aside without a penalty: honest servers whose partition holds, say, embedding rows of tokens only
    they saw look just like an attacker here, and every robust rule returns zero anyway."""
    zero = norms == 0
    if 2 * int(zero.sum()) > len(senders):
        for i in (~zero).nonzero().flatten().tolist():
            verdicts[senders[i]] = Verdict(True, f"part norm {float(norms[i]):.3g} where most parts are exactly zero: "
                                                 "not counted", norm=float(norms[i]), counted=False)
        return zero.nonzero().flatten().tolist()
    median = float(norms.quantile(0.5))
    limit = policy.reject_norm_ratio * median
    keep = []
    for i, (s, nrm) in enumerate(zip(senders, norms.tolist())):
        if nrm <= limit:
            keep.append(i)
        else:
            verdicts[s] = Verdict(False, f"part norm {nrm:.3g} exceeds {policy.reject_norm_ratio:g}x the median "
                                         f"{median:.3g}", norm=nrm)
    return keep


def copy_blocks(parts: torch.Tensor, ratio: float) -> list[list[int]]:
    """The rows of ``parts`` float32 ``(n, numel)`` grouped into blocks of copies: a row joins the first earlier
    block all of whose members lie within ``ratio`` times the reference distance of it (no chains). The reference
    is the median over the rows of each row's distance to its nearest other row (0 when most rows have an exact
    copy: then only exact copies are a block). ``ratio`` 0 or fewer than 3 rows: one block per row.

    In a gradient round honest servers' parts differ by their own samples' noise, and in high dimension two of
    them lie about as far apart as any other two; parts much closer than that are one part sent several times.
    Copies of an honest part (mimic, Karimireddy et al., ICLR 2022, sec. 5) would otherwise outvote the other
    honest parts and make them look like outliers. The reference is what attackers cannot inflate: a majority of
    the rows are honest and each honest row's nearest neighbour is at most as far as its nearest honest one, so
    far-off attackers cannot make honest parts count as copies (a median of all pairwise distances would let
    them: three of seven far away merged the four honest parts into one vote, measured); they can only shrink
    it, which merges less."""
    n = parts.shape[0]
    if ratio <= 0 or n < 3:
        return [[i] for i in range(n)]
    dist = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n - 1):  # each pair's difference in float32 (row_norms): 5x faster than cdist in float64
        dist[i, i + 1:] = dist[i + 1:, i] = row_norms(parts[i + 1:], parts[i])
    nearest = (dist + torch.diag(torch.full((n,), math.inf, dtype=dist.dtype))).min(dim=1).values
    limit = ratio * float(nearest.median())
    blocks: list[list[int]] = []
    for i in range(n):
        home = next((b for b in blocks if all(float(dist[i, j]) <= limit for j in b)), None)
        if home is None:
            blocks.append([i])
        else:
            home.append(i)
    return blocks


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

