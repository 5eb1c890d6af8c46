"""Rebalancing decisions (hysteresis, no stampede, no empty stage) and loss-spike detection."""

import math

from swarm.checkpoint.rollback import LossSpikeDetector
from swarm.config import RollbackSpec
from swarm.protocol import ServerInfo, ServerState
from swarm.server.rebalance import MovePlanner, plan_move, plan_moves


def _server(peer: str, stage: int, throughput: float, state=ServerState.ONLINE) -> ServerInfo:
    return ServerInfo(run_id="r", peer_id=peer, time=0, stage=stage, state=state, throughput=throughput, p2p_id="x")


def _swarm(*stages):
    return {k: [_server(p, k, t) for p, t in group] for k, group in enumerate(stages)}


def test_the_best_mover_of_a_crowded_stage_moves_to_the_bottleneck():
    servers = _swarm([("a", 10), ("b", 10), ("c", 10)], [("d", 10)])
    # moving any one server doubles the pipeline's throughput (10 -> 20); only the lowest peer id moves now
    assert plan_move("a", servers, min_gain=0.25) == 1
    assert plan_move("b", servers, min_gain=0.25) is None
    assert plan_move("d", servers, min_gain=0.25) is None  # it serves its stage alone
    # what every server computes once: then 20 vs 20, where no second move passes (b's would lower the minimum)
    assert plan_moves(servers, min_gain=0.25) == {"a": 1}


def test_hysteresis_blocks_small_gains_and_the_move_back():
    servers = _swarm([("a", 10), ("b", 10)], [("c", 15)])
    assert plan_move("a", servers, min_gain=0.25) is None  # min 15 -> 10: worse
    servers = _swarm([("a", 4), ("b", 10), ("c", 10)], [("d", 18)])
    assert plan_move("a", servers, min_gain=0.25) is None  # 18 -> 20 is +11%, under the 25% margin
    assert plan_moves(servers, min_gain=0.05) == {"a": 1}
    after = _swarm([("b", 10), ("c", 10)], [("d", 18), ("a", 4)])
    assert plan_moves(after, min_gain=0.05) == {}, "the reverse move never passes the same test"


def test_a_large_stage_refills_the_bottleneck_in_one_plan_that_ends_where_single_moves_end():
    # 40 servers against 24: one move lifts the pipeline by 4% only, under min_gain, but the stage it leaves stays
    # far ahead of the bottleneck (39 >= 1.25 x 25), so it moves; and so on to 36 vs 28 (35 < 1.25 x 29), in one plan
    servers = _swarm([(f"a{i:02d}", 1) for i in range(40)], [(f"b{i:02d}", 1) for i in range(24)])
    plan = plan_moves(servers, min_gain=0.25)
    assert plan == {f"a{i:02d}": 1 for i in range(4)}
    one_at_a_time = servers
    while (mover := next((p for p, _ in sorted(plan_moves(one_at_a_time, 0.25).items())), None)) is not None:
        one_at_a_time = {k: [s for s in g if s.peer_id != mover] for k, g in one_at_a_time.items()}
        one_at_a_time[1].append(_server(mover, 1, 1))
    assert {s.peer_id for s in one_at_a_time[1]} == {s.peer_id for s in servers[1]} | set(plan)
    # near balance (26 vs 24) nobody moves
    assert plan_moves(_swarm([(f"a{i:02d}", 1) for i in range(26)], [(f"b{i:02d}", 1) for i in range(24)]), 0.25) == {}


def test_stages_refilling_one_bottleneck_count_each_other_moves():
    # stages 0 and 1 have servers to spare, stage 2 lost most of its servers: each move counts the ones before it
    # (planned stage by stage, each stage sent its best mover on the same figures), taken from the richer stage
    servers = _swarm([(f"a{i}", 1) for i in range(10)], [(f"b{i}", 1) for i in range(10)], [("c0", 1), ("c1", 1)])
    plan = plan_moves(servers, min_gain=0.25)
    assert plan == {"a0": 2, "b0": 2, "a1": 2, "b1": 2}
    moved = {k: [s for s in g if s.peer_id not in plan] for k, g in servers.items()}
    moved[2] += [_server(p, 2, 1) for p in plan]
    assert [len(g) for g in moved.values()] == [8, 8, 6]  # a fifth move lifts 6 to 7 only: under min_gain
    assert plan_moves(moved, min_gain=0.25) == {}, "where the plan ends, nothing more moves"


