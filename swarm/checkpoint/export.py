"""Assemble a complete checkpoint (every stage at one epoch) into one model directory, and sample from it.

Layout of an exported directory::

    model.safetensors    every parameter of the whole GPT under this project's names (float32)
    config.json          {"format", "model": ModelSpec fields, "run_id", "epoch", "stages": [shard sha256...]}
    tokenizer.json       the run's byte-level BPE (Hugging Face ``tokenizers`` format), if given
    hf/config.json       Hugging Face ``GPT2Config`` (only for mlp="gelu", positions="learned", norm="layernorm")
    hf/model.safetensors the same weights under GPT-2 names, for ``GPT2LMHeadModel.from_pretrained``
    hf/tokenizer.json    for ``PreTrainedTokenizerFast(tokenizer_file=...)``

Plain PyTorch: ``build_stage(ModelSpec(**config["model"]))`` then ``load_state_dict(safetensors.torch.
load_file("model.safetensors"))``.

Hugging Face mapping (:data:`HF_LAYER_MAP`): this GPT is GPT-2's pre-norm block without biases in its
linear layers and with an untied LM head, so ``blocks.i.attn.qkv`` -> ``transformer.h.i.attn.c_attn`` (GPT-2's
``Conv1D`` stores ``(in, out)``, hence the transpose; q, k, v in the same order, heads contiguous), biases are
zeros, the MLP's tanh GELU is ``gelu_new``, and ``tie_word_embeddings`` is false. SwiGLU, rotary or RMSNorm
models have no GPT-2 equivalent and get no ``hf/`` folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

from swarm.checkpoint.shard import ShardError, StageShard, encode_shard
from swarm.config import ModelSpec
from swarm.model import build_stage

FORMAT = "swarm-export/1"

HF_LAYER_MAP = {  # ours (after "blocks.<i>.") -> GPT-2's (after "transformer.h.<i>."), transposed if True
    "ln1.weight": ("ln_1.weight", False), "ln1.bias": ("ln_1.bias", False),
    "attn.qkv.weight": ("attn.c_attn.weight", True), "attn.proj.weight": ("attn.c_proj.weight", True),
    "ln2.weight": ("ln_2.weight", False), "ln2.bias": ("ln_2.bias", False),
    "mlp.fc.weight": ("mlp.c_fc.weight", True), "mlp.proj.weight": ("mlp.c_proj.weight", True),
}


def assemble_model(spec: ModelSpec, shards: list[StageShard]) -> torch.nn.Module:
    """The whole model with every stage's parameters from ``shards`` (one per stage, any order).

    :raises ShardError: a stage is missing or twice, or the parameters do not fit the model.
    """
    stages = sorted(s.stage for s in shards)
    if stages != list(range(spec.num_stages)):
        raise ShardError(f"need one shard of each of the {spec.num_stages} stages, got stages {stages}")
    state = {name[len("param/"):]: t for s in shards for name, t in s.tensors.items() if name.startswith("param/")}
    model = build_stage(spec, None)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ShardError(f"the shards do not fit the run's model: {str(e).splitlines()[0]}") from None
    return model.eval()


def gpt2_state_dict(spec: ModelSpec, model: torch.nn.Module) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(GPT2Config fields, GPT2LMHeadModel state dict)`` of ``model``.

    :raises ValueError: the model is SwiGLU, rotary or RMSNorm (no GPT-2 equivalent).
    """
    if spec.mlp != "gelu" or spec.positions != "learned" or spec.norm != "layernorm":
        raise ValueError(f"a {spec.mlp}/{spec.positions}/{spec.norm} model has no GPT-2 equivalent (needs "
                         "gelu/learned/layernorm)")
    d_ff = spec.d_ff or 4 * spec.d_model
    config = {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": spec.vocab_size,
        "n_positions": spec.max_seq_len, "n_embd": spec.d_model, "n_layer": spec.n_layers, "n_head": spec.n_heads,
        "n_inner": d_ff, "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0,
        "attn_pdrop": 0.0, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False, "bos_token_id": 0,
        "eos_token_id": 0, "scale_attn_weights": True, "torch_dtype": "float32",
    }
    ours = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    out = {"transformer.wte.weight": ours["tok_emb.weight"], "transformer.wpe.weight": ours["pos_emb.weight"],
           "transformer.ln_f.weight": ours["norm.weight"], "transformer.ln_f.bias": ours["norm.bias"],
           "lm_head.weight": ours["head.weight"]}
    zero_bias = {"attn.c_attn.bias": 3 * spec.d_model, "attn.c_proj.bias": spec.d_model, "mlp.c_fc.bias": d_ff,
                 "mlp.c_proj.bias": spec.d_model}
    for i in range(spec.n_layers):
        for name, (theirs, transpose) in HF_LAYER_MAP.items():
            t = ours[f"blocks.{i}.{name}"]
            out[f"transformer.h.{i}.{theirs}"] = t.t().contiguous() if transpose else t
        for name, size in zero_bias.items():
            out[f"transformer.h.{i}.{name}"] = torch.zeros(size)
    return config, out


