"""Local kernels against their plain-PyTorch references, a stage end to end, and mixed precision.

    python bench/kernels.py [--tokens 4096] [--vocab 32768] [--width 256] [--repeats 3] [--steps 100]
                            [--spec runs/demo.toml] [--skip-loss] [--cuda-only]

1. Fused linear + cross-entropy (:func:`swarm.kernels.linear_cross_entropy`) against the eager head + loss
   (:func:`swarm.kernels.linear_cross_entropy_reference`) at a large vocabulary: loss and backward of ``tokens``
   hidden states of ``width`` through a ``vocab`` x ``width`` head, float32 on the CPU. Each variant runs in its
   own fresh process, so its peak memory is its own: ``peak_bytes`` is the process's peak resident set
   (``ru_maxrss``) minus its resident set after the inputs were made; ``seconds`` the best of ``repeats``.
   ``fused_ce_memory_ratio`` is the eager peak over the fused one.
2. Each small kernel (norms, bias + GELU, SwiGLU, RoPE) of the device's fused backend (``compiled`` on a CPU,
   ``triton`` on a GPU, there also against ``torch.compile`` of its reference: ``speedup_vs_compiled``) against
   its eager reference, forward + backward, at the device's sizes (``bench/kernel_ops.py``).
3. ``stage_speedup_cpu``: tokens/s of forward + backward through every stage of ``--spec``'s model, one
   micro-batch, bf16 autocast + compiled kernels over fp32 + reference kernels (variants interleaved, median of
   ``5 x repeats``); ``stage_speedup_cpu_torch`` the same with the CPU's default backend (``torch``).
4. On a GPU with Triton (``--cuda-only``: these alone): ``quantize_bandwidth_fraction``, the 8-bit quantizer with
   error feedback's bytes per second over the device's copy bandwidth; ``fused_ce_memory_ratio_cuda``, item 1 on
   the GPU at 4x the tokens and 8x the width (peak GPU memory, float32; ``ce_cuda_bf16`` in bf16);
   ``stage_speedup_cuda``, item 3 for :data:`GPU_MODEL` with the Triton kernels (and ``..._vs_compiled``).
5. ``loss_diff_pct``: ``--steps`` optimizer steps of the single-process reference on ``--spec``'s corpus in bf16 +
   compiled kernels against fp32, the last step's mean loss (percent of the fp32 loss; ``--skip-loss`` skips it).

Every ratio compares variants measured in this run. Prints progress lines on stderr, then one JSON line:
``{"fused_ce_memory_ratio", "stage_speedup_cpu", "loss_diff_pct", "kernels": [{"name", "backend", "speedup",
"max_abs_err", ...}], ...}``, with the GPU's keys of item 4 where there is one.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.kernel_ops import (  # noqa: E402
    cuda_cross_entropy, loss_diff_pct, op_rows, quantize_bandwidth, stage_tokens_per_s)
from swarm.config import RunSpec  # noqa: E402
from swarm.kernels import linear_cross_entropy, linear_cross_entropy_reference, triton_usable  # noqa: E402

VARIANTS = {"fused": linear_cross_entropy, "eager": linear_cross_entropy_reference}
GPU_MODEL = dict(vocab_size=32768, d_model=1024, n_heads=16, n_layers=8, max_seq_len=1024, mlp="swiglu",
                 positions="rope", norm="rmsnorm", stage_layers=[4, 4])
"""The stage bench's model on a GPU (a Llama-style 0.2B model in 2 stages, 8 x 1024 tokens a micro-batch): the
demo's model is too small to keep a GPU busy, and this one runs every Triton kernel but the GELU."""


def _rss_bytes() -> int:
    """This process's resident set now (bytes), from /proc."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def run_variant(name: str, tokens: int, vocab: int, width: int, repeats: int) -> dict:
    """One variant in this process: peak memory over its inputs, best time, and what it computed."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, width, generator=gen).requires_grad_()
    w = (torch.randn(vocab, width, generator=gen) * 0.02).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), generator=gen)
    base = _rss_bytes()
    best = float("inf")
    for _ in range(repeats):
        x.grad = w.grad = None
        start = time.perf_counter()
        loss = VARIANTS[name](x, w, t)
        loss.backward()
        best = min(best, time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"variant": name, "seconds": round(best, 4), "peak_bytes": peak, "loss": float(loss)}


