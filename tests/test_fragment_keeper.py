"""Fragment keepers on real hivemind DHT nodes (one process): commit, restore, repair, bans, re-publishing."""

import asyncio
import contextlib
import random

import pytest
import torch
from hivemind.utils import get_dht_time

from swarm.averaging.schedule import make_stage_torch_optimizer
from swarm.checkpoint import FragmentError, FragmentStore, capture_stage_state, decode_shard
from swarm.checkpoint.catalog import checkpoint_views
from swarm.checkpoint.keeper import FragmentKeeper
from swarm.checkpoint.service import FragmentService
from swarm.checkpoint.writer import CheckpointError, write_checkpoint
from swarm.config import RunSpec
from swarm.net.directory import AsyncRunDirectory, RunDirectory
from swarm.identity import Identity
from swarm.model import build_stage
from swarm.protocol import FragmentReply, ServerInfo, ServerState, pack_message
from swarm.net.transport import stream_out
from tests.conftest import endorsed, keyed_dhts

RUN = "tiny-aaaaaaaaaaaaaaaa"
pytestmark = pytest.mark.timeout(180)


async def _serve_garbage(self, stream, context):
    """A Byzantine holder's rpc_get_fragment: garbage instead of the fragment it holds."""
    from hivemind.proto import runtime_pb2
    async for _ in stream:
        pass
    garbage = torch.full((1000,), 7, dtype=torch.uint8)
    async for msg in stream_out(runtime_pb2.ExpertResponse, pack_message(FragmentReply(sha256="0" * 64)), [garbage]):
        yield msg


# same class name as the real service: libp2p handler names are "<run>::<class name>.<method>"
LyingService = type("FragmentService", (FragmentService,), {"rpc_get_fragment": _serve_garbage})


async def _announce_servers(nodes, stop: asyncio.Event, passing: asyncio.Lock) -> None:
    """Keep a fresh ONLINE ServerInfo of every node for its keeper's stage (the checkpoint authority asks) and
    a fresh StorageInfo (with a 4 s TTL, a record announced only at the test's ticks may expire on a busy machine
    while a checkpoint is being written, and the writer then rightly falls back to its own disk)."""
    while not stop.is_set():
        async with passing:  # a node dropped (:meth:`Serving.drop`) waits for the pass: its DHT is not in use
            await _announce_pass(nodes)
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass


async def _announce_pass(nodes) -> None:
    for node in nodes:
        info = ServerInfo(run_id=RUN, peer_id=node.me, time=get_dht_time(), stage=node.stage,
                          state=ServerState.ONLINE, throughput=1.0, p2p_id=node.identity.p2p_id)
        await node.directory.announce_server(info, node.identity)
        if node.p2p is not None:
            await node.announce()


class Serving:
    """What :func:`serving` yields: :meth:`drop` stops announcing a node before the test shuts its DHT down (a
    store to a DHT shut down meanwhile never returns)."""

    def __init__(self, nodes):
        self.nodes, self.passing = list(nodes), asyncio.Lock()

    async def drop(self, node) -> None:
        async with self.passing:
            self.nodes.remove(node)


@contextlib.asynccontextmanager
async def serving(nodes):
    """Start every keeper's fragment service and announce each node as a server of its stage meanwhile."""
    stop, handle = asyncio.Event(), Serving(nodes)
    announcer = asyncio.create_task(_announce_servers(handle.nodes, stop, handle.passing))
    try:
        for node in nodes:
            if node.p2p is None:
                await node.start(await node.directory.blocking.dht.replicate_p2p())
        yield handle
    finally:
        stop.set()
        await announcer


@pytest.fixture
def swarm_of_keepers(tmp_path, tiny_spec):
    """Five DHT nodes, each with a fragment keeper (record TTL 4 s); the first serves stage 1, the others
    stage 0 (announced as servers while :func:`serving`). Yields ``(spec, nodes)``."""
    spec = RunSpec.from_dict(tiny_spec.model_dump() | {"checkpoint": {"fragments_needed": 2, "fragments_total": 4}})
    keyed, nodes = keyed_dhts(5), []
    for i, (ident, dht) in enumerate(keyed):
        directory = AsyncRunDirectory(RunDirectory(dht, RUN, ttl=4.0))
        store = FragmentStore(tmp_path / f"peer{i}", max_bytes=1 << 26, keep_epochs=2)
        nodes.append(FragmentKeeper(spec, directory, ident, store, stage=1 if i == 0 else 0, rng=random.Random(i)))
    yield spec, nodes
    for _, dht in reversed(keyed):
        dht.shutdown()


