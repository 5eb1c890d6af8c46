"""Fragment transfer over real libp2p (two hivemind DHT nodes in this process)."""

import asyncio
import random

import pytest

from swarm.checkpoint.erasure import Fragment, FragmentError, split_into_fragments
from swarm.checkpoint.service import FragmentService, get_fragment, put_fragment
from swarm.checkpoint.store import FragmentStore
from swarm.net.transport import gather as _original_gather
from tests.conftest import endorsed

RUN = "tiny-aaaaaaaaaaaaaaaa"


@pytest.mark.timeout(120)
def test_put_and_get_fragments_with_verification_and_refusals(dhts, tmp_path):
    holder_dht, client_dht = dhts
    store = FragmentStore(tmp_path, max_bytes=50_000, putter_share=1)  # (one putter here: the whole budget)
    fragments = split_into_fragments(random.Random(0).randbytes(25_600), 2, 4)  # 4 fragments of 12,800 bytes

    async def main():
        holder_p2p = await holder_dht.replicate_p2p()
        await FragmentService(store, RUN, num_stages=2).add_p2p_handlers(holder_p2p, namespace=RUN)
        p2p = await client_dht.replicate_p2p()
        holder = str(holder_dht.peer_id)
        for f in fragments[:3]:
            await put_fragment(p2p, holder, RUN, 0, 5, f)
        got = await get_fragment(p2p, holder, RUN, 0, 5, 1, fragments[1].sha256)
        assert got == fragments[1]
        with pytest.raises(FragmentError, match="budget"):  # a 4th would exceed 50,000 bytes
            await put_fragment(p2p, holder, RUN, 0, 5, fragments[3])
        with pytest.raises(FragmentError, match="not held here"):
            await get_fragment(p2p, holder, RUN, 0, 5, 3, fragments[3].sha256)
        with pytest.raises(FragmentError, match="does not match its hash"):
            await put_fragment(p2p, holder, RUN, 0, 6, Fragment(0, b"x" * 10, fragments[0].sha256))
        with pytest.raises(FragmentError, match="serves no fragments of run tiny-bbbb"):
            await put_fragment(p2p, holder, "tiny-bbbb", 0, 5, fragments[0])
        with pytest.raises(FragmentError, match="has stages 0..1, not 9223372036854775807"):  # junk nobody collects
            await put_fragment(p2p, holder, RUN, 2**63 - 1, 5, fragments[0])
        with pytest.raises(FragmentError, match="not held here"):  # asked for another hash in that slot
            await get_fragment(p2p, holder, RUN, 0, 5, 0, fragments[1].sha256)
        # (a holder serving bytes that do not match: tests/test_fragment_keeper.py, the client verifies and bans)

    asyncio.run(main())
    assert sorted(h.index for h in store.held()) == [0, 1, 2]


@pytest.mark.timeout(120)
def test_a_put_is_judged_at_its_first_chunk_and_bounded_by_the_runs_largest_fragment(dhts, tmp_path, monkeypatch):
    """An outsider's put is refused on its metadata, before the holder reads its bytes (an 8 MiB fragment costs
    the holder one chunk), and nobody's fragment may exceed the run's largest (the store's whole budget before)."""
    import swarm.checkpoint.service as service
    from types import SimpleNamespace

    holder_dht, client_dht = dhts
    store = FragmentStore(tmp_path, max_bytes=1 << 30)
    small = split_into_fragments(random.Random(0).randbytes(25_600), 2, 4)[0]  # 12,800 bytes
    big = split_into_fragments(random.Random(1).randbytes(16 << 20), 2, 2)[0]  # 8 MiB
    outsider = str(client_dht.peer_id)
    async def outsider_refused(putter, *_):
        return "not a server of stage 0" if putter == outsider else None

    async def anyone(*_):
        return None

    authority = SimpleNamespace(may_put=outsider_refused)
    read = []  # the byte limit of every fragment stream the holder read (the client's reads have no deadline)

    def counting(stream, **kw):
        if kw.get("deadline_s") == service.PUT_DEADLINE_S:
            read.append(kw["max_bytes"])
        return _original_gather(stream, **kw)

    monkeypatch.setattr(service, "gather", counting)

    async def main():
        holder_p2p = await holder_dht.replicate_p2p()
        await FragmentService(store, RUN, num_stages=2, authority=authority, max_fragment_bytes=10_000
                              ).add_p2p_handlers(holder_p2p, namespace=RUN)
        p2p = await client_dht.replicate_p2p()
        holder = str(holder_dht.peer_id)
        with pytest.raises(FragmentError, match="not a server of stage 0"):
            await put_fragment(p2p, holder, RUN, 0, 5, small)
        with pytest.raises(FragmentError):  # (its refusal may be cut off with the unread rest of the stream)
            await put_fragment(p2p, holder, RUN, 0, 5, big)
        assert read == [], "the holder read an outsider's fragment"
        authority.may_put = anyone
        with pytest.raises(FragmentError, match="exceeds 10000 bytes"):
            await put_fragment(p2p, holder, RUN, 0, 5, small)
        assert read == [10_000]

    asyncio.run(main())
    assert not list(store.held())


