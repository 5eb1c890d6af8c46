import asyncio
import random
import threading
from collections import Counter
from types import SimpleNamespace

import pytest

from swarm.config import ModelSpec
from swarm.protocol import ServerInfo, ServerState
from swarm.server.rebalance import choose_stage
from swarm.trainer.routing import NoServerError, Router, excluded_by_stage


def server(pid, throughput=1.0, stage=0, state=ServerState.ONLINE):
    return ServerInfo(run_id="r", peer_id=pid, time=0, stage=stage, state=state, throughput=throughput, p2p_id="x")


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_load_follows_throughput():
    router = Router(rng=random.Random(0))
    servers = [server("fast", 30.0), server("slow", 10.0)]
    picks = Counter(router.choose(servers, work=8).peer_id for _ in range(400))
    assert picks["fast"] == pytest.approx(300, abs=5) and picks["slow"] == pytest.approx(100, abs=5)


def test_a_server_announcing_more_than_it_delivers_gets_the_share_its_answers_earn():
    router = Router(rng=random.Random(0))
    servers = [server("liar", 1e6), server("honest", 30.0)]
    router.report_success("liar", work=10, seconds=1.0)  # it answers at 10 samples/s whatever it announces
    router.report_success("honest", work=30, seconds=1.0)
    picks = Counter(router.choose(servers, work=8).peer_id for _ in range(400))
    assert picks["liar"] == pytest.approx(100, abs=5) and picks["honest"] == pytest.approx(300, abs=5)
    for _ in range(30):  # it speeds up: the moving average follows, capped by what it announces
        router.report_success("liar", work=90, seconds=1.0)
    assert router.rate(servers[0]) == pytest.approx(90, rel=0.01)
    assert router.rate(server("modest", 20.0)) == 20.0 and router.rate(servers[1]) == 30.0
    router.report_success("modest", work=50, seconds=1.0)
    assert router.rate(server("modest", 20.0)) == 20.0, "never more than it announces"


def test_ties_are_random_and_states_respected():
    router = Router(rng=random.Random(1))
    servers = [server("a"), server("b"), server("joining", state=ServerState.JOINING),
               server("draining", state=ServerState.DRAINING)]
    first = Counter(Router(rng=random.Random(seed)).choose(servers).peer_id for seed in range(200))
    assert set(first) == {"a", "b"} and min(first.values()) > 60
    assert {router.choose(servers).peer_id for _ in range(20)} == {"a", "b"}


def test_newcomer_starts_level_not_flooded():
    router = Router(rng=random.Random(0))
    old = [server("a"), server("b")]
    for _ in range(100):
        router.choose(old)
    picks = Counter(router.choose(old + [server("new")]).peer_id for _ in range(30))
    assert picks["new"] == pytest.approx(10, abs=2)


def test_backoff_and_recovery():
    clock = FakeClock()
    router = Router(backoff_s=5.0, backoff_max_s=12.0, clock=clock, rng=random.Random(0))
    servers = [server("a"), server("b")]
    assert router.report_failure("a") == 5.0
    assert {router.choose(servers).peer_id for _ in range(10)} == {"b"}
    assert router.report_failure("a") == 10.0
    assert router.report_failure("a") == 12.0  # capped
    clock.t = 11.0
    assert router.is_backed_off("a")
    clock.t = 12.5
    assert not router.is_backed_off("a")
    router.report_failure("b")
    router.report_success("a")
    assert router.choose(servers).peer_id == "a"
    router.report_failure("a")
    with pytest.raises(NoServerError):
        router.choose(servers)
    assert router.choose(servers + [server("c")], exclude=["b"]).peer_id == "c"


