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
    for name, change in (("rope", {"positions": "rope", "n_heads": 2}), ("rmsnorm", {"norm": "rmsnorm"})):
        other = SPEC.model_copy(update=change)  # no GPT-2 equivalent: our own files only
        out = export_model(other, _trained_shards(other)[0], tmp_path / name)
        assert (out / "model.safetensors").exists() and not (out / "hf").exists()


def test_the_export_says_which_stage_holds_its_epoch_back():
    from types import SimpleNamespace

    from coordinator.checkpoints import complete_epochs, lag_report

    def view(epoch, restorable=True, age=0.0):
        return SimpleNamespace(manifest=SimpleNamespace(epoch=epoch), restorable=restorable, age_s=age)

    # stage 0 committed epochs 40, 50 and 60; stage 1 only 40 (its 50 lost too many fragments)
    views = {0: [view(60, age=5), view(50, age=65), view(40, age=125)],
             1: [view(50, restorable=False, age=64), view(40, age=124)]}
    assert complete_epochs(views) == [40]
    lag = lag_report(views, 40, {0: 56, 1: 55})
    assert lag["epoch"] == 40 and lag["age_s"] == 124
    assert lag["stages"] == [{"stage": 0, "newest_checkpoint": 60, "epoch_now": 56},
                             {"stage": 1, "newest_checkpoint": 40, "epoch_now": 55}]
    assert "stage 0 has epoch 60, but stage 1 not yet" in lag["summary"]
    assert "committed 124 s ago" in lag["summary"] and "the run is at epoch 56" in lag["summary"]
    # every stage at the exported epoch, the run no further: nothing holds it back
    assert lag_report({0: [view(40)], 1: [view(40)]}, 40, {0: 40, 1: 40})["summary"] == \
        "epoch 40 (committed 0 s ago) is the newest every stage has a restorable checkpoint of"