def test_a_plan_moves_at_most_a_quarter_of_a_stage_at_once():
    # 8 against 1: three moves would pass (to 5 vs 4), a plan takes two (MAX_SHARE_MOVED of 8); the next plan,
    # on the records those two moves leave, the third
    servers = _swarm([(f"a{i}", 1) for i in range(8)], [("b0", 1)])
    assert plan_moves(servers, min_gain=0.25) == {"a0": 1, "a1": 1}
    after = _swarm([(f"a{i}", 1) for i in range(2, 8)], [("b0", 1), ("a0", 1), ("a1", 1)])
    assert plan_moves(after, min_gain=0.25) == {"a2": 1}


def test_draining_servers_do_not_count_and_strangers_do_not_move():
    servers = _swarm([("a", 10), ("b", 10)], [])
    servers[1] = [_server("z", 1, 50, ServerState.DRAINING)]
    assert plan_move("a", servers, min_gain=0.25) == 1  # stage 1 has no throughput: any server helps
    assert plan_move("x", servers, min_gain=0.25) is None


def test_a_move_is_made_only_when_the_checks_plan_it_for_the_confirmation_window():
    crowded = _swarm([("a", 10), ("b", 10)], [("c", 5)])
    glimpse = _swarm([("a", 10), ("b", 10)], [])  # c's announcement came late once: stage 1 looks empty
    now = [0.0]
    planner = MovePlanner(min_gain=0.25, confirm_s=10.0, clock=lambda: now[0])
    assert planner.check("a", glimpse) is None, "one partial view moves nobody"
    now[0] = 3.0
    assert planner.check("a", _swarm([("a", 10), ("b", 10)], [("c", 15)])) is None
    assert planner.pending is None, "the next full view plans nothing: the glimpse is forgotten"
    for t in (6.0, 9.0, 12.0):
        now[0] = t
        assert planner.check("a", crowded) is None and planner.pending == 1, "planned, not confirmed yet"
    now[0] = 16.0
    assert planner.check("a", crowded) == 1, "planned for 10 s by consecutive checks: a move"
    assert planner.pending is None
    # a stage-mate killed a moment ago is still listed (its record has not expired): a's move away would leave
    # stage 1 empty once the record goes, and the plan changes before it is confirmed
    alone = MovePlanner(min_gain=0.25, confirm_s=10.0, clock=lambda: now[0])
    ghost = _swarm([("x", 5)], [("a", 10), ("dead", 10)])
    now[0] = 20.0
    assert alone.check("a", ghost) is None and alone.pending == 0
    now[0] = 31.0  # the dead server's record is stale now: a serves stage 1 alone and stays
    assert alone.check("a", _swarm([("x", 5)], [("a", 10)])) is None and alone.pending is None


def test_spike_detector_waits_for_warmup_then_flags_spikes_only():
    det = LossSpikeDetector(RollbackSpec(window_epochs=4, margin=0.5, warmup_epochs=3))
    assert [det.update(x) for x in (8.0, 7.0, 6.5)] == [False, False, False]
    assert not det.update(7.5)  # above average but within the margin
    avg = det.average
    assert det.update(avg * 1.6) and det.average == avg, "a spike does not pollute the average"
    assert det.update(math.nan)
    det.reset()
    assert not det.update(100.0) and not det.update(math.inf)  # after a reset: warm-up again


def _order(issuer: str, generation: int, epoch: int = 8, lr_scale=None):
    from swarm.protocol import RollbackOrder

    order = RollbackOrder(run_id="r", peer_id=issuer, time=0, epoch=epoch, detected_epoch=epoch + 1,
                          lr_scale=0.5 ** generation if lr_scale is None else lr_scale, generation=generation)
    return order, issuer.encode()