def test_choose_stage_fills_the_bottleneck():
    spec = ModelSpec(vocab_size=512, d_model=64, n_heads=2, n_layers=4, stage_layers=[2, 2], max_seq_len=16)
    rng = random.Random(0)
    # empty swarm: the costlier stage (the last one carries the LM head) comes first
    assert choose_stage(spec, {}, rng) == 1
    assert choose_stage(spec, {1: [server("a", 10.0, stage=1)]}, rng) == 0
    # joining servers count: stage 1 has 4 + 4 + 5 = 13 samples/s > 10
    groups = {0: [server("a", 10.0, 0)],
              1: [server("b", 4.0, 1), server("c", 4.0, 1, ServerState.JOINING), server("d", 5.0, 1)]}
    assert choose_stage(spec, groups, rng) == 0
    groups[1][-1] = server("d", 5.0, 1, ServerState.DRAINING)  # draining servers do not count: 8 < 10
    assert choose_stage(spec, groups, rng) == 1


class _SlowDirectory:
    """A directory whose reads after the first wait until ``gate`` opens (a DHT read over a far link)."""

    stage_stripe_bits = 0

    def __init__(self):
        self.reads, self.gate = 0, threading.Event()

    async def servers(self, stage: int, stripes=None):
        self.reads += 1
        if self.reads > 1:
            await asyncio.to_thread(self.gate.wait, 30)
        return [SimpleNamespace(peer_id=f"read{self.reads}", stage=stage, convicted={})]


def test_a_due_read_of_the_servers_runs_in_the_background_while_micro_batches_route_on():
    from swarm.trainer.pipeline import RemotePipeline
    from tests.conftest import TINY

    async def scenario():
        directory = _SlowDirectory()
        pipeline = RemotePipeline(TINY, "run", directory, None, refresh_s=0.0)
        first = await pipeline.servers(0)  # nothing cached: the first read is waited for
        during = await asyncio.wait_for(pipeline.servers(0), 5)  # due, but answered from the cache at once
        for _ in range(100):  # (the gate holds the read for 30 s: waiting for it would have timed out above)
            if directory.reads == 2:
                break
            await asyncio.sleep(0.05)
        assert directory.reads == 2 and [s.peer_id for s in first + during] == ["read1", "read1"]
        assert [s.peer_id for s in await pipeline.servers(0)] == ["read1"] and directory.reads == 2  # one at a time
        directory.gate.set()
        for _ in range(100):  # the background read lands
            if (await pipeline.servers(0))[0].peer_id == "read2":
                break
            await asyncio.sleep(0.05)
        assert (await pipeline.servers(0, force=True))[0].peer_id.startswith("read")
        assert directory.reads >= 3

    asyncio.run(scenario())


class _StripedDirectory:
    """A stage of ``per_stripe`` servers in each of 16 stripes (``stage_stripe_bits`` 4); notes what each read read."""

    stage_stripe_bits = 4

    def __init__(self, per_stripe: int):
        self.per_stripe, self.reads = per_stripe, []

    async def servers(self, stage: int, stripes=None):
        stripes = list(range(16)) if stripes is None else list(stripes)
        self.reads.append(stripes)
        return [SimpleNamespace(peer_id=f"s{i}-{j}", stage=stage, convicted={})
                for i in stripes for j in range(self.per_stripe)]


def test_stripes_to_read_reads_about_enough_servers_to_route_over_and_all_of_a_small_stage():
    from swarm.net.directory import stripes_to_read

    rng = random.Random(0)
    assert stripes_to_read(640, 16, 0, rng=rng) is None  # unstriped: the stage's one key
    assert stripes_to_read(0, 0, 4, rng=rng) is None  # nothing read yet: every stripe
    assert stripes_to_read(40, 16, 4, rng=rng) is None  # 2.5 a stripe: 64 need them all
    picks = [stripes_to_read(640, 16, 4, rng=rng) for _ in range(50)]  # 40 a stripe: two stripes hold 80
    assert all(len(p) == 2 and len(set(p)) == 2 and all(0 <= i < 16 for i in p) for p in picks)
    assert len({i for p in picks for i in p}) == 16  # drawn anew each read: every stripe's turn comes
    assert len(stripes_to_read(80, 2, 4, want=200, rng=rng)) == 5  # (80 in 2 stripes: 40 each)
    with pytest.raises(ValueError):
        stripes_to_read(10, 1, 5)


