"""Fragment transfer over real libp2p (two hivemind DHT nodes in this process)."""

import asyncio
import random

import pytest

from swarm.checkpoint.erasure import Fragment, FragmentError, split_into_fragments
from swarm.checkpoint.service import FragmentService, get_fragment, put_fragment
from swarm.checkpoint.store import FragmentStore

RUN = "tiny-aaaaaaaaaaaaaaaa"


@pytest.mark.timeout(120)
def test_put_and_get_fragments_with_verification_and_refusals(dhts, tmp_path):
    holder_dht, client_dht = dhts
    store = FragmentStore(tmp_path, max_bytes=50_000)
    fragments = split_into_fragments(random.Random(0).randbytes(25_600), 2, 4)  # 4 fragments of 12,800 bytes

    async def main():
        holder_p2p = await holder_dht.replicate_p2p()
        await FragmentService(store, RUN).add_p2p_handlers(holder_p2p, namespace=RUN)
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
        with pytest.raises(FragmentError, match="does not match its hash"):  # the client checks what it gets
            await get_fragment(p2p, holder, RUN, 0, 5, 0, fragments[1].sha256)

    asyncio.run(main())
    assert sorted(h.index for h in store.held()) == [0, 1, 2]
