"""Measuring links over real libp2p (swarm.net.links): a ping's echo comes back in full, a server that does not
answer is left out, the DHT's peers give a round trip, and a stage server refuses an echo larger than the
protocol's bound without harm."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
from hivemind.p2p import P2PHandlerError
from hivemind.proto import runtime_pb2

from swarm.config import PROTOCOL_VERSION
from swarm.net.links import PROBE_BYTES, dht_round_trip, measure_links
from swarm.net.stage_rpc import ping_seconds, stage_stub
from swarm.net.transport import gather, stream_out
from swarm.protocol import MAX_ECHO_BYTES, ServerInfo, ServerState
from swarm.server.stage import StageServer
from tests.conftest import TINY

RUN = "tiny-aaaaaaaaaaaaaaaa"


def _info(dht, stage: int, peer: str) -> ServerInfo:
    return ServerInfo(run_id=RUN, peer_id=peer, time=0, stage=stage, state=ServerState.ONLINE, throughput=1.0,
                      p2p_id=str(dht.peer_id))


@pytest.mark.timeout(120)
def test_a_measurement_times_pings_and_echoes_and_an_oversized_echo_is_refused(dhts):
    server_dht, client_dht = dhts
    server = StageServer(TINY, RUN, 0)

    async def main():
        replicas = [await server_dht.replicate_p2p(), await client_dht.replicate_p2p()]
        try:
            await checks(*replicas)
        finally:
            for replica in reversed(replicas):  # (each leaves a Unix socket file in /tmp until shut down)
                await replica.shutdown()

    async def checks(served, p2p):
        await server.add_p2p_handlers(served, namespace=RUN)
        live, gone = _info(server_dht, 0, "s0"), _info(server_dht, 1, "s1")  # nothing serves stage 1 there
        bare = await ping_seconds(p2p, live, RUN)
        echoed = await ping_seconds(p2p, live, RUN, echo_bytes=MAX_ECHO_BYTES)
        assert bare is not None and echoed is not None and bare > 0 and echoed > 0
        assert await ping_seconds(p2p, gone, RUN) is None

        link = await measure_links(p2p, [live, gone], RUN)
        assert link.servers == 1, "a server that does not answer is not measured"
        assert 0 < link.round_trip_s < 3 and link.rate is not None and link.rate > PROBE_BYTES  # > 1 probe per s
        assert (await measure_links(p2p, [live], RUN, probe_bytes=0)).rate is None
        assert await measure_links(p2p, [gone], RUN) is None
        rtt = await dht_round_trip(client_dht)  # (a run with no server yet: the DHT's peers, here the server's node)
        assert rtt is not None and 0 < rtt < 3

        # a request for more than the bound (sent raw: our own schema would not build it) is refused, no echo
        raw = msgpack.packb({"v": PROTOCOL_VERSION, "run_id": RUN, "stage": 0, "echo_bytes": MAX_ECHO_BYTES + 1})
        stub = stage_stub(p2p, live, RUN)
        with pytest.raises(P2PHandlerError, match="echo_bytes"):
            await gather(await stub.rpc_ping(stream_out(runtime_pb2.ExpertRequest, raw, [])), 1 << 22,
                         max_tensors=1)
        assert await ping_seconds(p2p, live, RUN) is not None, "the server still answers"

    asyncio.run(main())
