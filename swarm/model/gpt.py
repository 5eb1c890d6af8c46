"""A pre-norm GPT (causal SDPA attention, GELU or SwiGLU MLP, learned or rotary positions) built by stage.

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


def _seed_of(init_seed: int, component: str) -> int:
    return (init_seed * 1_000_003 + zlib.crc32(component.encode())) % (2**63)


def _rope(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate ``x`` of shape (B, H, T, Dh) by position (RoFormer eq. 34, half-split layout)."""
    t, dh = x.shape[-2], x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dh, 2, device=x.device, dtype=torch.float32) / dh)
    ang = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv)  # (T, Dh/2)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : dh // 2], x[..., dh // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.n_heads, self.rope = spec.n_heads, spec.positions == "rope"
        self.qkv = nn.Linear(spec.d_model, 3 * spec.d_model, bias=False)
        self.proj = nn.Linear(spec.d_model, spec.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        if self.rope:
            q, k = _rope(q), _rope(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.swiglu = spec.mlp == "swiglu"
        d_ff = spec.d_ff or (int(8 * spec.d_model / 3) if self.swiglu else 4 * spec.d_model)
        self.fc = nn.Linear(spec.d_model, (2 if self.swiglu else 1) * d_ff, bias=False)
        self.proj = nn.Linear(d_ff, spec.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            return self.proj(F.silu(gate) * up)
        return self.proj(F.gelu(h, approximate="tanh"))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(spec.d_model), Attention(spec)
        self.ln2, self.mlp = nn.LayerNorm(spec.d_model), MLP(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class StageModule(nn.Module):
    """Blocks ``[start, end)`` of the GPT, plus the embeddings if ``first`` and the head if ``last``.

    ``forward`` maps int64 token ids ``(B, T)`` (first stage) or float32 hidden states ``(B, T, d_model)``
    to float32 hidden states ``(B, T, d_model)``, or, for the last stage, float32 logits
    ``(B, T, vocab_size)``. Raises ValueError on inputs of the wrong dtype, rank, width or length.
    """

    def __init__(self, spec: ModelSpec, start: int, end: int, *, first: bool, last: bool):
        super().__init__()
        self.spec, self.start, self.end, self.first, self.last = spec, start, end, first, last
        if first:
            self.tok_emb = self._init(nn.Embedding(spec.vocab_size, spec.d_model), "tok_emb")
            if spec.positions == "learned":
                self.pos_emb = self._init(nn.Embedding(spec.max_seq_len, spec.d_model), "pos_emb")
        self.blocks = nn.ModuleDict({str(i): self._init(Block(spec), f"block{i}") for i in range(start, end)})
        if last:
            self.norm = self._init(nn.LayerNorm(spec.d_model), "norm")
            self.head = self._init(nn.Linear(spec.d_model, spec.vocab_size, bias=False), "head")

    def _init(self, module: nn.Module, component: str) -> nn.Module:
        gen = torch.Generator().manual_seed(_seed_of(self.spec.init_seed, component))
        resid_std = 0.02 / math.sqrt(2 * self.spec.n_layers)
        for name, p in module.named_parameters():
            with torch.no_grad():
                if isinstance(module, nn.LayerNorm) or name.startswith("ln"):
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
            if not torch.isfinite(x).all():
                raise ValueError("stage input holds NaN or Inf values")
        if not 0 < x.shape[1] <= s.max_seq_len or x.shape[0] == 0:
            raise ValueError(f"stage input must have 1..{s.max_seq_len} tokens and >= 1 sample, got {tuple(x.shape)}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            h = self.tok_emb(x)
            if self.spec.positions == "learned":
                h = h + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        else:
            h = x
        for block in self.blocks.values():
            h = block(h)
        if self.last:
            h = self.head(self.norm(h))
        return h


def build_stage(spec: ModelSpec, stage: int | None = None) -> StageModule:
    """Stage ``stage`` of the model, or the whole model (every block, embeddings and head) if ``None``."""
    if stage is None:
        return StageModule(spec, 0, spec.n_layers, first=True, last=True)
    start, end = spec.layer_range(stage)
    return StageModule(spec, start, end, first=stage == 0, last=stage == spec.num_stages - 1)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats/token) of float logits ``(B, T, V)`` against int64 ``(B, T)``."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
