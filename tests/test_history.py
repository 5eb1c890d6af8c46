"""Copies vote once, flagged parts leave the aggregate, and a lasting push is flagged by the senders' history
(swarm.averaging.reducer.copy_blocks, swarm.averaging.history.PartHistory) — against the attacks that beat one
round's checks at 3 of 7: copies of one honest part, far parts that inflate distances, small pushes that add up."""

import torch

from swarm.averaging.aggregation import make_aggregator
from swarm.averaging.history import PartHistory
from swarm.averaging.reducer import ReducePolicy, as_scored_by, copy_blocks, reduce_partition

D = 4000
CC = make_aggregator("centered_clip")


def _honest(gen, n=4, mean=None):
    mean = torch.randn(D, generator=gen) if mean is None else mean
    return mean + torch.randn(n, D, generator=gen)


def _reduce(rows, policy=ReducePolicy()):
    parts = {f"p{i}": row for i, row in enumerate(rows)}
    return reduce_partition(parts, dict.fromkeys(parts, 1.0), D, CC, policy)


def test_copies_of_one_honest_part_vote_once_and_frame_nobody():
    gen = torch.Generator().manual_seed(0)
    honest = _honest(gen)
    rows = torch.cat([honest, honest[0].expand(3, D)])  # three exact copies
    assert copy_blocks(rows, 0.5) == [[0, 4, 5, 6], [1], [2], [3]]
    red = _reduce(rows)
    assert not any(v.flagged for v in red.verdicts.values())
    # one vote among four: the aggregate lies nearer the honest mean than the copied part
    assert (red.aggregate - honest.mean(0)).norm() < (red.aggregate - honest[0]).norm()
    # near copies in a minority (two of seven, each 0.2 of a part's noise away) vote once too
    near = torch.cat([_honest(gen, 5, honest.mean(0)), honest[0] + 0.2 * torch.randn(2, D, generator=gen)])
    near[0] = honest[0]
    assert copy_blocks(near, 0.5)[0] == [0, 5, 6]
    # without the rule the copies are a majority on the median and CenteredClip returns the copied part itself
    off = _reduce(torch.cat([honest, honest[0].expand(3, D)]), ReducePolicy(copy_ratio=0.0))
    assert torch.equal(off.aggregate, honest[0])


def test_far_parts_cannot_make_honest_parts_count_as_copies():
    gen = torch.Generator().manual_seed(2)
    honest = _honest(gen)
    far = -9 * honest.mean(0) + 0.4 * honest.std() * torch.randn(3, D, generator=gen)
    rows = torch.cat([honest, far])
    assert copy_blocks(rows, 0.5) == [[i] for i in range(7)]
    # the median of all pairwise distances would have merged the four honest parts into one vote of four
    pairwise = torch.pdist(rows).median()
    assert float(torch.pdist(honest).max()) < 0.5 * float(pairwise)


def test_flagged_parts_leave_the_aggregate():
    gen = torch.Generator().manual_seed(3)
    honest = _honest(gen)
    far = 8 * torch.randn(D, generator=gen)  # under the norm check (10x the median), far from everyone
    red = _reduce(torch.cat([honest, far[None]]))
    assert red.verdicts["p4"].accepted and red.verdicts["p4"].flagged
    assert torch.equal(red.aggregate, CC.aggregate(honest, torch.ones(4)))


def _rounds(history, rounds, gen, attacker):
    """``rounds`` gradient rounds of 4 honest senders around a moving mean plus 3 from ``attacker(round,
    honest)``; returns the senders flagged by the history in each round."""
    flagged = []
    for r in range(rounds):
        honest = _honest(gen)
        rows = torch.cat([honest, attacker(r, honest)])
        red = _reduce(rows)
        parts = {f"p{i}": row for i, row in enumerate(rows)}
        flagged.append(set(history.observe(("phase", 0, D), parts, red)))
    return flagged


