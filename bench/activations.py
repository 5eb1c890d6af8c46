"""Activations (and their gradients) between stages through each wire codec: bytes against fp32, and the loss cost.

    python bench/activations.py [--spec runs/demo.toml] [--samples 6400] [--codecs none,blockwise8bit,...]
                                [--shares 0,1] [--direction both|forward|backward]

The single-process reference (:func:`swarm.reference.train_reference`, the demo's stages chained, one AdamW)
trains the same samples once per codec, with the codec applied where a stage hands its activations to the next:
the forward sends the activations through the codec's encode and decode, the backward sends their gradient
through it too (rounded as gradients, a seed per micro-batch), as :mod:`swarm.server.stage` and
:mod:`swarm.trainer.pipeline` do on the wire. ``bytes_ratio`` is fp32's
payload over the codec's for one micro-batch's activations (hivemind's serialization of the tensors
:func:`swarm.net.codecs.pack_tensors` makes, the bytes a stage RPC carries); ``val_loss`` is the mean over the
validation split's first 32 micro-batches after training, ``loss_cost`` its change against fp32's. With several
``--shares`` each codec trains once on each data share (other samples, the same number) and ``val_loss`` is the
mean, ``val_losses`` each share's, ``loss_costs`` each share's change against fp32 on the same share: how far a
codec's cost moves with the data tells a real cost from the noise of one run. ``--direction forward`` (or
``backward``) puts the codec on the activations (or their gradients) only: which of the two a codec's cost comes
from.

Prints one JSON line per codec, then ``{"results": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from hivemind.compression import serialize_torch_tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from harness import val_loss  # noqa: E402

from swarm.net.codecs import ACTIVATION_CODECS, pack_tensors, unpack_tensors  # noqa: E402
from swarm.config import RunSpec  # noqa: E402
from swarm.settings import PeerSettings  # noqa: E402
from swarm.data import prepare_dataset  # noqa: E402
from swarm.reference import train_reference  # noqa: E402


class _OverTheWire(torch.autograd.Function):
    """Identity whose forward output and backward gradient are what the codec's receiver decodes."""

    @staticmethod
    def forward(ctx, h, codec, seed, direction="both"):
        ctx.codec, ctx.seed, ctx.direction = codec, seed, direction
        if direction == "backward":
            return h.clone()
        return unpack_tensors(pack_tensors([h], codec), codec)[0].to(h.dtype)

    @staticmethod
    def backward(ctx, grad):
        if ctx.direction == "forward":
            return grad, None, None, None
        wire = pack_tensors([grad], ctx.codec, gradients=True, seed=ctx.seed)
        return unpack_tensors(wire, ctx.codec)[0].to(grad.dtype), None, None, None


def payload_bytes(h: torch.Tensor, codec: str) -> int:
    """Serialized bytes of ``h`` packed with ``codec`` (what one activation message carries)."""
    return sum(len(serialize_torch_tensor(t).buffer) for t in pack_tensors([h], codec))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", type=Path, default=ROOT / "runs" / "demo.toml")
    ap.add_argument("--samples", type=int, default=6400, help="training samples per codec (100 demo epochs)")
    ap.add_argument("--codecs", default="none,blockwise8bit,blockwise4bit,blockwise3bit,lowrank_ternary")
    ap.add_argument("--shares", default="0", help="data shares to train each codec on (comma-separated)")
    ap.add_argument("--direction", default="both", choices=["both", "forward", "backward"],
                    help="the codec on the activations and their gradients, or on one of them")
    args = ap.parse_args()
    spec = RunSpec.from_toml(args.spec)
    dataset = prepare_dataset(spec, PeerSettings().cache_dir)
    h = torch.randn(spec.training.micro_batch_size, spec.data.seq_len, spec.model.d_model)
    fp32 = payload_bytes(h, "float32")
    shares = [int(s) for s in args.shares.split(",")]
    results = []
    for name in args.codecs.split(","):
        codec = ACTIVATION_CODECS[name]
        losses, seconds = [], 0.0
        for share in shares:
            torch.manual_seed(0)
            calls = iter(range(1 << 62))
            ref = train_reference(spec, dataset, share=share, max_samples=args.samples,
                                  between_stages=None if name == "none"
                                  else lambda t, c=codec: _OverTheWire.apply(t, c, next(calls), args.direction))
            losses.append(val_loss(torch.nn.Sequential(*ref.stages), dataset, spec))
            seconds += ref.seconds
        row = {"codec": name, "direction": args.direction, "bytes_ratio": round(fp32 / payload_bytes(h, codec), 2),
               "val_loss": round(sum(losses) / len(losses), 4), "val_losses": [round(v, 4) for v in losses],
               "seconds": round(seconds, 1)}
        results.append(row)
        print(json.dumps(row), flush=True)
    base = results[0]
    for row in results:
        row["loss_cost"] = f"{100 * (row['val_loss'] - base['val_loss']) / base['val_loss']:+.2f}%"
        row["loss_costs"] = [f"{100 * (v - b) / b:+.2f}%" for v, b in zip(row["val_losses"], base["val_losses"])]
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