def _shard(spec, epoch=10):
    module = build_stage(spec.model, 1)
    opt = make_stage_torch_optimizer(spec.optim, module.parameters())
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return capture_stage_state(RUN, 1, epoch, module, opt, {"lr_scale": 1.0})


def test_commit_restore_repair_and_ban(swarm_of_keepers):
    spec, nodes = swarm_of_keepers
    writer, liar, *others = nodes

    async def main():
        async with serving(nodes) as served:
            await scenario(served)

    async def scenario(served):
        await liar.service.remove_p2p_handlers(liar.p2p, namespace=RUN)
        liar.service = LyingService(liar.store, RUN)
        await liar.service.add_p2p_handlers(liar.p2p, namespace=RUN)
        for node in nodes:
            await node.tick(repair=False)

        shard = _shard(spec)
        manifest, sealed = await write_checkpoint(writer, shard, parent=("f" * 64, 5), loss=4.2)
        holders = [f.holders[0] for f in manifest.fragments]
        assert len(set(holders)) == 4 and writer.me not in holders, "fragments go to distinct peers of other stages first"
        for node in nodes:
            await node.tick(repair=False)
        view = (await writer.views())[1][0]
        assert view.manifest.shard_sha256 == manifest.shard_sha256 and view.fragments_alive == 4
        assert all(node.store.manifest(RUN, 1, 10) == sealed for node in nodes if node.me in holders)

        # restore through the liar: its fragment fails the hash and it is banned; then the others suffice
        liar_index = holders.index(liar.me)
        full = dict(view.alive)
        view.alive = {i: h for i, h in full.items() if i in (liar_index, (liar_index + 1) % 4)}
        with pytest.raises(FragmentError, match="only 1 of the 2 fragments .* \\(1 corrupt\\)"):
            await writer.transfers.fetch(view)
        assert liar.me in writer.distrusted and "corrupt" in writer.distrusted[liar.me]
        view.alive = full
        blob, bad = await writer.transfers.fetch(view)
        restored = decode_shard(blob, manifest.shard_sha256)
        assert bad == 0, "a distrusted holder is not asked again"
        assert all(torch.equal(restored.tensors[k], v) for k, v in shard.tensors.items())
        await writer.tick(repair=False)
        info = next(s for s in await writer.directory.storage() if s.peer_id == writer.me)
        assert liar.me in info.distrusted

        # a holder vanishes: after its record expires, the lowest live holder re-creates its fragment elsewhere
        gone = next(n for n in others if n.me in holders)
        gone_index = holders.index(gone.me)
        await served.drop(gone)  # no announcement of it is in flight when its DHT shuts down
        await gone.stop()
        gone.directory.blocking.dht.shutdown()
        alive = [n for n in nodes if n is not gone]
        for _ in range(30):
            await asyncio.sleep(1.0)
            for node in alive:
                await node.tick()
            view = (await writer.views())[1][0]
            if view.fragments_alive == 4 and gone.me not in view.holders:
                break
        assert view.fragments_alive == 4, f"not repaired: {view.alive}"
        assert gone.me not in view.holders and view.alive[gone_index]
        assert sum(n.repairs for n in alive) >= 1

        # holders would refuse the manifest (the run key recognizes the writer alone on its stage, and its witness on
        # no stage): the writer says so before it sends a fragment
        writer.directory.blocking.recognized = lambda k: frozenset({writer.me}) if k == 1 else None
        with pytest.raises(CheckpointError, match="would be refused: 1 server\\(s\\) the run key recognizes"):
            await write_checkpoint(writer, _shard(spec, epoch=15))
        assert not [h for n in alive for h in n.store.held() if h.epoch == 15], "no fragment was sent"
        writer.directory.blocking.recognized = lambda k: None

        # not enough room anywhere: nothing is committed
        for node in alive:
            node.store.max_bytes = 10
            await node.tick(repair=False)
        with pytest.raises(CheckpointError, match="found a holder"):
            await write_checkpoint(writer, _shard(spec, epoch=20))
        assert [m.epoch for m, _ in await writer.directory.manifests(1)] == [10]
        for node in alive:
            await node.stop()

    asyncio.run(main())