@pytest.mark.timeout(120)
def test_a_holder_takes_only_manifests_that_verify_and_list_its_fragments(dhts, tmp_path):
    from hivemind.utils import get_dht_time

    from swarm.checkpoint.service import put_manifest
    from swarm.identity import Identity
    from swarm.protocol import CheckpointManifest, FragmentEntry, seal

    holder_dht, client_dht = dhts
    store = FragmentStore(tmp_path, max_bytes=1 << 20)
    fragments = split_into_fragments(random.Random(1).randbytes(4096), 2, 3)
    writer = Identity.generate()

    def manifest(entries, run_id=RUN):
        return CheckpointManifest(run_id=run_id, peer_id=writer.peer_id, time=get_dht_time(), stage=0, epoch=5,
                                  shard_sha256="a" * 64, size=4096, k=2, n=3, fragments=entries,
                                  **endorsed(run_id, writer, stage=0, epoch=5))

    good = seal(manifest([FragmentEntry(index=f.index, sha256=f.sha256) for f in fragments]), writer)
    wrong = seal(manifest([FragmentEntry(index=f.index, sha256="b" * 64) for f in fragments]), writer)
    forged = bytearray(good)
    forged[-5] ^= 1

    async def main():
        holder_p2p = await holder_dht.replicate_p2p()
        await FragmentService(store, RUN).add_p2p_handlers(holder_p2p, namespace=RUN)
        p2p = await client_dht.replicate_p2p()
        holder = str(holder_dht.peer_id)
        with pytest.raises(FragmentError, match="no fragments of stage 0 epoch 5|does not list"):
            await put_manifest(p2p, holder, RUN, good)  # holds nothing of that checkpoint yet
        await put_fragment(p2p, holder, RUN, 0, 5, fragments[2])
        with pytest.raises(FragmentError, match="does not list the fragments held here"):
            await put_manifest(p2p, holder, RUN, wrong)
        with pytest.raises(FragmentError, match="signature|malformed"):
            await put_manifest(p2p, holder, RUN, bytes(forged))
        await put_manifest(p2p, holder, RUN, good)

    asyncio.run(main())
    assert store.manifest(RUN, 0, 5) == good and [(s, e) for s, e, _ in store.committed(RUN)] == [(0, 5)]


def test_a_limit_given_as_a_callable_is_computed_once_at_the_first_put_and_capped_by_the_store(tmp_path, tiny_spec):
    """The fragment keeper hands its bound over as a callable (swarm.checkpoint.keeper.max_fragment_bytes): the
    stages' build on the meta device imports 1.6-1.9 s of torch, which a joining server would otherwise wait for."""
    from swarm.checkpoint.keeper import max_fragment_bytes
    from swarm.checkpoint.shard import max_shard_bytes

    calls = []

    def limit() -> int:
        calls.append(1)
        return max_fragment_bytes(tiny_spec)

    store = FragmentStore(tmp_path, max_bytes=1 << 30)
    service = FragmentService(store, RUN, num_stages=2, max_fragment_bytes=limit)
    assert calls == []  # nothing computed as the service is built

    async def main():
        return [await service.max_fragment_bytes() for _ in range(2)]

    expected = 2 * -(-max_shard_bytes(tiny_spec.model) // tiny_spec.checkpoint.fragments_needed)
    assert asyncio.run(main()) == [expected, expected] and calls == [1]
    small = FragmentService(FragmentStore(tmp_path / "small", max_bytes=1000), RUN, max_fragment_bytes=limit)
    assert asyncio.run(small.max_fragment_bytes()) == 1000  # never above the store's budget