def export_model(spec: ModelSpec, shards: list[StageShard], out_dir: Path, *, run_id: str = "",
                 tokenizer_json: str = "") -> Path:
    """Write the exported directory (module docstring) for ``shards`` of one epoch; returns ``out_dir``.

    :raises ShardError: the shards are not one complete, consistent set.
    """
    epochs = {s.epoch for s in shards}
    if len(epochs) != 1:
        raise ShardError(f"shards of different epochs {sorted(epochs)}; export one complete checkpoint")
    model = assemble_model(spec, shards)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out_dir / "model.safetensors"),
              metadata={"format": FORMAT})
    config = {"format": FORMAT, "model": spec.model_dump(mode="json"), "run_id": run_id, "epoch": epochs.pop(),
              "stages": [encode_shard(s)[1] for s in sorted(shards, key=lambda s: s.stage)]}
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    if tokenizer_json:
        (out_dir / "tokenizer.json").write_text(tokenizer_json)
    try:
        hf_config, hf_state = gpt2_state_dict(spec, model)
    except ValueError:
        return out_dir
    hf = out_dir / "hf"
    hf.mkdir(exist_ok=True)
    (hf / "config.json").write_text(json.dumps(hf_config, indent=1))
    save_file(hf_state, str(hf / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer_json:
        (hf / "tokenizer.json").write_text(tokenizer_json)
    return out_dir


def load_exported(out_dir: Path) -> tuple[ModelSpec, torch.nn.Module]:
    """Load an exported directory with plain PyTorch (and this package's model definition)."""
    from safetensors.torch import load_file

    config = json.loads((Path(out_dir) / "config.json").read_text())
    spec = ModelSpec(**config["model"])
    model = build_stage(spec, None)
    model.load_state_dict(load_file(str(Path(out_dir) / "model.safetensors")), strict=True)
    return spec, model.eval()


@torch.no_grad()
def generate(model: torch.nn.Module, spec: ModelSpec, prompt_ids: list[int], new_tokens: int = 40, *,
             temperature: float = 0.8, top_k: int = 40, seed: Optional[int] = 0) -> list[int]:
    """Sample ``new_tokens`` token ids after ``prompt_ids`` (top-k sampling; ``temperature`` 0 = greedy).

    The context is cut to the model's last ``max_seq_len`` tokens.
    """
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    ids = list(prompt_ids) or [0]
    for _ in range(new_tokens):
        logits = model(torch.tensor([ids[-spec.max_seq_len:]]))[0, -1].float()
        if temperature <= 0:
            ids.append(int(logits.argmax()))
            continue
        values, indices = torch.topk(logits / temperature, min(top_k, logits.numel()))
        ids.append(int(indices[torch.multinomial(torch.softmax(values, -1), 1, generator=gen)]))
    return ids[len(prompt_ids):] if prompt_ids else ids[1:]