def test_views_count_only_live_holders_of_the_listed_hash(tiny_spec):
    from swarm.checkpoint.catalog import choose_holders, holding, newest_restorable
    from swarm.protocol import CheckpointManifest, FragmentEntry, StorageInfo

    me = Identity.generate()
    frags = [FragmentEntry(index=i, sha256=f"{i}" * 64) for i in range(4)]
    manifest = CheckpointManifest(run_id=RUN, peer_id=me.peer_id, time=get_dht_time(), stage=0, epoch=30,
                                  shard_sha256="a" * 64, size=100, k=2, n=4, fragments=frags,
                                  **endorsed(RUN, me, stage=0, epoch=30))
    holder = StorageInfo(run_id=RUN, peer_id="p1", time=0, p2p_id="x", free_bytes=10, stage=1,
                         held=[holding(0, 30, 0, "0" * 64), holding(0, 30, 1, "9" * 64)])  # index 1: another hash
    (view,) = checkpoint_views([(manifest, b"")], [holder])
    assert view.fragments_alive == 1 and view.missing == [1, 2, 3] and not view.restorable
    assert newest_restorable([view]) is None

    peers = [StorageInfo(run_id=RUN, peer_id=f"p{i}", time=0, p2p_id="x", free_bytes=1000, stage=i % 2)
             for i in range(3)]
    chosen = [c.peer_id for c in choose_holders(peers, 4, 100, avoid_stage=0, rng=random.Random(0))]
    assert chosen[0] == "p1" and sorted(chosen[:3]) == ["p0", "p1", "p2"] and len(chosen) == 4
    assert choose_holders(peers, 2, 5000, avoid_stage=0) == []


def test_a_restore_waits_until_the_newest_checkpoint_seen_has_settled(tiny_spec):
    """Every peer restarting at once: epoch 4's holders come up first, epoch 6's a few seconds later; epoch 4
    must not count as settled before epoch 6 shows up, and epoch 6 settles one window after it appeared."""
    from swarm.checkpoint.catalog import CheckpointView, SettledView
    from swarm.protocol import CheckpointManifest

    me = Identity.generate()

    def view(epoch):
        m = CheckpointManifest(run_id=RUN, peer_id=me.peer_id, time=get_dht_time(), stage=0, epoch=epoch,
                               shard_sha256=f"{epoch}" * 64, size=100, k=1, n=1, fragments=[],
                               **endorsed(RUN, me, stage=0, epoch=epoch))
        return CheckpointView(m, b"")

    settling = SettledView(9.0, now=100.0)
    assert not settling.observe([], 100.0) and not settling.observe([view(4)], 101.0)
    assert not settling.observe([view(4)], 109.5), "epoch 4 first appeared at 101 s"
    assert not settling.observe([view(6), view(4)], 110.5) and not settling.observe([view(6), view(4)], 119.0)
    assert settling.observe([view(6), view(4)], 119.5)


def test_a_draining_holder_hands_its_fragments_off(swarm_of_keepers):
    spec, nodes = swarm_of_keepers
    writer = nodes[0]

    async def main():
        async with serving(nodes):
            await scenario()

    async def scenario():
        for node in nodes:
            await node.tick(repair=False)
        manifest, sealed = await write_checkpoint(writer, _shard(spec), parent=("f" * 64, 5), loss=4.2)
        holders = {f.index: f.holders[0] for f in manifest.fragments}
        leaver = next(n for n in nodes if n.me == holders[0])
        for node in nodes:
            await node.tick(repair=False)
        assert await leaver.hand_off(timeout_s=30) == 1
        for node in nodes:
            await node.tick(repair=False)
        view = (await writer.views())[1][0]
        successors = [p for p in view.alive[0] if p != leaver.me]
        assert successors and all(p not in set(holders.values()) for p in successors), view.alive
        taker = next(n for n in nodes if n.me == successors[0])
        assert taker.store.manifest(RUN, 1, 10) == sealed and taker.store.get(RUN, 1, 10, 0).sha256 == \
            manifest.fragments[0].sha256
        for node in nodes:
            await node.stop()

    asyncio.run(main())


