"""Export of a complete checkpoint: plain PyTorch and Hugging Face GPT-2 load it and agree with the stages."""

import json

import pytest
import torch

from swarm.averaging.schedule import make_stage_torch_optimizer
from swarm.checkpoint import ShardError, capture_stage_state
from swarm.checkpoint.export import export_model, generate, load_exported
from swarm.config import ModelSpec, OptimSpec
from swarm.model import build_stage

SPEC = ModelSpec(vocab_size=300, d_model=32, n_heads=4, n_layers=3, max_seq_len=16, stage_layers=[1, 2])


def _trained_shards(spec, epoch=7):
    shards, stages = [], []
    for k in range(spec.num_stages):
        module = build_stage(spec, k)
        with torch.no_grad():  # parameters a training run would have moved away from the initialisation
            for p in module.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(k)) * 0.05)
        stages.append(module)
        opt = make_stage_torch_optimizer(OptimSpec(), module.parameters())
        shards.append(capture_stage_state("run-x", k, epoch, module, opt))
    return shards, stages


def test_export_loads_in_plain_pytorch_and_in_transformers(tmp_path, tiny_dataset):
    shards, stages = _trained_shards(SPEC)
    out = export_model(SPEC, shards[::-1], tmp_path / "model", run_id="run-x", tokenizer_json=tiny_dataset.tokenizer_json)
    x = torch.randint(0, SPEC.vocab_size, (2, 12))
    with torch.no_grad():
        reference = stages[1](stages[0](x))
    spec, model = load_exported(out)
    assert spec == SPEC and torch.allclose(model(x), reference, atol=1e-5)
    config = json.loads((out / "config.json").read_text())
    assert config["epoch"] == 7 and len(config["stages"]) == 2

    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2LMHeadModel.from_pretrained(out / "hf").eval()
    with torch.no_grad():
        hf_logits = hf(x).logits
    assert torch.allclose(hf_logits, reference, atol=1e-4), (hf_logits - reference).abs().max()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "hf" / "tokenizer.json"))
    assert tok.decode(tok.encode("To be, or not to be")) == "To be, or not to be"

    ids = generate(model, spec, [1, 2, 3], new_tokens=8, seed=0)
    assert len(ids) == 8 and all(0 <= i < SPEC.vocab_size for i in ids)
    assert ids == generate(model, spec, [1, 2, 3], new_tokens=8, seed=0), "seeded sampling is reproducible"


def test_export_refuses_incomplete_or_mixed_checkpoints(tmp_path):
    shards, _ = _trained_shards(SPEC)
    with pytest.raises(ShardError, match="one shard of each of the 2 stages"):
        export_model(SPEC, shards[:1], tmp_path)
    late, _ = _trained_shards(SPEC, epoch=9)
    with pytest.raises(ShardError, match="different epochs"):
        export_model(SPEC, [shards[0], late[1]], tmp_path)
    rotary = SPEC.model_copy(update={"positions": "rope", "n_heads": 2})
    out = export_model(rotary, _trained_shards(rotary)[0], tmp_path / "rope")
    assert (out / "model.safetensors").exists() and not (out / "hf").exists()
