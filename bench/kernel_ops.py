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

TOKENS, WIDTH = 16 * 128, 768
"""Rows and width of the per-kernel inputs (a GPT-2-small block's activations for 16 samples of 128 tokens)."""


def _op_cases(backend, device: torch.device) -> dict[str, tuple[Callable, Callable, list[torch.Tensor]]]:
    """name -> (kernel, reference, inputs) at :data:`TOKENS` x :data:`WIDTH` (float32)."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device)
    cos, sin = reference.rope_angles(128, 64, device)
    return {
        "layer_norm": (lambda x, w, b: backend.layer_norm(x, w, b, 1e-5),
                       lambda x, w, b: reference.layer_norm(x, w, b, 1e-5),
                       [rnd(TOKENS, WIDTH), rnd(WIDTH), rnd(WIDTH)]),
        "rms_norm": (lambda x, w: backend.rms_norm(x, w, 1e-5), lambda x, w: reference.rms_norm(x, w, 1e-5),
                     [rnd(TOKENS, WIDTH), rnd(WIDTH)]),
        "bias_gelu": (backend.bias_gelu, reference.bias_gelu, [rnd(TOKENS, 4 * WIDTH), rnd(4 * WIDTH)]),
        "swiglu": (backend.swiglu, reference.swiglu, [rnd(TOKENS, 2048), rnd(TOKENS, 2048)]),
        "rope": (backend.rope, lambda x: reference.rope(x, cos, sin), [rnd(16, 12, 128, 64)]),
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
    rows = []
    for op, (fn, ref, inputs) in _op_cases(backend, device).items():
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
        rows.append(row)
    return rows


def stage_tokens_per_s(spec: RunSpec, variants: dict[str, tuple[str, str]], repeats: int) -> dict[str, float]:
    """Tokens/s of forward + backward through every stage of ``spec``'s model (one micro-batch; stage 0 from token
    ids, the last to its loss), per variant name -> (precision, kernel backend); the median of ``repeats``
    interleaved runs, after one warm-up (compiles)."""
    b, t = spec.training.micro_batch_size, spec.data.seq_len
    tokens = torch.randint(0, spec.model.vocab_size, (b, t + 1), generator=torch.Generator().manual_seed(0))
    built = {name: [build_stage(spec.model, k, precision=p, kernels=select_backend(kb, torch.device("cpu")))
                    for k in range(spec.model.num_stages)] for name, (p, kb) in variants.items()}

    def one(stages) -> float:
        start = time.perf_counter()
        h = tokens[:, :-1]
        for m in stages:
            x = h if m.first else h.detach().requires_grad_()
            if m.last:
                m.loss(x, tokens[:, 1:]).backward()
            else:
                h = m(x)
                h.backward(torch.ones_like(h))
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