def test_only_a_stages_servers_commit_and_a_second_one_must_agree(swarm_of_keepers, tmp_path):
    """Checkpoint authority: a stranger's fragments and endorsement requests are refused; a stage's
    server endorses a stage-mate's checkpoint only if its own state at that epoch has the same digest; a witness
    endorses only a stage's only server."""
    from swarm.checkpoint.erasure import split_into_fragments
    from swarm.checkpoint.service import put_fragment, request_endorsement
    from swarm.protocol import Endorsement, EndorseRequest, open_record
    from swarm.trust.authority import EndorsementRefused

    spec, nodes = swarm_of_keepers
    lone, mate_a, mate_b, mate_c, _ = nodes  # lone: stage 1's only server; the others serve stage 0
    [(stranger_key, stranger_dht)] = keyed_dhts(1, initial_peers=[str(m) for m in
                                                                  lone.directory.blocking.dht.get_visible_maddrs()])
    fragment = split_into_fragments(b"x" * 1000, 1, 1)[0]
    digest, other = "a" * 64, "b" * 64

    def ask(req):
        return EndorseRequest(run_id=RUN, stage=req[0], epoch=req[1], state_sha256=req[2])

    async def main():
        async with serving(nodes):
            p2p = await stranger_dht.replicate_p2p()
            with pytest.raises(FragmentError, match="not an online server of stage 0"):
                await put_fragment(p2p, mate_a.identity.p2p_id, RUN, 0, 40, fragment)
            with pytest.raises(EndorsementRefused, match="not an online server of stage 1"):
                await request_endorsement(p2p, mate_a.identity.p2p_id, ask((1, 40, digest)))
            # stage 0: mate_b's state at epoch 40 is the writer's, mate_c's is not
            for node, state in ((mate_a, digest), (mate_b, digest), (mate_c, other)):
                node.authority.record_state(0, 40, state)
            sealed = await request_endorsement(mate_a.p2p, mate_b.identity.p2p_id, ask((0, 40, digest)))
            endorsement, _ = open_record(sealed, Endorsement, run_id=RUN)
            assert (endorsement.basis, endorsement.writer, endorsement.peer_id) == ("same_state", mate_a.me, mate_b.me)
            with pytest.raises(EndorsementRefused, match="has digest bbbbbbbb"):
                await request_endorsement(mate_a.p2p, mate_c.identity.p2p_id, ask((0, 40, digest)))
            # a witness (stage 1's server) refuses stage 0, which has other servers; it endorses stage 1's only one
            with pytest.raises(EndorsementRefused, match="other online servers"):
                await request_endorsement(mate_a.p2p, lone.identity.p2p_id, ask((0, 40, digest)))
            sealed = await request_endorsement(lone.p2p, mate_a.identity.p2p_id, ask((1, 40, digest)))
            assert open_record(sealed, Endorsement, run_id=RUN)[0].basis == "witness"
            got = await mate_a.authority.gather(mate_a.p2p, ask((0, 40, digest)), timeout_s=5)
            assert [open_record(g, Endorsement, run_id=RUN)[0].peer_id for g in got] == [mate_b.me]
            # the writer's put of a fragment of its own stage is taken
            await put_fragment(mate_a.p2p, lone.identity.p2p_id, RUN, 0, 40, fragment)
            assert [(h.stage, h.epoch) for h in lone.store.held()] == [(0, 40)]
        for node in nodes:
            await node.stop()

    try:
        asyncio.run(main())
    finally:
        stranger_dht.shutdown()


def test_a_checkpoint_of_two_fresh_keys_is_ignored_by_every_reader(swarm_of_keepers):
    """Two keys nobody saw as servers (one writes, one endorses) publish a checkpoint of stage 0: readers skip
    it, holders refuse its manifest and the fragments it lists. The same manifest by a server of the
    stage, endorsed by a stage-mate, counts."""
    from swarm.checkpoint.erasure import split_into_fragments
    from swarm.checkpoint.service import put_fragment
    from swarm.protocol import CheckpointManifest, Endorsement, FragmentEntry, ProtocolError, seal

    spec, nodes = swarm_of_keepers
    lone, mate_a, mate_b, _, _ = nodes
    maddrs = [str(m) for m in lone.directory.blocking.dht.get_visible_maddrs()]
    [(writer, stranger_dht)] = keyed_dhts(1, initial_peers=maddrs)
    fragment = split_into_fragments(b"y" * 1000, 1, 1)[0]

    def manifest(by: Identity, endorser: Identity, basis: str) -> bytes:
        endorsement = seal(Endorsement(run_id=RUN, peer_id=endorser.peer_id, time=get_dht_time(), stage=0, epoch=50,
                                       state_sha256="c" * 64, writer=by.peer_id, basis=basis), endorser)
        return seal(CheckpointManifest(
            run_id=RUN, peer_id=by.peer_id, time=get_dht_time(), stage=0, epoch=50, shard_sha256=fragment.sha256,
            size=1000, k=1, n=1, fragments=[FragmentEntry(index=0, sha256=fragment.sha256)], state_sha256="c" * 64,
            endorsements=[endorsement]), by)

    async def main():
        async with serving(nodes):
            await lone.directory.servers(0)  # the reader has seen stage 0's servers
            for basis in ("witness", "same_state"):
                sealed = manifest(writer, Identity.generate(), basis)
                stranger = RunDirectory(stranger_dht, RUN, ttl=4.0)
                assert await asyncio.to_thread(stranger.store_sealed, f"{RUN}/checkpoints/0", f"50:{writer.peer_id}",
                                               sealed)
                assert not [m for m, _ in await lone.directory.manifests(0) if m.epoch == 50]
                with pytest.raises(ProtocolError, match="never seen announced as a server of stage 0"):
                    await lone.service.accept_manifest(sealed)
                p2p = await stranger_dht.replicate_p2p()
                with pytest.raises(FragmentError, match="no committed checkpoint of epoch 50"):
                    await put_fragment(p2p, lone.identity.p2p_id, RUN, 0, 50, fragment)
            genuine = manifest(mate_a.identity, mate_b.identity, "same_state")
            assert await lone.directory.entitled(open_record(genuine)) is None
        for node in nodes:
            await node.stop()

    def open_record(sealed):
        from swarm.protocol import open_record as opened
        return opened(sealed, CheckpointManifest, run_id=RUN)[0]

    try:
        asyncio.run(main())
    finally:
        stranger_dht.shutdown()


