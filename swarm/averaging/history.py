"""The history check: a sender that pushes the same way round after round is flagged, however small each push.

One round's checks (:mod:`swarm.averaging.reducer`) can only bound how far a part lies from the others *in that
round*; a rule-aware attacker then pushes each round just inside that bound, always the same way, and the bias
adds up over the epochs (at 3 of 7 Byzantine, ALIE tuned to CenteredClip ended 12.8% above the clean run, drift
held under the flags 25.6%). Honest servers' gradients differ by sampling noise, which changes from round to round;
a push that does not change does not average out.

So each reducer keeps, for every sender of its partition, an exponential moving average of the sender's parts
(``m_i <- beta m_i + (1 - beta) x_i``, the plain mean of its parts until it has ``1 / (1 - beta)`` of them).
Sampling noise in ``m_i`` shrinks by ``sqrt(k)`` after ``k`` rounds and by ``sqrt((1 - beta) / (1 + beta))`` (4.4x at
``beta = 0.9``) from then on; a constant push keeps its size. From the second round, among at least three senders
whose histories are equally long (or ``warmup`` rounds long: a newcomer waits), a sender whose average lies
farther than ``outlier_ratio`` times the median distance from the centre of the averages (the mean of the majority
nearest their coordinate-wise median; averages that are near copies count once) is flagged, unless the reducer's
own average would be: its verdict feeds the exclusion book as a round's flag does
(:mod:`swarm.averaging.exclusion`). The check changes no aggregate, so auditors (:mod:`swarm.averaging.audit`),
who recompute one round, are unaffected.

This is the concentration filter of SafeguardSGD (Allen-Zhu, Ebrahimian, Li, Alistarh, "Byzantine-Resilient
Non-Convex Stochastic Gradient Descent", ICLR 2021, Alg. 1: workers whose sum of gradients over a window drifts
from the median worker's are removed) with a moving average for the window, and the reason worker momentum helps
robust rules (Karimireddy, He, Jaggi, "Learning from History for Byzantine Robust Optimization", ICML 2021,
sec. 4): over rounds the honest vectors concentrate and a lasting push stands out. What an attacker can still do
undetected is push by at most ``outlier_ratio`` times the honest spread *of the averages* (about a sixth of what one
round allows), or push in directions that change from round to round, which the optimizer's own momentum averages
out. ``slow_drift`` (:mod:`swarm.attacks.adaptive`) does the first. The radius is its own setting
(``averaging.history_outlier_ratio``, 2), tighter than one round's flags (``outlier_ratio``, 3): the averages'
noise is 4.4x smaller and concentrates, so honest averages stay well inside 2 (the clean runs of
``bench/robustness.py`` were unchanged), and at 3 of 7 ``slow_drift`` cost +11.6% at 3 against +8.1% at 2 (three
seeds each, docs/averaging.md).

Only gradient rounds keep a history: in state averaging honest servers send identical parameters.
A history is keyed by the partition's coordinates: when the group or its fractions change, it starts again.
Memory: one float32 vector of the partition's size per sender (about one model's gradient per server in all).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Mapping, Optional

import torch

from swarm.averaging.aggregation import coordinate_median
from swarm.averaging.reducer import Reduction, copy_blocks


@dataclass
class PartHistory:
    """The moving averages of the senders' parts of one partition, kept by its reducer across rounds.

    :param beta: the moving average's factor per round (0.9: about the last 10 rounds).
    :param warmup: rounds of history after which a sender is judged even beside longer histories (a newcomer).
    :param outlier_ratio: flag a sender whose average lies this many times the median distance from the center.
    :param copy_ratio: averages this close to each other count once (:func:`~swarm.averaging.reducer.copy_blocks`).
    :param own: the reducer's own sender id: when its own (honest) average would be flagged, nobody is
        (:func:`~swarm.averaging.reducer.as_scored_by`).
    """

    beta: float = 0.9
    warmup: int = 10
    outlier_ratio: float = 2.0
    copy_ratio: float = 0.5
    own: Optional[str] = None
    key: Hashable = None
    averages: dict = field(default_factory=dict)  # sender -> float32 (numel,)
    rounds: dict = field(default_factory=dict)  # sender -> rounds of history

    def observe(self, key: Hashable, parts: Mapping[str, torch.Tensor], reduction: Reduction) -> list[str]:
        """Add one round's ``parts`` (sender -> float32 ``(numel,)``, as reduced into ``reduction``) of the partition
        ``key`` (its coordinates); only parts whose verdict is accepted and counted enter, each clipped to
        ``outlier_ratio`` times the round's median distance from the aggregate (one honest spike, such as a rare
        token's embedding row, would otherwise stand out for as long as the average remembers it; a push that one
        round's flags let through is not clipped). Marks the verdicts of senders whose average stands out as
        flagged (reason "pushes the same way ...") and returns those senders."""
        if key != self.key:
            self.key, self.averages, self.rounds = key, {}, {}
        verdicts, aggregate = reduction.verdicts, reduction.aggregate
        counted = [s for s in parts if s in verdicts and verdicts[s].accepted and verdicts[s].counted]
        if not counted:
            return []
        offsets = {s: parts[s] - aggregate for s in counted}
        dist = {s: float(o.norm()) for s, o in offsets.items()}
        radius = self.outlier_ratio * float(torch.tensor(list(dist.values())).median())
        for s in counted:
            part = aggregate + offsets[s] * min(1.0, radius / dist[s]) if dist[s] > radius else parts[s]
            avg = self.averages.get(s)
            if avg is None or avg.shape != part.shape:
                self.averages[s], self.rounds[s] = part.detach().clone().float(), 1
            else:
                self.rounds[s] += 1
                b = min(self.beta, 1 - 1 / self.rounds[s])  # the plain mean until it is as long as the window
                avg.mul_(b).add_(part, alpha=1 - b)
        return self._judge(verdicts)

    def _judge(self, verdicts: dict) -> list[str]:
        present = {s: r for s, r in self.rounds.items() if s in verdicts}
        # judged against one another: senders with as long a history as the longest one, or at least warmup rounds
        # (a newcomer's short average is noisier than the others' and waits)
        enough = min(self.warmup, max(present.values(), default=0))
        mature = [s for s, r in present.items() if r >= max(2, enough)]
        if len(mature) < 3:
            return []
        stacked = torch.stack([self.averages[s] for s in mature])
        # copies count once (as in the round's rule): senders that copy one honest sender must not make the
        # others look far
        blocks = copy_blocks(stacked, self.copy_ratio)
        rows = torch.stack([stacked[b].mean(0) for b in blocks]).double()
        center, majority = _majority_center(rows)
        # a sender of the majority is measured from the mean of the *other* majority rows: its own row pulls the
        # majority's mean towards it, by a factor (m - 1) / m on its distance (2/3 in a group of four), and an
        # honest sender outside the majority then looked 2.1-2.6x as far as the median, round after round
        m = len(majority)
        dist = torch.empty(len(mature), dtype=torch.float64)
        for k, block in enumerate(blocks):
            ref = (m * center - rows[k]) / (m - 1) if k in majority and m > 1 else center
            dist[block] = (stacked[block].double() - ref).norm(dim=1)
        med = float(torch.stack([dist[b].mean() for b in blocks]).quantile(0.5))
        if not med > 0:
            return []
        far = {s: d for s, d in zip(mature, dist.tolist()) if d > self.outlier_ratio * med}
        if self.own in far:  # this reducer's own average is honest: the scale is what misleads
            return []
        for s, d in far.items():
            verdicts[s].flagged = True
            verdicts[s].reason = (f"pushes the same way round after round: its {self.rounds[s]}-round average is "
                                  f"{d / med:.1f}x the median distance from the center")
        return list(far)


def _majority_center(rows: torch.Tensor, steps: int = 3) -> tuple[torch.Tensor, list[int]]:
    """The mean of the majority of ``rows`` ``(n, numel)`` nearest the centre, refined from the coordinate-wise median
    ``steps`` times, and the indices of that majority. A minority that pushes together sits in one place, and the
    coordinate-wise median moves towards
    it by about one honest spread in every coordinate (3 of 7: an honest average then looked as far from the median
    as the pushers', measured); the majority's mean does not."""
    center = coordinate_median(rows)
    keep = rows.shape[0] // 2 + 1
    nearest = torch.arange(rows.shape[0])
    for _ in range(steps):
        nearest = (rows.double() - center.double()).norm(dim=1).topk(keep, largest=False).indices.sort().values
        center = rows[nearest].mean(0)
    return center, nearest.tolist()

