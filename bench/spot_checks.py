"""Spot checks: how soon a lying stage server is convicted, how often an honest one is, and what checks cost.

    python bench/spot_checks.py [--seeds 20] [--rate 0.05] [--fraction 0.1] [--max-micro-batches 2000]

One process, real libp2p: a 3-stage tiny GPT (``runs/tiny.toml`` cut into three 1-layer stages) on the
Shakespeare corpus, each stage server on its own DHT node and key. Stage 1 has three servers: a liar
(:class:`~swarm.attacks.LyingStageServer`, noise on ``fraction`` of its training forwards and backwards), an
honest one, and an honest one whose parameters are off by 1e-3 of their magnitude (the drift between state
averagings); stages 0 and 2 have two honest servers each, so every stage's calls can be checked. Per seed a
fresh trainer pipeline (:class:`~swarm.trainer.pipeline.RemotePipeline`, ``spot_checks.rate``) streams training
micro-batches until it convicts the liar (or ``--max-micro-batches``); the figures are the trainer's
micro-batches and the liar's own calls until then, and every conviction of an honest server.

Cost: the same trainer streams ``--cost-batches`` micro-batches through honest servers only, alternately with
checks off and on (pairs, same servers, same batches); ``throughput_ratio`` is samples/s with checks over
without. Here the servers share the trainer's two cores, so the ratio also carries the checking servers'
extra compute, which in a swarm runs on other machines: it is an upper bound of the trainer's cost.

The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from hivemind.utils import get_dht_time  # noqa: E402

from swarm.attacks import LyingStageServer  # noqa: E402
from swarm.config import RunSpec  # noqa: E402
from swarm.settings import PeerSettings  # noqa: E402
from swarm.data import prepare_dataset  # noqa: E402
from swarm.net.dht import spawn_dht  # noqa: E402
from swarm.net.directory import AsyncRunDirectory, RunDirectory  # noqa: E402
from swarm.identity import Identity  # noqa: E402
from swarm.trainer.pipeline import RemotePipeline  # noqa: E402
from swarm.protocol import ServerInfo, ServerState  # noqa: E402
from swarm.server.stage import StageServer  # noqa: E402
from swarm.trust.spotcheck import SpotChecker  # noqa: E402

RUN = "tiny-aaaaaaaaaaaaaaaa"
LOOPBACK = dict(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_relay=False, use_auto_relay=False)


def drifted(*args, **kwargs) -> StageServer:
    server = StageServer(*args, **kwargs)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in server.module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-3 * p.abs().mean())
    return server


async def start(spec: RunSpec, layout, nodes) -> list[StageServer]:
    """Serve ``layout`` = [(stage, factory)] on DHT nodes appended to ``nodes``, announced ONLINE."""
    servers = []
    for stage, make in layout:
        ident = Identity.generate()
        peers = [str(m) for m in nodes[0].get_visible_maddrs()] if nodes else []
        dht = spawn_dht(ident, **(LOOPBACK | {"initial_peers": peers}))
        nodes.append(dht)
        server = make(spec, RUN, stage, identity=ident)
        await server.add_p2p_handlers(await dht.replicate_p2p(), namespace=RUN)
        info = ServerInfo(run_id=RUN, peer_id=ident.peer_id, time=get_dht_time(), stage=stage,
                          state=ServerState.ONLINE, throughput=10.0, p2p_id=ident.p2p_id)
        RunDirectory(dht, RUN, ttl=3600).announce_server(info, ident)
        server.peer_id = ident.peer_id
        servers.append(server)
    return servers


async def until_convicted(spec, pipe, dataset, liar, max_batches: int, rng: random.Random) -> dict:
    b, n = spec.training.micro_batch_size, dataset.num_samples("train")
    calls_before, sent = liar.answered, 0
    while sent < max_batches and liar.peer_id not in pipe.listener.convicted:
        start = rng.randrange(0, n - b)
        await pipe.forward_loss(dataset.batch(list(range(start, start + b))), train=True)
        sent += 1
        if sent % 8 == 0:
            await pipe.listener.drain()
    await pipe.listener.drain()
    return dict(convicted=liar.peer_id in pipe.listener.convicted, micro_batches=sent,
                liar_calls=liar.answered - calls_before,
                honest_convicted=len(set(pipe.listener.convicted) - {liar.peer_id}),
                counts=dict(pipe.listener.counts))


async def cost(spec, make_pipe, dataset, pairs: int, per_leg: int) -> float:
    b = spec.training.micro_batch_size
    batches = [dataset.batch(list(range(i * b, (i + 1) * b))) for i in range(per_leg)]
    rates = {0.0: [], spec.spot_checks.rate: []}
    for i in range(pairs):
        for rate in (list(rates) if i % 2 == 0 else list(rates)[::-1]):
            pipe = make_pipe(spec.updated(spot_checks={"rate": rate}), 1000 + i)
            started = time.perf_counter()
            for batch in batches:
                await pipe.forward_loss(batch, train=True)
            await pipe.listener.drain()
            rates[rate].append(len(batches) * b / (time.perf_counter() - started))
    off, on = (statistics.median(v) for v in rates.values())
    return on / off


class CountingLiar(LyingStageServer):
    """Counts the training calls it answers (its lies are a fraction of them)."""
    answered = 0

    def forward(self, key, x, targets, train):
        self.answered += int(train)
        return super().forward(key, x, targets, train)

    def backward(self, key, grad_out, x):
        self.answered += 1
        return super().backward(key, grad_out, x)


class Swarm:
    """DHT nodes serving a layout, and a trainer node; shut down on exit."""

    def __init__(self, spec: RunSpec):
        self.spec, self.nodes = spec, []

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        for dht in reversed(self.nodes):
            dht.shutdown()

    async def serve(self, layout) -> list[StageServer]:
        servers = await start(self.spec, layout, self.nodes)
        ident = Identity.generate()
        self.trainer = spawn_dht(ident, **(LOOPBACK | {"initial_peers": [str(m) for m in
                                                                         self.nodes[0].get_visible_maddrs()]}))
        self.nodes.append(self.trainer)
        self.p2p = await self.trainer.replicate_p2p()
        return servers

    def pipeline(self, spec: RunSpec, seed: int) -> RemotePipeline:
        return RemotePipeline(spec, RUN, AsyncRunDirectory(RunDirectory(self.trainer, RUN, ttl=3600)), self.p2p,
                              listener=SpotChecker(spec, RUN, self.p2p, rng=random.Random(seed)))


async def detection(spec, dataset, args) -> list[dict]:
    liar = lambda *a, **kw: CountingLiar(*a, fraction=args.fraction, seed=0, **kw)  # noqa: E731
    async with Swarm(spec) as swarm:
        servers = await swarm.serve([(0, StageServer), (0, StageServer), (1, liar), (1, StageServer), (1, drifted),
                                     (2, StageServer), (2, StageServer)])
        runs = []
        for seed in range(args.seeds):
            servers[2]._rng.manual_seed(seed)
            runs.append(await until_convicted(spec, swarm.trainer.pipeline(spec, seed), dataset, servers[2],
                                              args.max_micro_batches, random.Random(seed)))
            print(json.dumps({"seed": seed, **runs[-1]}), flush=True)
        return runs


async def main(args) -> dict:
    spec = RunSpec.from_toml(ROOT / "runs" / "tiny.toml").updated(
        model={"n_layers": 3, "stage_layers": [1, 1, 1]}, spot_checks={"rate": args.rate})
    dataset = prepare_dataset(spec, PeerSettings().cache_dir)
    runs = await detection(spec, dataset, args)
    async with Swarm(spec) as swarm:
        await swarm.serve([(0, StageServer), (0, StageServer), (1, StageServer), (1, drifted), (2, StageServer),
                           (2, StageServer)])
        ratio = await cost(spec, swarm.trainer.pipeline, dataset, args.cost_pairs, args.cost_batches)
    caught = [r for r in runs if r["convicted"]]
    return dict(
        rate=args.rate, fraction=args.fraction, seeds=args.seeds,
        convicted=len(caught), honest_convictions=sum(r["honest_convicted"] for r in runs),
        micro_batches_median=statistics.median(r["micro_batches"] for r in caught) if caught else None,
        micro_batches_max=max((r["micro_batches"] for r in caught), default=None),
        liar_calls_median=statistics.median(r["liar_calls"] for r in caught) if caught else None,
        liar_calls_max=max((r["liar_calls"] for r in caught), default=None),
        throughput_ratio=round(ratio, 3),
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--rate", type=float, default=0.05)
    parser.add_argument("--fraction", type=float, default=0.1)
    parser.add_argument("--max-micro-batches", type=int, default=2000)
    parser.add_argument("--cost-pairs", type=int, default=3)
    parser.add_argument("--cost-batches", type=int, default=60)
    print(json.dumps(asyncio.run(main(parser.parse_args()))))
