"""One all-reduce phase among in-process peers (direct calls instead of libp2p): results, failures, refusals."""

import asyncio

import pytest
import torch

from swarm.averaging.aggregation import make_aggregator
from swarm.averaging.allreduce import PartitionReducer, RoundFailed, decode_part, run_phase
from swarm.averaging.compression import Phase
from swarm.net.codecs import make_codec
from swarm.averaging.reducer import ReducePolicy, partition_bounds
from swarm.protocol import AveragingReply

PEERS = ["a", "b", "c"]


def _run(vectors, codec_name="float32", aggregator="mean", fail=None, tamper=None):
    """Run one phase on every peer; ``fail``: a reducer that errors, ``tamper``: one that alters its bytes."""
    codec = make_codec(codec_name)
    numel = vectors[0].numel()
    bounds = partition_bounds(numel, [1.0] * len(PEERS), codec.block)

    async def main():
        reducers = {p: PartitionReducer(numel=b - a, senders=frozenset(PEERS), codec=codec,
                                        aggregator=make_aggregator(aggregator), policy=ReducePolicy(), timeout=5.0)
                    for p, (a, b) in zip(PEERS, bounds)}

        def sender(me):
            async def send(peer, meta, encoded):
                if peer == fail:
                    return AveragingReply(error="reducer crashed"), []
                reply, out = await reducers[peer].submit(me, decode_part(meta, encoded, reducers[peer]), meta.weight)
                if peer == tamper and out:
                    out = [out[0].clone().add_(1)] + out[1:]
                return reply, out
            return send

        results = await asyncio.gather(*[
            run_phase(Phase(v, codec), group="g:0", me=p, peers=PEERS, fractions=[1.0] * 3, weight=4.0,
                      reducer=reducers[p], send=sender(p)) for p, v in zip(PEERS, vectors)], return_exceptions=True)
        return results

    return asyncio.run(main())


def _vectors(n=5000):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=gen) for _ in PEERS]


def test_identity_phase_gives_every_peer_the_exact_mean():
    vs = _vectors()
    outs = _run(vs)
    for o in outs:
        assert torch.allclose(o.result.aggregate, sum(vs) / 3, atol=1e-6)


def test_compressed_phase_gives_every_peer_identical_bits():
    outs = _run(_vectors(), "blockwise8bit", "centered_clip")
    assert all(torch.equal(o.result.aggregate, outs[0].result.aggregate) for o in outs)


def test_a_failed_reducer_fails_the_phase_for_everyone_instead_of_partial_results():
    outs = _run(_vectors(), fail="b")
    assert all(isinstance(o, RoundFailed) and "reducer b" in str(o) for o in outs[::2])


def test_an_aggregate_that_does_not_match_its_digest_fails_the_phase():
    outs = _run(_vectors(), tamper="c")
    assert isinstance(outs[0], RoundFailed) and "digest" in str(outs[0])


def test_a_nan_part_is_rejected_and_the_others_still_average():
    vs = _vectors()
    vs[2] = vs[2].clone()
    vs[2][7] = float("nan")
    outs = _run(vs)
    assert not isinstance(outs[0], Exception)
    assert not outs[2].replies["a"].accepted and "NaN" in outs[2].replies["a"].reason
    assert torch.isfinite(outs[0].result.aggregate).all()
    a, b = partition_bounds(5000, [1.0] * 3, 1)[0]
    assert torch.allclose(outs[0].result.aggregate[a:b], ((vs[0] + vs[1]) / 2)[a:b], atol=1e-6)


@pytest.mark.parametrize("codec", ["float32", "float16", "blockwise8bit"])
def test_wrong_codec_or_size_is_refused(codec):
    red = PartitionReducer(numel=10, senders=frozenset(PEERS), codec=make_codec(codec),
                           aggregator=make_aggregator("mean"), policy=ReducePolicy(), timeout=1.0)
    from swarm.protocol import AveragingPart
    meta = AveragingPart(group="g", partition=0, weight=1.0, numel=9, codec=codec, digest="")
    assert isinstance(decode_part(meta, [torch.zeros(9)], red), ValueError)
    meta = meta.model_copy(update={"numel": 10, "codec": "zip"})
    assert isinstance(decode_part(meta, [torch.zeros(10)], red), ValueError)
