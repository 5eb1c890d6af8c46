"""Wire probes: what malformed or hostile stage requests cost a live stage server, in peak memory.

    python bench/wire_probes.py [--spec runs/tiny.toml]

Starts a coordinator and one stage-0 server (separate processes, real p2pd) and, as an attacker with nothing
but a fresh key, sends the server's ``rpc_forward`` / ``rpc_ping``:

* ``legit``: 8 well-formed training micro-batches (the baseline);
* ``dtype_U16777216``: a 2-byte tensor whose dtype string makes numpy allocate 64 MiB per element;
* ``declared_8GiB``: a tensor header declaring 2**31 float32 values, followed by 48 MiB of chunks;
* ``ping_48MiB``: a 48 MiB tensor (in 1 MiB chunks) sent with a ping, which takes none;
* ``unchunked_48MiB``: one 48 MiB message (a single chunk);
* ``pings_2000``: 2000 well-formed pings from one peer, one after the other as fast as it can (past its token
  bucket, :mod:`swarm.net.quota`, the server refuses them at once);
* ``stalled_40``: 40 forward streams that send their first chunk and never finish (one peer: those beyond
  its quota, :mod:`swarm.net.quota`, are refused at once).

A sampler reads the server's resident memory (its Python process plus its p2pd, ``/proc/<pid>/status``) every
20 ms; each probe's figure is the peak above the level just before it. The last line of stdout is one JSON
object: per probe ``peak_growth_mb``, ``ratio_to_legit``, ``refused`` (the server answered every request with an
error or closed the stream), ``refused_count`` (how many it refused) and ``seconds``; for ``stalled_40`` also
how many streams the server refused within 2 s (``refused_at_once``) and had closed when its deadline
(``timeouts.forward_s``, then ``backward_s``) had passed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from hivemind.compression import serialize_torch_tensor  # noqa: E402
from hivemind.p2p import PeerID  # noqa: E402
from hivemind.proto import runtime_pb2  # noqa: E402

from coordinator.launch import LocalSwarm  # noqa: E402
from swarm.config import RunSpec  # noqa: E402
from swarm.settings import PeerSettings  # noqa: E402
from swarm.data import prepare_dataset  # noqa: E402
from swarm.net.dht import connect_run  # noqa: E402
from swarm.protocol import ForwardRequest, PingRequest, ServerState, pack_message  # noqa: E402
from swarm.server.stage import StageServer  # noqa: E402
from swarm.net.transport import CHUNK_BYTES  # noqa: E402

MB = 1 << 20


def _rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _tree(pid: int) -> list[int]:
    """``pid`` and its children (the peer's p2pd and hivemind's helper processes)."""
    pids, frontier = [pid], [pid]
    while frontier:
        parent = frontier.pop()
        try:
            kids = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        pids += [int(k) for k in kids]
        frontier += [int(k) for k in kids]
    return pids


class Sampler(threading.Thread):
    """Resident memory (KiB) of a process tree every ``period_s`` seconds; :meth:`peak_since` reads it."""

    def __init__(self, pid: int, period_s: float = 0.02):
        super().__init__(daemon=True)
        self.pid, self.period_s, self.samples, self.running = pid, period_s, [], True

    def run(self) -> None:
        while self.running:
            self.samples.append((time.monotonic(), sum(_rss_kb(p) for p in _tree(self.pid))))
            time.sleep(self.period_s)

    def level(self) -> int:
        recent = [kb for t, kb in self.samples[-25:]]
        return sorted(recent)[len(recent) // 2] if recent else 0

    def peak_since(self, start: float) -> int:
        return max((kb for t, kb in self.samples if t >= start), default=0)


def _forward_meta(run_id: str, mb: str) -> bytes:
    return pack_message(ForwardRequest(run_id=run_id, stage=0, mb_id=mb, codec="float32"))


def _messages(meta: bytes, parts: list) -> list:
    return [runtime_pb2.ExpertRequest(metadata=meta, tensors=parts[:1])] + \
        [runtime_pb2.ExpertRequest(tensors=[p]) for p in parts[1:]]


def _chunks(total: int, **header) -> list:
    """A tensor header (first chunk) with ``header`` fields and ``total`` bytes in 1 MiB chunks."""
    first = runtime_pb2.Tensor(buffer=b"\0" * min(total, CHUNK_BYTES), compression=runtime_pb2.CompressionType.NONE,
                               **header)
    rest = [runtime_pb2.Tensor(buffer=b"\0" * CHUNK_BYTES) for _ in range(max(0, total - CHUNK_BYTES) // CHUNK_BYTES)]
    return [first] + rest


async def _send(stub, method: str, messages: list, hang: bool = False) -> bool:
    """Send ``messages`` on a new stream; True if the server refused (an error or an early end)."""
    async def requests():
        for m in messages:
            yield m
        if hang:
            await asyncio.Event().wait()

    try:
        async for _ in await getattr(stub, method)(requests()):
            pass
        return False
    except Exception:
        return True


async def _probes(p2p, server, run_id: str, spec: RunSpec, sampler: Sampler) -> dict:
    stub = StageServer.get_stub(p2p, PeerID.from_base58(server.p2p_id), namespace=run_id)
    b, t = spec.training.micro_batch_size, spec.data.seq_len
    ids = serialize_torch_tensor(torch.randint(0, spec.model.vocab_size, (b, t)))
    ping = pack_message(PingRequest(run_id=run_id, stage=0))
    probes = {
        "legit": [("rpc_forward", _messages(_forward_meta(run_id, f"ok{i}"), [ids])) for i in range(8)],
        "dtype_U16777216": [("rpc_forward", _messages(_forward_meta(run_id, "u"), [runtime_pb2.Tensor(
            buffer=b"ab", size=[1], dtype="U16777216", compression=runtime_pb2.CompressionType.NONE)]))],
        "declared_8GiB": [("rpc_forward", _messages(_forward_meta(run_id, "big"),
                                                    _chunks(48 * MB, size=[1 << 31], dtype="float32")))],
        "ping_48MiB": [("rpc_ping", _messages(ping, _chunks(48 * MB, size=[12 * MB], dtype="float32")))],
        "unchunked_48MiB": [("rpc_ping", [runtime_pb2.ExpertRequest(metadata=ping, tensors=[runtime_pb2.Tensor(
            buffer=b"\0" * 48 * MB, size=[12 * MB], dtype="float32")])])],
        "pings_2000": [("rpc_ping", _messages(ping, []))] * 2000,
    }
    out = {}
    for name, calls in probes.items():
        base, start = sampler.level(), time.monotonic()
        refused = [await _send(stub, method, msgs) for method, msgs in calls]
        await asyncio.sleep(1.0)  # let the sampler see what the server holds after the reply
        out[name] = {"peak_growth_mb": round(max(0, sampler.peak_since(start) - base) / 1024, 1),
                     "refused": all(refused), "refused_count": sum(refused),
                     "seconds": round(time.monotonic() - start, 2)}
    out["stalled_40"] = await _stalled(stub, run_id, spec, sampler, ids)
    legit = max(out["legit"]["peak_growth_mb"], 1.0)
    for figures in out.values():
        figures["ratio_to_legit"] = round(figures["peak_growth_mb"] / legit, 2)
    return out


async def _stalled(stub, run_id: str, spec: RunSpec, sampler: Sampler, ids) -> dict:
    """40 forward streams that send one chunk and hang; how many the server closed by its deadline + 5 s."""
    base, start = sampler.level(), time.monotonic()
    deadline = max(spec.timeouts.forward_s, spec.timeouts.backward_s) + 5.0
    half = runtime_pb2.Tensor(buffer=ids.buffer[: len(ids.buffer) // 2], size=ids.size, dtype=ids.dtype,
                              compression=ids.compression)
    tasks = [asyncio.create_task(_send(stub, "rpc_forward", _messages(_forward_meta(run_id, f"s{i}"), [half]),
                                       hang=True)) for i in range(40)]
    at_once, _ = await asyncio.wait(tasks, timeout=2.0)  # beyond the per-peer quota: refused at once
    done, pending = await asyncio.wait(tasks, timeout=deadline - 2.0)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return {"peak_growth_mb": round(max(0, sampler.peak_since(start) - base) / 1024, 1), "refused": not pending,
            "closed_by_server": len(done), "refused_at_once": len(at_once),
            "seconds": round(time.monotonic() - start, 2)}


def run(spec_path: Path, cache_dir: Path) -> dict:
    spec = RunSpec.from_toml(spec_path)
    prepare_dataset(spec, cache_dir)
    workdir = Path(tempfile.mkdtemp(prefix="swarm-probes-"))
    with LocalSwarm(spec_path, workdir, cache_dir) as swarm:
        address = swarm.start_coordinator()
        peer = swarm.start_peer("server", "--stage", "0")
        dht, directory, _, _ = connect_run(address, PeerSettings(host="127.0.0.1"))
        sampler = Sampler(peer.proc.pid)
        try:
            deadline = time.monotonic() + 180
            while not (online := [s for s in directory.servers(0) if s.state == ServerState.ONLINE]):
                if time.monotonic() > deadline or not peer.alive():
                    raise TimeoutError("the stage-0 server did not come online")
                time.sleep(0.5)
            sampler.start()
            time.sleep(1.0)

            async def main():
                return await _probes(await dht.replicate_p2p(), online[0], directory.run_id, spec, sampler)

            result = asyncio.run(main())
            result["server_alive"] = peer.alive()
        finally:
            sampler.running = False
            dht.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", type=Path, default=ROOT / "runs" / "tiny.toml")
    args = parser.parse_args()
    result = run(args.spec, PeerSettings().cache_dir)
    print(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "ERROR")
    main()