def test_a_trainer_reads_a_few_stripes_of_a_large_stage_and_its_view_turns_over_the_stage():
    from swarm.trainer.pipeline import RemotePipeline
    from tests.conftest import TINY

    async def scenario():
        directory = _StripedDirectory(per_stripe=40)
        pipeline = RemotePipeline(TINY, "run", directory, None, refresh_s=0.0)
        assert len(await pipeline.servers(0)) == 640  # the first read: every stripe
        seen = set()
        for _ in range(30):
            view = await pipeline.servers(0, force=True)
            assert len(view) == 80  # two stripes of 40: about ROUTING_SERVERS, not 640
            seen |= {s.peer_id for s in view}
        assert all(len(r) == 2 for r in directory.reads[1:])
        assert len(seen) > 400  # over 30 reads the view turned over most of the stage (all of it: 71% of the time)
        small = _StripedDirectory(per_stripe=2)  # 32 servers: every read reads every stripe
        pipeline = RemotePipeline(TINY, "run", small, None, refresh_s=0.0)
        for _ in range(3):
            assert len(await pipeline.servers(0, force=True)) == 32
        assert all(len(r) == 16 for r in small.reads)

    asyncio.run(scenario())


def test_validation_loss_scores_the_whole_split_in_batches_weighted_by_their_samples():
    """(swarm.trainer.pipeline.validation_loss) Every validation sample once, in order, batches of at most
    ``batch_size``; the last, smaller batch weighs by its samples; ``max_samples`` takes the split's first ones."""
    import torch

    from swarm.trainer.pipeline import validation_loss, validation_samples
    from tests.conftest import TINY

    seen = []

    class Split:
        def num_samples(self, split):
            return 21 if split == "val" else 1000

        def batch(self, rows, split):
            seen.append((split, list(rows)))
            return torch.tensor(rows, dtype=torch.float32)[:, None]

    async def forward_loss(batch, train):
        assert not train
        return float(batch.mean())  # the mean sample index of the batch: the whole split's mean is 10

    pipeline = SimpleNamespace(spec=TINY, forward_loss=forward_loss)
    assert asyncio.run(validation_loss(pipeline, Split(), batch_size=8)) == pytest.approx(10.0)
    assert [rows for _, rows in seen] == [list(range(0, 8)), list(range(8, 16)), list(range(16, 21))]
    seen.clear()
    assert asyncio.run(validation_loss(pipeline, Split(), max_samples=10, batch_size=8)) == pytest.approx(4.5)
    assert validation_samples(Split()) == 21 and validation_samples(Split(), 10) == 10
    assert [len(rows) for _, rows in seen] == [8, 2] and {s for s, _ in seen} == {"val"}


def test_excluded_by_stage_counts_the_votes_of_the_other_online_records_as_the_quadratic_rule_does():
    def quadratic(servers):  # the rule as first written: every online server against every other
        online = [s for s in servers if s.state == ServerState.ONLINE]
        return {s.p2p_id for s in online
                if (others := [o for o in online if o.p2p_id != s.p2p_id])
                and 2 * sum(s.p2p_id in o.excluded for o in others) > len(others)}

    rng = random.Random(0)
    for _ in range(2000):  # duplicate libp2p ids, self-exclusions and joining servers included
        ids = [f"p{i}" for i in range(rng.randint(1, 6))]
        servers = [ServerInfo(run_id="r", peer_id=f"k{j}", time=0, stage=0, throughput=1.0, p2p_id=rng.choice(ids),
                              state=rng.choice([ServerState.ONLINE] * 3 + [ServerState.JOINING]),
                              excluded={p: "bad parts" for p in ids if rng.random() < 0.5})
                   for j in range(rng.randint(0, 9))]
        assert excluded_by_stage(servers) == quadratic(servers)
    assert excluded_by_stage([]) == set()