def test_a_rollback_order_counts_only_when_it_is_in_force():
    from swarm.checkpoint.rollback import order_in_force

    def in_force(orders, online, applied=0, authority=None):
        found = order_in_force(orders, online, applied=applied, lr_factor=0.5, authority=authority)
        return found[1].decode() if found else None

    one = _swarm([("a", 1), ("b", 1)], [("z", 1)])
    three = _swarm([("a", 1)], [("x", 1), ("y", 1), ("z", 1)])
    # anyone can sign an order: a stranger's is not in force, however new or drastic
    assert in_force([_order("stranger", 39, lr_scale=0.5 ** 39)], one) is None
    assert in_force([_order("stranger", 1, lr_scale=1e-6)], one, authority="stranger") is None  # scale != 0.5
    # the last stage's only server is its own majority; of three, two must have seen the spike
    assert in_force([_order("z", 1)], one) == "z"
    assert in_force([_order("z", 1)], three) is None
    assert in_force([_order("z", 1, epoch=9), _order("y", 1, epoch=7)], three) == "y"  # the earliest good epoch
    # the coordinator's order is in force on its own; an applied generation is never applied again
    assert in_force([_order("coordinator", 1)], three, authority="coordinator") == "coordinator"
    assert in_force([_order("z", 1)], one, applied=1) is None
    # a stranger's order of the same generation is never the one chosen, even naming an earlier epoch
    assert in_force([_order("z", 1, epoch=9), _order("y", 1, epoch=7), _order("stranger", 1, epoch=0)], three) == "y"
    # a server that missed a rollback follows the order most servers applied
    went = {k: [s.model_copy(update={"rollback_generation": 1, "rollback_issuer": "gone"}) for s in group]
            for k, group in three.items()}
    assert in_force([_order("gone", 1), _order("stranger", 1, epoch=0)], went) == "gone"
    assert in_force([_order("stranger", 2)], went, applied=1) is None


def test_keys_without_averaging_work_carry_no_weight_in_a_last_stage_servers_rollback_majority():
    """Three fresh keys announced as last-stage servers issue orders (the finding of issue 29): by head count they
    are 3 of 4 and in force; for an honest last-stage server, whose electorate is itself and the mates whose
    averaging work it verified, they are not, and two of three honest servers are again a majority. A server
    that knows none of the last stage's servers (another stage's) still counts heads."""
    from swarm.checkpoint.rollback import order_in_force

    online = _swarm([("a", 1)], [("me", 1), ("s1", 1), ("s2", 1), ("s3", 1)])
    sybils = [_order(k, 1) for k in ("s1", "s2", "s3")]

    def in_force(orders, standing):
        weight = (lambda s: 1.0 if s.peer_id == "me" else standing.get(s.peer_id, 0.0)) if standing is not None else None
        found = order_in_force(orders, online, applied=0, lr_factor=0.5, weight=weight)
        return found[1].decode() if found else None

    assert in_force(sybils, None) == "s1"  # head count (today's rule, and a server of another stage)
    assert in_force(sybils, {}) is None
    assert in_force(sybils, {"s1": 0.0, "s2": 0.0, "s3": 0.0}) is None
    honest = _swarm([("a", 1)], [("me", 1), ("h1", 1), ("h2", 1), ("s1", 1), ("s2", 1), ("s3", 1)])
    online.clear()
    online.update(honest)
    assert in_force(sybils + [_order("h1", 1)], {"h1": 1.0, "h2": 1.0}) is None  # 1 of 3
    # two of three voices: in force, and a weightless key's order naming an earlier epoch is not the one chosen
    assert in_force([_order("s1", 1, epoch=0), _order("h1", 1), _order("h2", 1, epoch=7)], {"h1": 1.0, "h2": 1.0}) == "h2"
    assert in_force([_order("me", 1)], {"h1": 0.25}) is None  # a barely verified mate is a full voter: 1 of 2
    assert in_force([_order("me", 1)], {}) == "me"  # it verified none of them: its own electorate


def test_a_spike_streak_issues_one_order_naming_its_first_epoch(tiny_spec):
    import logging
    from types import SimpleNamespace

    from swarm.checkpoint.rollback import Rollbacks

    spec = tiny_spec.updated(rollback={"window_epochs": 4, "margin": 0.15, "warmup_epochs": 3})
    restore = SimpleNamespace(spec=spec, directory=SimpleNamespace(ttl=30.0, run_id="run"), stage=1)
    ck = Rollbacks(restore, SimpleNamespace(lr_scale=1.0), compute=None, identity=SimpleNamespace(peer_id="me"),
                   is_last=True, log=logging.getLogger(__name__))
    flagged = [ck.is_spike(loss) for loss in (6.0, 5.8, 5.6, 5.5, 7.3, 7.0, 6.9)]
    # the bad data went on for three epochs: only the first is answered with an order (the order names the epoch
    # before it; a later one would name an epoch already trained on bad data)
    assert flagged == [False, False, False, False, True, False, False]
    ck.generation = 1  # the order was applied: the next spike is a new rollback
    ck.detector.average, ck.detector.seen = 5.0, 3
    assert ck.is_spike(9.0)


