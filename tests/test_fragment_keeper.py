"""Fragment keepers on real hivemind DHT nodes (one process): commit, restore, repair, bans, re-publishing."""

import asyncio
import random

import pytest
import torch

from swarm.averaging.schedule import make_stage_torch_optimizer
from swarm.checkpoint import FragmentError, FragmentStore, capture_stage_state, decode_shard
from swarm.checkpoint.catalog import checkpoint_views
from swarm.checkpoint.keeper import FragmentKeeper
from swarm.checkpoint.service import FragmentService
from swarm.checkpoint.writer import CheckpointError, write_checkpoint
from swarm.config import RunSpec
from swarm.directory import RunDirectory
from swarm.identity import Identity
from swarm.model import build_stage
from swarm.protocol import FragmentReply, pack_message
from swarm.transport import stream_out

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


@pytest.fixture
def swarm_of_keepers(tmp_path, tiny_spec):
    """Five DHT nodes, each with a fragment keeper (record TTL 4 s); the first serves stage 1, the others
    stage 0. Yields ``(spec, nodes)``."""
    from hivemind import DHT

    spec = RunSpec.from_dict(tiny_spec.model_dump() | {"checkpoint": {"fragments_needed": 2, "fragments_total": 4}})
    kw = dict(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_relay=False, use_auto_relay=False)
    first = DHT(**kw)
    dhts = [first] + [DHT(initial_peers=[str(m) for m in first.get_visible_maddrs()], **kw) for _ in range(4)]
    nodes = []
    for i, dht in enumerate(dhts):
        directory = RunDirectory(dht, RUN, ttl=4.0)
        store = FragmentStore(tmp_path / f"peer{i}", max_bytes=1 << 26, keep_epochs=2)
        nodes.append(FragmentKeeper(spec, directory, Identity.generate(), store, stage=1 if i == 0 else 0,
                                   rng=random.Random(i)))
    yield spec, nodes
    for dht in reversed(dhts):
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
        for node in nodes:
            await node.start(await node.directory.dht.replicate_p2p())
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
            await writer.fetch(view)
        assert liar.me in writer.distrusted and "corrupt" in writer.distrusted[liar.me]
        view.alive = full
        blob, bad = await writer.fetch(view)
        restored = decode_shard(blob, manifest.shard_sha256)
        assert bad == 0, "a distrusted holder is not asked again"
        assert all(torch.equal(restored.tensors[k], v) for k, v in shard.tensors.items())
        await writer.tick(repair=False)
        info = next(s for s in writer.directory.storage() if s.peer_id == writer.me)
        assert liar.me in info.distrusted

        # a holder vanishes: after its record expires, the lowest live holder re-creates its fragment elsewhere
        gone = next(n for n in others if n.me in holders)
        gone_index = holders.index(gone.me)
        await gone.stop()
        gone.directory.dht.shutdown()
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

        # not enough room anywhere: nothing is committed
        for node in alive:
            node.store.max_bytes = 10
            await node.tick(repair=False)
        with pytest.raises(CheckpointError, match="found a holder"):
            await write_checkpoint(writer, _shard(spec, epoch=20))
        assert [m.epoch for m, _ in writer.directory.manifests(1)] == [10]
        for node in alive:
            await node.stop()

    asyncio.run(main())


def test_views_count_only_live_holders_of_the_listed_hash(tiny_spec):
    from hivemind.utils import get_dht_time

    from swarm.checkpoint.catalog import choose_holders, holding, newest_restorable
    from swarm.protocol import CheckpointManifest, FragmentEntry, StorageInfo

    me = Identity.generate()
    frags = [FragmentEntry(index=i, sha256=f"{i}" * 64) for i in range(4)]
    manifest = CheckpointManifest(run_id=RUN, peer_id=me.peer_id, time=get_dht_time(), stage=0, epoch=30,
                                  shard_sha256="a" * 64, size=100, k=2, n=4, fragments=frags)
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


def test_a_draining_holder_hands_its_fragments_off(swarm_of_keepers):
    spec, nodes = swarm_of_keepers
    writer = nodes[0]

    async def main():
        for node in nodes:
            await node.start(await node.directory.dht.replicate_p2p())
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