def test_a_keeper_stops_quietly_when_its_p2p_daemon_is_already_gone(tmp_path, tiny_spec):
    """Ctrl-C in a terminal reaches the p2p daemon too, which exits first: stopping the keeper then has no
    handlers to remove, and says so instead of raising (`serve` once ended in a traceback there)."""
    import os
    import signal
    import subprocess
    from pathlib import Path

    [(ident, dht)] = keyed_dhts(1)
    keeper = FragmentKeeper(tiny_spec, AsyncRunDirectory(RunDirectory(dht, RUN)), ident,
                            FragmentStore(tmp_path, max_bytes=1 << 20))

    async def main():
        await keeper.start(await dht.replicate_p2p())
        daemons = subprocess.run(["pgrep", "-P", str(dht.pid), "p2pd"], capture_output=True, text=True).stdout.split()
        assert daemons, "no p2p daemon found under the DHT's process"
        for pid in daemons:
            os.kill(int(pid), signal.SIGKILL)
        for pid in daemons:  # dead (a zombie until the DHT's process reaps it, or gone)
            stat = Path(f"/proc/{pid}/stat")
            while stat.exists() and stat.read_text().split()[2] != "Z":
                await asyncio.sleep(0.05)
        await keeper.stop()

    try:
        asyncio.run(main())
    finally:
        dht.shutdown()


def test_holders_republish_a_manifest_only_when_its_copy_is_missing_or_about_to_expire(swarm_of_keepers, monkeypatch):
    """Every holder re-published every held manifest at every tick (the demo's peers: 110 manifest stores in 40 s
    of training, 43 since). Now a tick re-publishes only the manifests its own read of the DHT found
    missing or expiring before the next tick: with the keepers' clock well before the copy's expiration nobody
    stores it; with the clock past it every holder does."""
    import swarm.checkpoint.keeper as keeper_module

    spec, nodes = swarm_of_keepers
    writer = nodes[0]
    stored: list[str] = []

    def counting(node):
        publish = node.directory.publish_manifest

        async def publish_manifest(manifest, sealed):
            stored.append(node.me)
            return await publish(manifest, sealed)
        return publish_manifest

    async def ticks_at(offset_s: float) -> list[str]:
        monkeypatch.setattr(keeper_module, "get_dht_time", lambda: get_dht_time() + offset_s)
        stored.clear()
        for node in nodes:
            await node.tick(repair=False)
        return sorted(stored)

    async def main():
        async with serving(nodes):
            for node in nodes:
                await node.tick(repair=False)
            manifest, _ = await write_checkpoint(writer, _shard(spec), parent=("f" * 64, 5), loss=4.2)
            holders = sorted({n.me for n in nodes if n.store.manifest(RUN, 1, 10) is not None})
            assert len(holders) >= 2
            for node in nodes:
                node.directory.publish_manifest = counting(node)
            assert await ticks_at(-60.0) == [], "a fresh copy was stored again"
            assert await ticks_at(+60.0) == holders, "a copy about to expire was not stored again by its holders"
            assert [m.shard_sha256 for m, _ in await writer.directory.manifests(1)] == [manifest.shard_sha256]
            for node in nodes:
                await node.stop()

    asyncio.run(main())