def test_fresh_keys_listing_honest_servers_as_excluded_have_no_vote_with_a_trainers_standing():
    """Found against a live swarm: five fresh keys announced as stage-0 servers, each listing both honest servers as
    excluded, stopped trainers routing to them (0 of 3 micro-batches). Weighed by the checks each server passed
    for this trainer (Standing), those keys have no vote; honest servers that passed checks still exclude a server
    they caught."""
    from swarm.trust.standing import Standing

    def record(key, excluded=()):
        return ServerInfo(run_id="r", peer_id=key, time=0, stage=0, throughput=1.0, p2p_id=f"p2p-{key}",
                          state=ServerState.ONLINE, excluded={f"p2p-{p}": "bad parts" for p in excluded})

    honest = [record("h1"), record("h2")]
    sybils = [record(f"s{i}", excluded=("h1", "h2")) for i in range(5)]
    assert excluded_by_stage(honest + sybils) == {"p2p-h1", "p2p-h2"}  # one vote per key: the keys win
    standing = Standing()
    for _ in range(8):  # both honest servers passed eight checks of this trainer
        standing.credit("h1")
        standing.credit("h2")
    assert excluded_by_stage(honest + sybils, standing.weight) == set()
    router = Router(rng=random.Random(0), weight=standing.weight)
    assert {router.choose(honest + sybils).peer_id for _ in range(20)} >= {"h1", "h2"}
    # a server the two checked servers excluded is left out, whatever unchecked keys say
    caught = [record("h1", excluded=("b",)), record("h2", excluded=("b",)), record("b"), *sybils[:3]]
    assert excluded_by_stage(caught, standing.weight) == {"p2p-b"}
    assert excluded_by_stage(caught, Standing().weight) == set()  # a trainer that checked nobody honours none


def test_servers_no_check_verified_get_only_the_explore_share_once_one_server_passed():
    """Found against a live swarm: 150 records of servers that never answer took 186 of a trainer's 195 calls. Once a
    server of the stage passed this trainer's checks, unverified ones get only ``explore`` of the picks (and a
    trainer that verified nobody routes over everyone, as before)."""
    from swarm.trust.standing import Standing

    def record(key):
        return ServerInfo(run_id="r", peer_id=key, time=0, stage=0, throughput=1.0, p2p_id=f"p2p-{key}",
                          state=ServerState.ONLINE)

    servers = [record("h1"), record("h2")] + [record(f"fake{i}") for i in range(150)]
    standing = Standing()
    fresh = Router(rng=random.Random(1), weight=standing.weight)
    assert sum(fresh.choose(servers).peer_id.startswith("fake") for _ in range(200)) > 150  # nobody verified yet
    standing.credit("h1")
    standing.credit("h2")
    router = Router(rng=random.Random(1), weight=standing.weight)
    picks = Counter(router.choose(servers).peer_id.startswith("fake") for _ in range(2000))
    assert picks[True] < 0.15 * 2000, picks  # ~10%: the newcomers' way in
    assert picks[False] > 0.8 * 2000


def test_a_trainer_that_checked_nobody_gives_fakes_only_the_explore_share_where_the_run_key_names_the_servers():
    """The same finding for a trainer that checked nobody yet (just started, spot checks off, or outer mode): it
    routed over all 150 fakes. Where the run key's recognition names the stage's servers, they count as verified
    (:meth:`SpotChecker.vote`), and the fakes get the explore share from the first pick."""
    from swarm.trust.spotcheck import SpotChecker
    from tests.conftest import TINY

    def record(key):
        return ServerInfo(run_id="r", peer_id=key, time=0, stage=0, throughput=1.0, p2p_id=f"p2p-{key}",
                          state=ServerState.ONLINE)

    servers = [record("h1"), record("h2")] + [record(f"fake{i}") for i in range(150)]
    named = {0: frozenset({"h1", "h2"})}
    checker = SpotChecker(TINY, "r", None, recognized=named.get)
    assert (checker.vote("h1"), checker.vote("fake0")) == (1.0, 0.0)
    router = Router(rng=random.Random(1), weight=checker.vote)
    picks = Counter(router.choose(servers).peer_id.startswith("fake") for _ in range(2000))
    assert picks[True] < 0.15 * 2000, picks
    unnamed = Router(rng=random.Random(1), weight=SpotChecker(TINY, "r", None).vote)  # no recognition: as before
    assert sum(unnamed.choose(servers).peer_id.startswith("fake") for _ in range(200)) > 150