def test_a_push_that_never_changes_is_flagged_though_no_round_flags_it():
    gen, direction = torch.Generator().manual_seed(4), torch.randn(D, generator=torch.Generator().manual_seed(5))
    push = direction / direction.norm() * 0.8 * (2 * D) ** 0.5  # 0.8 of two honest parts' typical distance
    round_flags, history = [], PartHistory()

    def pusher(r, honest):
        bad = honest.mean(0) - push + torch.randn(3, D, generator=gen)
        round_flags.append(any(v.flagged for s, v in _reduce(torch.cat([honest, bad])).verdicts.items()))
        return bad
    flagged = _rounds(history, 30, gen, pusher)
    assert not any(round_flags)  # one round's checks let it through every time
    first = next(r for r, f in enumerate(flagged) if f)
    assert 1 <= first < history.warmup  # the averages of a few rounds already tell (from the second round)
    assert all(f == {"p4", "p5", "p6"} for f in flagged[first:]), flagged  # the attackers, no honest one


def test_noise_and_pushes_that_change_direction_are_not_flagged():
    gen = torch.Generator().manual_seed(6)

    def turning(r, honest):  # as far as the fixed push above, in a new direction each round
        d = torch.randn(D, generator=gen)
        return honest.mean(0) - d / d.norm() * 0.8 * (2 * D) ** 0.5 + torch.randn(3, D, generator=gen)
    assert not any(_rounds(PartHistory(), 40, gen, turning))
    assert not any(_rounds(PartHistory(), 40, gen, lambda r, honest: _honest(gen, 3, honest.mean(0))))


def test_copies_do_not_make_the_others_look_far_over_rounds():
    gen = torch.Generator().manual_seed(7)
    assert not any(_rounds(PartHistory(), 30, gen, lambda r, honest: honest[0].expand(3, D)))


def test_a_new_partition_starts_a_new_history():
    history, gen = PartHistory(warmup=2), torch.Generator().manual_seed(8)
    rows = _honest(gen, 5)
    parts = {f"p{i}": row for i, row in enumerate(rows)}
    red = _reduce(rows)
    for _ in range(3):
        history.observe(("phase", 0, D), parts, red)
    assert history.rounds == dict.fromkeys(parts, 3)
    history.observe(("phase", D, 2 * D), parts, red)
    assert history.rounds == dict.fromkeys(parts, 1)
    red.verdicts["p0"].accepted = False  # a rejected part adds nothing to its sender's history
    history.observe(("phase", D, 2 * D), parts, red)
    assert history.rounds["p0"] == 1 and history.rounds["p1"] == 2


def _scored(rows, own):
    parts = {f"p{i}": row for i, row in enumerate(rows)}
    red = _reduce(rows)
    return {s for s, v in as_scored_by(red, own, parts, 0.5).items() if v.flagged}


def test_near_copies_in_a_majority_are_flagged_at_the_scale_of_the_reducers_own_part():
    gen = torch.Generator().manual_seed(9)
    honest = _honest(gen)
    spread = float((honest - honest.mean(0)).norm(dim=1).median())
    near = honest[0] + 0.05 * spread * torch.randn(3, D, generator=gen) / D ** 0.5  # three copies of p0, moved
    rows = torch.cat([honest, near])
    assert len(_reduce(rows).blocks) == 7  # they vote apart: four of seven set the round's scale
    # reducers whose own part is another honest one flag the whole cluster (the original cannot be told apart)
    assert _scored(rows, "p1") == _scored(rows, "p3") == {"p0", "p4", "p5", "p6"}
    # the copied reducer's own part is in the cluster: it sets no scale, and flags none of the copies
    assert not _scored(rows, "p0") & {"p4", "p5", "p6"}
    # two copies are a minority, vote once with the original and need no flag
    minority = torch.cat([_honest(gen, 5, honest.mean(0)), near[:2]])
    minority[0] = honest[0]
    assert _scored(minority, "p1") == set()
    # honest parts alone, and an own part far from everyone (a rare token's row) beside honest ones: no flag
    assert _scored(_honest(gen, 7), "p2") == set()
    spiky = _honest(gen, 7, 10 * torch.randn(D, generator=gen))
    spiky[0] += 50 * torch.randn(D, generator=gen)
    assert _scored(spiky, "p0") == set()
