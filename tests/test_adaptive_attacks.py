"""The attacks that know the rule (swarm.attacks.adaptive) do what they claim against the real reducer: tuned lies
stay unflagged, drift stays under the exclusion threshold, lies aimed at the attackers' own partitions leave the
rest honest, sleepers wait."""

import torch

from swarm.attacks import make_attack
from swarm.averaging.aggregation import make_aggregator
from swarm.averaging.exclusion import ExclusionBook
from swarm.averaging.reducer import NoValidParts, ReducePolicy, copy_blocks, reduce_partition


def _honest(n=5, d=2000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(d, generator=gen) + 0.5 * torch.randn(n, d, generator=gen)


def _reduce(honest, bad, f):
    """``f`` attackers sending ``bad`` itself (copies keep their votes here: this tests the search, not the copies
    rule, which :func:`test_attackers_who_know_copies_vote_once_keep_apart` covers)."""
    parts = {f"h{i}": row for i, row in enumerate(honest)} | {f"b{i}": bad for i in range(f)}
    return reduce_partition(parts, dict.fromkeys(parts, 1.0), bad.numel(), make_aggregator("centered_clip"),
                            ReducePolicy(copy_ratio=0.0))


def _probe(f):
    def probe(honest, bad):
        try:
            red = _reduce(honest, bad, f)
        except NoValidParts:
            return 0.0, True
        caught = any(not v.accepted or v.flagged for s, v in red.verdicts.items() if s.startswith("b"))
        return float((red.aggregate - honest.mean(0)).norm()), caught
    return probe


def test_tuned_attacks_pick_the_farthest_lie_the_checks_let_through():
    honest = _honest()
    for name in ("alie_tuned", "ipm_tuned"):
        attack = make_attack(name, n=7, f=2, probe=_probe(2)).inner  # the search, before the attackers move apart
        bad = attack.corrupt_part(honest[0], 0, honest=honest)
        red = _reduce(honest, bad, 2)
        assert all(red.verdicts[f"b{i}"].accepted and not red.verdicts[f"b{i}"].flagged for i in range(2)), name
        err = float((red.aggregate - honest.mean(0)).norm())
        for z in attack.scales:  # no scale it tried does more harm unflagged
            other_err, caught = _probe(2)(honest, attack._vector(honest.mean(0), honest.std(0), z))
            assert caught or other_err <= err + 1e-6, (name, z)
        assert attack.corrupt_part(honest[0], 0, honest=honest) is bad  # one search per round, shared


def test_attackers_who_know_copies_vote_once_keep_apart():
    honest = _honest()
    for name in ("alie_tuned", "ipm_tuned", "drift", "inflated_claim", "near_copies"):
        attackers = [make_attack(name, n=7, f=3, seed=i, probe=_probe(3)) for i in range(3)]
        bad = torch.stack([a.corrupt_part(honest[0], 1, honest=honest) for a in attackers])
        assert copy_blocks(torch.cat([honest, bad]), ReducePolicy().copy_ratio)[-3:] == [[5], [6], [7]], name
    mimic = make_attack("mimic").corrupt_part(honest[0], 1, honest=honest)
    near = make_attack("near_copies", seed=0).corrupt_part(honest[0], 1, honest=honest)
    typical = torch.pdist(honest).median()
    assert abs(float((near - mimic).norm() / typical) - 0.05) < 1e-3  # not bit-identical; 20x closer than honest


def test_drift_is_flagged_every_other_round_and_never_excluded():
    honest = _honest()
    drift, book = make_attack("drift"), ExclusionBook()
    flags = []
    for r in range(100):
        red = _reduce(honest, drift.corrupt_part(honest[0], r, honest=honest), 1)
        flags.append(red.verdicts["b0"].flagged)
        assert not book.record_round({"b0": red.verdicts["b0"]}), f"excluded at round {r}"
    assert flags[:4] == [False, True, False, True] and sum(flags) == 50


def test_own_partitions_lie_only_where_the_attackers_reduce_and_sleepers_wait():
    honest, mine = _honest(), torch.zeros(2000, dtype=torch.bool)
    mine[:500] = True
    attack = make_attack("own_partitions")
    attack.focus(mine)
    out = attack.corrupt_part(honest[0], 0, honest=honest)
    assert torch.equal(out[500:], honest[0, 500:]) and torch.equal(out[:500], -4 * honest[0, :500])
    sleeper = make_attack("sleeper", probe=_probe(2))
    assert torch.equal(sleeper.corrupt_part(honest[0], 49, honest=honest), honest[0])
    assert not torch.equal(sleeper.corrupt_part(honest[0], 50, honest=honest), honest[0])
    assert make_attack("inflated_claim").claim == 1e6 and make_attack("sign_flip").claim is None
