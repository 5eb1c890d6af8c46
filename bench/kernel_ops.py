"""Parts of ``bench/kernels.py``: each small kernel against its reference, a stage end to end, and 100 training
steps in bf16 + kernels against fp32 (all measured in the calling process, variants interleaved)."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from swarm.config import RunSpec  # noqa: E402
from swarm.data import prepare_dataset  # noqa: E402
from swarm.kernels import reference, select_backend, triton_usable  # noqa: E402
from swarm.model import build_stage  # noqa: E402
from swarm.reference import train_reference  # noqa: E402

SIZES = {"cpu": (16, 128, 768), "cuda": (8, 1024, 2048)}
"""Per device: (samples, tokens per sample, width) of the per-kernel inputs: on a CPU a GPT-2-small block's
activations for 16 samples of 128 tokens; on a GPU 8 samples of 1024 tokens at width 2048 (a 1B-parameter
model's block), large enough that launch overheads do not decide the comparison."""


def _op_cases(backend, device: torch.device) -> dict[str, tuple[Callable, Callable, list[torch.Tensor]]]:
    """name -> (kernel, reference, inputs) at the device's :data:`SIZES` (float32)."""
    g = torch.Generator().manual_seed(0)
    samples, seq, width = SIZES["cuda" if device.type == "cuda" else "cpu"]
    rows, heads = samples * seq, width // 64

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device)
    cos, sin = reference.rope_angles(seq, 64, device)
    return {
        "layer_norm": (lambda x, w, b: backend.layer_norm(x, w, b, 1e-5),
                       lambda x, w, b: reference.layer_norm(x, w, b, 1e-5),
                       [rnd(rows, width), rnd(width), rnd(width)]),
        "rms_norm": (lambda x, w: backend.rms_norm(x, w, 1e-5), lambda x, w: reference.rms_norm(x, w, 1e-5),
                     [rnd(rows, width), rnd(width)]),
        "bias_gelu": (backend.bias_gelu, reference.bias_gelu, [rnd(rows, 4 * width), rnd(4 * width)]),
        "swiglu": (backend.swiglu, reference.swiglu, [rnd(rows, 8 * width // 3), rnd(rows, 8 * width // 3)]),
        "rope": (backend.rope, lambda x: reference.rope(x, cos, sin), [rnd(samples, heads, seq, 64)]),
    }


def _step(fn, inputs, sync) -> tuple[float, list[torch.Tensor]]:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    start = time.perf_counter()
    out = fn(*leaves)
    out.backward(torch.ones_like(out))
    sync()
    return time.perf_counter() - start, [out.detach()] + [t.grad for t in leaves]


def op_rows(device: torch.device, repeats: int) -> list[dict]:
    """Per kernel of the device's fused backend (``compiled`` on a CPU, ``triton`` on a GPU): forward + backward
    time against the eager reference (``speedup``) and, on a GPU, against ``torch.compile`` of the reference
    (``speedup_vs_compiled``); ``max_abs_err`` over output and gradients (float32)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    name = "triton" if device.type == "cuda" and triton_usable(device) is None else "compiled"
    backend, compiled_ref = select_backend(name, device), select_backend("compiled", device)
    cases = _op_cases(backend, device)
    if name == "triton":  # the Triton LayerNorm, which the backend measured slower than PyTorch's and keeps aside
        from swarm.kernels.triton_ops import fused_layer_norm
        cases["layer_norm"] = (lambda x, w, b: fused_layer_norm(x, w, b, 1e-5),) + cases["layer_norm"][1:]
    rows = []
    for op, (fn, ref, inputs) in cases.items():
        variants = {"kernel": fn, "reference": ref}
        if name == "triton":
            variants["compiled"] = _op_cases(compiled_ref, device)[op][0]
        for f in variants.values():  # compile, autotune, warm caches
            _step(f, inputs, sync)
        times = {k: [] for k in variants}
        for _ in range(repeats):
            for k, f in variants.items():
                times[k].append(_step(f, inputs, sync)[0])
        got, want = _step(fn, inputs, sync)[1], _step(ref, inputs, sync)[1]
        best = {k: min(v) for k, v in times.items()}
        row = {"name": op, "backend": f"{name} ({device.type})",
               "speedup": round(best["reference"] / best["kernel"], 3),
               "max_abs_err": max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want)),
               "seconds": round(best["kernel"], 6), "reference_seconds": round(best["reference"], 6)}
        if "compiled" in best:
            row["speedup_vs_compiled"] = round(best["compiled"] / best["kernel"], 3)
        if name == "triton" and op == "layer_norm":
            row["used_by_backend"] = False  # TritonBackend computes LayerNorm with PyTorch's own
        rows.append(row)
    return rows


def stage_tokens_per_s(spec: RunSpec, variants: dict[str, tuple[str, str]], repeats: int,
                       device: torch.device = torch.device("cpu")) -> dict[str, float]:
    """Tokens/s of forward + backward through every stage of ``spec``'s model on ``device`` (one micro-batch;
    stage 0 from token ids, the last to its loss), per variant name -> (precision, kernel backend); the median of
    ``repeats`` interleaved runs, after one warm-up (compiles, autotunes)."""
    b, t = spec.training.micro_batch_size, spec.data.seq_len
    tokens = torch.randint(0, spec.model.vocab_size, (b, t + 1), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    built = {name: [build_stage(spec.model, k, precision=p, kernels=select_backend(kb, device)).to(device)
                    for k in range(spec.model.num_stages)] for name, (p, kb) in variants.items()}

    def one(stages) -> float:
        sync()
        start = time.perf_counter()
        h = tokens[:, :-1]
        for m in stages:
            x = h if m.first else h.detach().requires_grad_()
            if m.last:
                m.loss(x, tokens[:, 1:]).backward()
            else:
                h = m(x)
                h.backward(torch.ones_like(h))
        sync()
        return time.perf_counter() - start

    times = {name: [] for name in variants}
    for name, stages in built.items():
        one(stages)
    for _ in range(repeats):
        for name, stages in built.items():
            times[name].append(one(stages))
    return {name: b * t / statistics.median(v) for name, v in times.items()}


def loss_diff_pct(spec: RunSpec, cache_dir: Path, steps: int, kernels: str) -> dict:
    """Train ``steps`` optimizer steps of the single-process reference in fp32 (reference kernels) and in bf16 with
    ``kernels``, same data; the percent difference of the last step's mean loss (bf16 minus fp32, over fp32)."""
    dataset = prepare_dataset(spec, cache_dir)
    per_step = -(-spec.training.target_batch_size // spec.training.micro_batch_size)
    samples = steps * per_step * spec.training.micro_batch_size
    runs = {}
    for name, precision, backend in (("fp32", "fp32", "reference"), ("bf16", "bf16", kernels)):
        s = spec.updated(training={"precision": precision})
        start = time.perf_counter()
        result = train_reference(s, dataset, max_samples=samples, kernels=select_backend(backend, torch.device("cpu")))
        runs[name] = (statistics.mean(result.losses[-per_step:]), time.perf_counter() - start, result.losses[0])
        print(f'{{"loss_run": "{name}", "final_loss": {runs[name][0]:.5f}, "first_loss": {runs[name][2]:.5f}, '
              f'"seconds": {runs[name][1]:.1f}}}', file=sys.stderr, flush=True)
    fp32, bf16 = runs["fp32"][0], runs["bf16"][0]
    return {"loss_diff_pct": round(100 * (bf16 - fp32) / fp32, 3), "loss_fp32": round(fp32, 5),
            "loss_bf16": round(bf16, 5), "loss_steps": steps,
            "train_speedup": round(runs["fp32"][1] / runs["bf16"][1], 3)}


def quantize_bandwidth(device: torch.device, n: int = 1 << 26, repeats: int = 10) -> dict:
    """The Triton 8-bit quantizer with error feedback on ``n`` float32 values (a GPU only): its bytes moved
    (reads ``x`` and the residual, writes codes, scales and the new residual: 13 bytes a value) per second, over
    the device's copy bandwidth measured here (``clone`` of the same ``x``: 8 bytes a value)."""
    from swarm.kernels.triton_ops import quantize_blockwise

    x = torch.randn(n, device=device)
    residual = torch.zeros_like(x)

    def best(fn) -> float:
        fn()
        torch.cuda.synchronize(device)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return min(times)
    copy_bw = 8 * n / best(lambda: x.clone())
    quant_bw = (13 * n + 4 * n // 512) / best(lambda: quantize_blockwise(x, residual))
    return {"quantize_bandwidth_gbs": round(quant_bw / 1e9, 1), "copy_bandwidth_gbs": round(copy_bw / 1e9, 1),
            "quantize_bandwidth_fraction": round(quant_bw / copy_bw, 3)}


def cuda_cross_entropy(device: torch.device, tokens: int, vocab: int, width: int, repeats: int) -> dict:
    """Fused linear + cross-entropy against the eager head + loss on a GPU, float32 and bf16 inputs: peak GPU memory
    of loss + backward above the inputs (``torch.cuda.max_memory_allocated``), best time of ``repeats``;
    ``fused_ce_memory_ratio_cuda`` is the eager peak over the fused one (float32)."""
    from swarm.kernels import linear_cross_entropy, linear_cross_entropy_reference

    g = torch.Generator().manual_seed(0)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(tokens, width, generator=g).to(device, dtype).requires_grad_()
        w = (torch.randn(vocab, width, generator=g) * 0.02).to(device, dtype).requires_grad_()
        t = torch.randint(0, vocab, (tokens,), generator=g).to(device)
        peak, best = {}, {}
        for name, fn in (("eager", linear_cross_entropy_reference), ("fused", linear_cross_entropy)):
            times = []
            for _ in range(repeats + 1):
                x.grad = w.grad = None
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
                start = time.perf_counter()
                fn(x, w, t).backward()
                torch.cuda.synchronize(device)
                times.append(time.perf_counter() - start)
                peak[name] = torch.cuda.max_memory_allocated(device) - base
            best[name] = min(times[1:])
        tag = "fp32" if dtype == torch.float32 else "bf16"
        out[f"ce_cuda_{tag}"] = {"eager_peak_bytes": peak["eager"], "fused_peak_bytes": peak["fused"],
                                 "memory_ratio": round(peak["eager"] / max(1, peak["fused"]), 2),
                                 "speedup": round(best["eager"] / best["fused"], 3)}
    out["fused_ce_memory_ratio_cuda"] = out["ce_cuda_fp32"]["memory_ratio"]
    return out