def test_a_restored_checkpoint_sets_only_the_learning_rate_scale_its_generation_implies(tiny_spec, caplog):
    """A checkpoint's metadata names its rollback generation and scale; a writer that states a scale its generation
    does not imply (1e-300: training frozen), or a generation past MIN_LR_SCALE, is not followed."""
    import logging
    from types import SimpleNamespace

    from swarm.checkpoint.rollback import Rollbacks

    restore = SimpleNamespace(spec=tiny_spec, directory=SimpleNamespace(ttl=30.0, run_id="run"), stage=0)

    def resumed(meta: dict) -> tuple[int, float]:
        holder = SimpleNamespace(lr_scale=1.0)
        holder.set_lr_scale = lambda s: setattr(holder, "lr_scale", s)
        ck = Rollbacks(restore, holder, compute=None, identity=SimpleNamespace(peer_id="me"), is_last=False,
                       log=logging.getLogger(__name__))
        ck.resume(meta)
        return ck.generation, holder.lr_scale

    assert resumed({"rollback_generation": 2, "lr_scale": 0.25}) == (2, 0.25)
    assert resumed({}) == (0, 1.0)
    with caplog.at_level(logging.WARNING):
        assert resumed({"rollback_generation": 1, "lr_scale": 1e-300}) == (0, 1.0)
        assert resumed({"rollback_generation": 10_000, "lr_scale": 0.0}) == (0, 1.0)
        assert resumed({"rollback_generation": "2", "lr_scale": 0.25}) == (0, 1.0)
    assert caplog.text.count("ignored the rollback state of the restored checkpoint") == 3


def test_no_rollback_is_issued_whose_learning_rate_scale_no_record_may_carry(tiny_spec, caplog):
    """A record refuses a learning-rate scale below ``MIN_LR_SCALE``: a last-stage server 39 rollbacks deep (scale
    0.5^39) does not issue a 40th, it says why; one rollback deep, it issues the next at the scale it implies."""
    import asyncio
    import logging
    from types import SimpleNamespace

    from swarm.checkpoint.rollback import Rollbacks
    from swarm.identity import Identity

    announced = []

    async def announce(key, order, identity):
        announced.append(order)
        return True

    directory = SimpleNamespace(ttl=30.0, run_id="run", announce=announce)
    restore = SimpleNamespace(spec=tiny_spec, directory=directory, stage=1)
    for generation, scale in ((39, 0.5 ** 39), (1, 0.5)):
        ck = Rollbacks(restore, SimpleNamespace(lr_scale=scale), compute=None, identity=Identity.generate(),
                       is_last=True, log=logging.getLogger(__name__))
        ck.generation = generation
        ck.detector.average = 4.0
        with caplog.at_level(logging.WARNING):
            asyncio.run(ck.issue(detected_epoch=50, loss=9.0))
    assert [(o.generation, o.lr_scale) for o in announced] == [(2, 0.25)]
    assert "rollback #40 would scale the learning rate to 9.09e-13" in caplog.text


def test_a_read_that_misses_the_servers_a_decider_weighs_is_no_majority_not_a_head_count():
    """Found with bench/sybil.py (six lazy keys on a last stage of two honest servers, on a loaded host): a read of
    the online servers that missed the honest ones' records (announced late) left only the keys, and with nobody of
    weight in it the rule fell back to counting heads: their order was in force and an honest server applied it. A
    decider that weighs the last stage's servers (its standing or the recognition names some) now finds no
    majority in such a read, by orders (rule 2) or by servers that applied one (rule 3)."""
    from swarm.checkpoint.rollback import order_in_force

    keys = [("x1", 1), ("x2", 1), ("x3", 1)]
    read = _swarm([("a", 1)], keys)  # stage 1's honest servers h1, h2 are missing from this read
    for server in read[1]:
        object.__setattr__(server, "rollback_generation", 1)
        object.__setattr__(server, "rollback_issuer", "x1")
    orders = [_order(p, 1) for p, _ in keys]
    weight = lambda s: 1.0 if s.peer_id in ("h1", "h2", "a") else 0.0  # noqa: E731
    by_head = order_in_force(orders, read, applied=0, lr_factor=0.5, weight=weight, me="h1")
    assert by_head is not None  # as before
    assert order_in_force(orders, read, applied=0, lr_factor=0.5, weight=weight, me="h1", weighs=True) is None
    only_keys = {0: [], 1: read[1]}  # rule 3: nobody of weight in the read at all
    assert order_in_force(orders, only_keys, applied=0, lr_factor=0.5, weight=weight, me="h1", weighs=True) is None
    assert order_in_force(orders, only_keys, applied=0, lr_factor=0.5, weight=weight, me="h1") is not None
