"""A pre-norm GPT (causal SDPA attention, LayerNorm or RMSNorm, GELU or SwiGLU MLP, learned or rotary
positions) built by stage; norms, activations, RoPE and the loss go through a kernel backend (:mod:`swarm.kernels`).

A :class:`StageModule` owns a half-open range of transformer blocks; stage 0 also owns the token (and
learned position) embeddings, the last stage the final norm and LM head. The whole model is simply the
stage that owns every layer and is both first and last, so a chain of stages and the whole model share one
definition, one parameter naming (``blocks.<global index>...``) and one initialisation: each component is
initialised from its own seed (``init_seed``, component name), so stage ``k``'s parameters equal the
corresponding parameters of the whole model whatever the split.

Initialisation follows GPT-2 (Radford et al., 2019): N(0, 0.02), residual projections scaled by
1/sqrt(2 * n_layers). Rotary embeddings follow Su et al., "RoFormer" (2021), eq. 34.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from swarm.config import ModelSpec
from swarm.kernels import REFERENCE, KernelBackend
from swarm.kernels.reference import all_finite


def _seed_of(init_seed: int, component: str) -> int:
    return (init_seed * 1_000_003 + zlib.crc32(component.encode())) % (2**63)


class Norm(nn.Module):
    """LayerNorm (``weight``, ``bias``) or RMSNorm (``weight``) over ``d_model`` (``ModelSpec.norm``), computed by
    the stage's kernel backend; parameter names are ``nn.LayerNorm``'s."""

    def __init__(self, spec: ModelSpec, kernels: KernelBackend, eps: float = 1e-5):
        super().__init__()
        self.kernels, self.rms, self.eps = kernels, spec.norm == "rmsnorm", eps
        self.weight = nn.Parameter(torch.ones(spec.d_model))
        self.bias = None if self.rms else nn.Parameter(torch.zeros(spec.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        return self.kernels.layer_norm(x, self.weight, self.bias, self.eps)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, kernels: KernelBackend):
        super().__init__()
        self.kernels, self.n_heads, self.rope = kernels, spec.n_heads, spec.positions == "rope"
        self.qkv = nn.Linear(spec.d_model, 3 * spec.d_model, bias=False)
        self.proj = nn.Linear(spec.d_model, spec.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        if self.rope:
            q, k = self.kernels.rope(q), self.kernels.rope(k)
        y = self.kernels.attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, kernels: KernelBackend):
        super().__init__()
        self.kernels, self.swiglu = kernels, spec.mlp == "swiglu"
        d_ff = spec.ff_size()
        self.fc = nn.Linear(spec.d_model, (2 if self.swiglu else 1) * d_ff, bias=False)
        self.proj = nn.Linear(d_ff, spec.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            return self.proj(self.kernels.swiglu(gate, up))
        return self.proj(self.kernels.bias_gelu(h))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, spec: ModelSpec, kernels: KernelBackend):
        super().__init__()
        self.ln1, self.attn = Norm(spec, kernels), Attention(spec, kernels)
        self.ln2, self.mlp = Norm(spec, kernels), MLP(spec, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class StageModule(nn.Module):
    """Blocks ``[start, end)`` of the GPT, plus the embeddings if ``first`` and the head if ``last``.

    ``forward`` maps int64 token ids ``(B, T)`` (first stage) or float32 hidden states ``(B, T, d_model)``
    to float32 hidden states ``(B, T, d_model)``, or, for the last stage, float32 logits
    ``(B, T, vocab_size)``; :meth:`loss` gives the last stage's loss without the logits. Raises ValueError on
    inputs of the wrong dtype, rank, width or length.

    :param precision: ``fp32``, or ``bf16``: matmuls and activations under bfloat16 autocast, parameters (the
        master weights), their gradients and the outputs float32 (``training.precision``).
    :param kernels: the backend computing norms, activations, RoPE and the loss
        (:func:`~swarm.kernels.select_backend`; default the plain-PyTorch reference).
    """

    def __init__(self, spec: ModelSpec, start: int, end: int, *, first: bool, last: bool,
                 precision: str = "fp32", kernels: KernelBackend = REFERENCE):
        super().__init__()
        self.spec, self.start, self.end, self.first, self.last = spec, start, end, first, last
        self.precision, self.kernels = precision, kernels
        if first:
            self.tok_emb = self._init(nn.Embedding(spec.vocab_size, spec.d_model), "tok_emb")
            if spec.positions == "learned":
                self.pos_emb = self._init(nn.Embedding(spec.max_seq_len, spec.d_model), "pos_emb")
        self.blocks = nn.ModuleDict({str(i): self._init(Block(spec, kernels), f"block{i}")
                                     for i in range(start, end)})
        if last:
            self.norm = self._init(Norm(spec, kernels), "norm")
            self.head = self._init(nn.Linear(spec.d_model, spec.vocab_size, bias=False), "head")

    def _init(self, module: nn.Module, component: str) -> nn.Module:
        gen = torch.Generator().manual_seed(_seed_of(self.spec.init_seed, component))
        resid_std = 0.02 / math.sqrt(2 * self.spec.n_layers)
        for name, p in module.named_parameters():
            with torch.no_grad():
                if isinstance(module, Norm) or name.startswith("ln"):
                    p.fill_(1.0 if name.endswith("weight") else 0.0)
                else:
                    std = resid_std if name.endswith("proj.weight") else 0.02
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
        return module

    def check_input(self, x: torch.Tensor) -> None:
        """Raise ValueError naming the problem if ``x`` is not a valid input for this stage."""
        s = self.spec
        if self.first:
            if x.dtype != torch.int64 or x.dim() != 2:
                raise ValueError(f"stage input must be int64 token ids (B, T), got {x.dtype} {tuple(x.shape)}")
            if x.numel() and (int(x.min()) < 0 or int(x.max()) >= s.vocab_size):
                raise ValueError(f"token ids must lie in [0, {s.vocab_size}), got [{int(x.min())}, {int(x.max())}]")
        else:
            if x.dtype != torch.float32 or x.dim() != 3 or x.shape[-1] != s.d_model:
                raise ValueError(f"stage input must be float32 (B, T, {s.d_model}), got {x.dtype} {tuple(x.shape)}")
            if not all_finite(x):
                raise ValueError("stage input holds NaN or Inf values")
        if not 0 < x.shape[1] <= s.max_seq_len or x.shape[0] == 0:
            raise ValueError(f"stage input must have 1..{s.max_seq_len} tokens and >= 1 sample, got {tuple(x.shape)}")

    def _autocast(self, device: torch.device):
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16")

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            h = self.tok_emb(x)
            if self.spec.positions == "learned":
                h = h + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        else:
            h = x
        for block in self.blocks.values():
            h = block(h)
        return self.norm(h) if self.last else h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self._autocast(x.device):
            h = self._hidden(x)
            return (self.head(h) if self.last else h).float()

    def loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (nats/token, float32 scalar) of the last stage on ``x`` against int64
        ``targets (B, T)``, through the kernel backend's ``linear_cross_entropy`` (the ``torch`` and ``triton``
        backends never hold the ``(B·T, vocab)`` logits). :raises ValueError: not the last stage."""
        if not self.last:
            raise ValueError(f"stage with blocks [{self.start}, {self.end}) has no head: only the last stage has a "
                             "loss")
        with self._autocast(x.device):
            h = self._hidden(x)
            return self.kernels.linear_cross_entropy(h.flatten(0, 1), self.head.weight, targets.flatten()).float()


def build_stage(spec: ModelSpec, stage: int | None = None, *, precision: str = "fp32",
                kernels: KernelBackend = REFERENCE) -> StageModule:
    """Stage ``stage`` of the model, or the whole model (every block, embeddings and head) if ``None``
    (``precision`` and ``kernels``: :class:`StageModule`)."""
    if stage is None:
        return StageModule(spec, 0, spec.n_layers, first=True, last=True, precision=precision, kernels=kernels)
    start, end = spec.layer_range(stage)
    return StageModule(spec, start, end, first=stage == 0, last=stage == spec.num_stages - 1,
                       precision=precision, kernels=kernels)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats/token) of float logits ``(B, T, V)`` against int64 ``(B, T)``."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
