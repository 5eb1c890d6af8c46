"""In a run that admits only ticketed peers, every service of a server refuses a caller without a ticket before
reading its request: the fragment holder, the evidence service and the averagers' RPCs (whose gate runs in the
averager's own process, reading the run's tickets from the DHT there); and a renewed ticket reaches the averager
processes, which sign accusations with it. Real hivemind DHT nodes and p2pd daemons on loopback."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.mpfuture import MPFuture

from swarm.averaging.averager import RobustGradientAverager
from swarm.checkpoint.service import FragmentService, get_fragment
from swarm.checkpoint.store import FragmentStore
from swarm.identity import Identity
from swarm.net.directory import RunDirectory
from swarm.trust.convictions import ConvictionBook, EvidenceService, fetch_evidence
from swarm.trust.tickets import TicketGate, issue_ticket
from tests.conftest import keyed_dhts
from tests.test_tickets import SPEC

pytestmark = pytest.mark.timeout(180)


class _ShowsItsTicket(RobustGradientAverager):
    """Test-only: tells which ticket the averager's process signs with (its identity's), through its pipe."""

    def signing_ticket(self, timeout: float = 5.0) -> bytes:
        future = MPFuture()
        self._outer_pipe.send(("_signing_ticket", [], dict(future=future)))
        return future.result(timeout)

    async def _signing_ticket(self, future: MPFuture) -> None:
        future.set_result(self.identity.ticket)


async def _refusals(server: str, run_id: str, admitted, stranger) -> dict[str, list[str]]:
    """What the fragment holder and the evidence service at ``server`` answer each caller (p2p). A refusal whose
    error frame was lost (the stream closed empty: hivemind closes it right after an error, and p2pd sometimes resets
    it first; swarm.net.transport.delivering_refusals) is asked once more."""
    async def answer(call) -> str:
        for _ in range(3):
            try:
                await call()
                return ""
            except Exception as e:
                if "empty message" not in str(e):
                    return str(e)
        return "empty message, three times"

    out: dict[str, list[str]] = {}
    for name, p2p in (("admitted", admitted), ("stranger", stranger)):
        out[name] = [await answer(lambda: get_fragment(p2p, server, run_id, 0, 3, 0, "", timeout=20.0)),
                     await answer(lambda: fetch_evidence(p2p, server, SPEC, run_id, "someone"))]
    return out


async def _downloads(server: str, prefix: str, p2p) -> str:
    """The averager's answer to ``p2p``'s state download: "" (served, empty: gradient averagers share no state)
    or the error."""
    stub = RobustGradientAverager.get_stub(p2p, PeerID.from_base58(server), namespace=prefix)
    try:
        async for _ in await stub.rpc_download_state(averaging_pb2.DownloadRequest()):
            pass
        return ""
    except Exception as e:
        return str(e)


async def _joins(server: str, prefix: str, p2p) -> int:
    """The averager's first matchmaking answer to ``p2p`` asking it to lead a group (its code)."""
    stub = RobustGradientAverager.get_stub(p2p, PeerID.from_base58(server), namespace=prefix)
    request = averaging_pb2.JoinRequest(schema_hash=b"x", expiration=1e12, gather=b"", client_mode=False,
                                        group_key="ticketed.0b0")
    async for answer in await stub.rpc_join_group(request):
        return answer.code
    return -1


def test_a_ticketed_servers_services_and_averagers_refuse_strangers_and_take_a_renewed_ticket(tmp_path: Path):
    run_key = Identity.generate()
    nodes = keyed_dhts(3)
    averager = None
    try:
        (server_id, server_dht), (admitted_id, admitted_dht), (_, stranger_dht) = nodes
        run_id, _ = RunDirectory.seal_spec(SPEC, run_key)
        directory = RunDirectory(server_dht, run_id)
        issue_ticket(directory, run_key, admitted_id.peer_id, SPEC)
        first, server_id.ticket = issue_ticket(directory, run_key, server_id.peer_id, SPEC)  # the averager forks with it

        averager = _ShowsItsTicket([torch.nn.Parameter(torch.zeros(8))], dht=server_dht, prefix="ticketed",
                                   identity=server_id, run_id=run_id, gate=TicketGate(RunDirectory(server_dht, run_id)),
                                   target_group_size=2, min_matchmaking_time=1.0, request_timeout=1.0, start=True)
        server = str(server_dht.peer_id)

        async def scenario():
            p2ps = [await dht.replicate_p2p() for _, dht in nodes]
            store = FragmentStore(tmp_path / "fragments", 1 << 20, 2, grace_s=60.0)
            gate = TicketGate(directory)
            await FragmentService(store, run_id, num_stages=2, gate=gate).add_p2p_handlers(p2ps[0], namespace=run_id)
            book = ConvictionBook(run_id, server_id.peer_id, 0.05)
            await EvidenceService(SPEC, book, gate=gate).add_p2p_handlers(p2ps[0], namespace=run_id)
            answers = await _refusals(server, run_id, p2ps[1], p2ps[2])
            downloads = {name: await _downloads(server, "ticketed", p2p)
                         for name, p2p in (("admitted", p2ps[1]), ("stranger", p2ps[2]))}
            joins = {name: await _joins(server, "ticketed", p2p)
                     for name, p2p in (("admitted", p2ps[1]), ("stranger", p2ps[2]))}
            for p2p in p2ps:
                await p2p.shutdown()
            return answers, downloads, joins

        answers, downloads, joins = asyncio.run(scenario())
        assert all("ticket" not in a for a in answers["admitted"]), answers
        assert "not held here" in answers["admitted"][0] and "no evidence" in answers["admitted"][1], answers
        assert all("hold no valid ticket" in a for a in answers["stranger"]), answers
        assert downloads["admitted"] == "", downloads
        assert "hold no valid ticket" in downloads["stranger"], downloads
        # matchmaking: the stranger is refused as a protocol violation; the admitted peer gets hivemind's own answer
        assert joins["stranger"] == averaging_pb2.PROTOCOL_VIOLATION, joins
        assert joins["admitted"] not in (averaging_pb2.PROTOCOL_VIOLATION, -1), joins

        # a renewed ticket: the averager's process signs with it from now on
        assert averager.signing_ticket() == server_id.ticket
        renewed = issue_ticket(directory, run_key, server_id.peer_id, SPEC)[1]
        assert renewed != server_id.ticket
        averager.set_ticket(renewed)
        assert averager.signing_ticket() == renewed
        assert first.subject == server_id.peer_id
    finally:
        if averager is not None:
            averager.shutdown()
        for _, dht in nodes:
            dht.shutdown()