def max_abs_err(tokens: int, vocab: int, width: int) -> float:
    """Largest absolute difference between the two variants' loss and gradients, elementwise, in one process."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(tokens, width, generator=gen), torch.randn(vocab, width, generator=gen) * 0.02
    t = torch.randint(0, vocab, (tokens,), generator=gen)
    outs = []
    for fn in (linear_cross_entropy, linear_cross_entropy_reference):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fn(xi, wi, t)
        loss.backward()
        outs.append((loss.detach(), xi.grad, wi.grad))
    return max(float((a - b).abs().max()) for a, b in zip(*outs))


def _in_fresh_process(name: str, args) -> dict:
    cmd = [sys.executable, __file__, "--variant", name, "--tokens", str(args.tokens), "--vocab", str(args.vocab),
           "--width", str(args.width), "--repeats", str(args.repeats)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cpu_figures(spec: RunSpec, args) -> tuple[dict, list[dict]]:
    """The CPU's rows: the fused loss's memory and time (each variant in a fresh process), each kernel of the
    ``compiled`` backend against its reference, and ``spec``'s stages end to end."""
    rows = {}
    for name in ("eager", "fused"):
        rows[name] = _in_fresh_process(name, args)
        print(json.dumps(rows[name]), file=sys.stderr, flush=True)
    eager, fused = rows["eager"], rows["fused"]
    err = max_abs_err(min(args.tokens, 256), args.vocab, args.width)
    kernels = [{"name": "linear_cross_entropy", "backend": "torch (cpu, chunked)",
                "speedup": round(eager["seconds"] / fused["seconds"], 3), "max_abs_err": err,
                "peak_bytes": fused["peak_bytes"], "reference_peak_bytes": eager["peak_bytes"]}]
    out = {"fused_ce_memory_ratio": round(eager["peak_bytes"] / max(1, fused["peak_bytes"]), 2),
           "tokens": args.tokens, "vocab": args.vocab, "width": args.width}
    kernels += op_rows(torch.device("cpu"), args.repeats * 3)
    print(json.dumps(kernels[-5:]), file=sys.stderr, flush=True)
    speed = stage_tokens_per_s(spec, {"fp32": ("fp32", "reference"), "bf16+compiled": ("bf16", "compiled"),
                                      "bf16+torch": ("bf16", "torch")}, args.repeats * 5)
    out.update(stage_tokens_per_s={k: round(v, 1) for k, v in speed.items()},
               stage_speedup_cpu=round(speed["bf16+compiled"] / speed["fp32"], 3),
               stage_speedup_cpu_torch=round(speed["bf16+torch"] / speed["fp32"], 3))
    print(json.dumps(out), file=sys.stderr, flush=True)
    return out, kernels


def _cuda_figures(spec: RunSpec, args) -> dict:
    """The GPU's rows: the quantizer's bandwidth, the fused loss's memory, and :data:`GPU_MODEL`'s stages end to end
    (``stage_speedup_cuda``: bf16 + Triton kernels over fp32 + reference kernels; ``..._vs_compiled``: over bf16 +
    ``torch.compile``)."""
    cuda = torch.device("cuda")
    out = quantize_bandwidth(cuda)
    out.update(cuda_cross_entropy(cuda, 4 * args.tokens, args.vocab, 8 * args.width, args.repeats))
    gpu_spec = spec.updated(model=GPU_MODEL, data={"seq_len": 1024}, training={"micro_batch_size": 8})
    speed = stage_tokens_per_s(gpu_spec, {"fp32": ("fp32", "reference"), "bf16+triton": ("bf16", "triton"),
                                          "bf16+compiled": ("bf16", "compiled")}, args.repeats * 5, cuda)
    out.update(stage_tokens_per_s_cuda={k: round(v, 1) for k, v in speed.items()},
               stage_speedup_cuda=round(speed["bf16+triton"] / speed["fp32"], 3),
               stage_speedup_cuda_vs_compiled=round(speed["bf16+triton"] / speed["bf16+compiled"], 3))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096, help="hidden states per loss (N)")
    ap.add_argument("--vocab", type=int, default=32768, help="vocabulary (V)")
    ap.add_argument("--width", type=int, default=256, help="hidden width (D)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps of the bf16-vs-fp32 loss comparison")
    ap.add_argument("--spec", default=str(ROOT / "runs" / "demo.toml"), help="run spec of the stage and loss parts")
    ap.add_argument("--cache-dir", default=os.environ.get("SWARM_CACHE_DIR", str(Path.home() / ".cache" / "swarm")),
                    help="corpus and tokenizer cache (SWARM_CACHE_DIR)")
    ap.add_argument("--skip-loss", action="store_true", help="skip the 100-step loss comparison (minutes)")
    ap.add_argument("--cuda-only", action="store_true", help="only the GPU's rows (skips the CPU's and the loss)")
    ap.add_argument("--variant", choices=sorted(VARIANTS), help=argparse.SUPPRESS)  # one variant, in this process
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.tokens, args.vocab, args.width, args.repeats)))
        return
    spec = RunSpec.from_toml(args.spec)
    out, kernels = ({}, []) if args.cuda_only else _cpu_figures(spec, args)
    if torch.cuda.is_available() and triton_usable(torch.device("cuda")) is None:
        kernels += op_rows(torch.device("cuda"), args.repeats * 3)
        print(json.dumps(kernels[-5:]), file=sys.stderr, flush=True)
        out.update(_cuda_figures(spec, args))
        print(json.dumps(out), file=sys.stderr, flush=True)
    elif args.cuda_only:
        why = triton_usable(torch.device("cuda")) if torch.cuda.is_available() else "torch sees no CUDA device"
        raise SystemExit(f"--cuda-only: no GPU with Triton here ({why})")
    if not (args.skip_loss or args.cuda_only):
        out.update(loss_diff_pct(spec, Path(args.cache_dir), args.steps, "compiled"))
    out["kernels"] = kernels
    print(json.dumps(out))

if __name__ == "__main__":
    main()
