import pytest
import torch

from swarm.config import ModelSpec
from swarm.model import build_stage, lm_loss


@pytest.mark.parametrize("mlp, positions, layers", [("gelu", "learned", [1, 2, 1]), ("swiglu", "rope", [3, 1])])
def test_chained_stages_equal_whole_model(mlp, positions, layers):
    spec = ModelSpec(vocab_size=300, d_model=32, n_heads=4, n_layers=4, max_seq_len=16, mlp=mlp,
                     positions=positions, stage_layers=layers)
    whole = build_stage(spec)
    stages = [build_stage(spec, k) for k in range(len(layers))]
    # same parameters under the same names
    split_state = {k: v for m in stages for k, v in m.state_dict().items()}
    assert split_state.keys() == whole.state_dict().keys()
    for k, v in whole.state_dict().items():
        assert torch.equal(v, split_state[k]), k

    tokens = torch.randint(0, 300, (3, 17), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]
    loss_whole = lm_loss(whole(x), y)
    loss_whole.backward()
    # chained as the swarm runs it: detach at every boundary and pass gradients back by hand
    acts, leaves = [], []
    h = x
    for m in stages:
        leaf = h if h.dtype == torch.int64 else h.detach().requires_grad_(True)
        leaves.append(leaf)
        h = m(leaf)
        acts.append(h)
    loss_split = lm_loss(acts[-1], y)
    loss_split.backward()
    for k in range(len(stages) - 2, -1, -1):
        acts[k].backward(leaves[k + 1].grad)

    assert torch.allclose(loss_whole, loss_split, atol=1e-6)
    split_grads = {n: p.grad for m in stages for n, p in m.named_parameters()}
    for n, p in whole.named_parameters():
        assert torch.allclose(p.grad, split_grads[n], atol=1e-6, rtol=1e-5), n


def test_initial_loss_is_uniform():
    spec = ModelSpec(vocab_size=512, d_model=32, n_heads=2, n_layers=2, max_seq_len=8, stage_layers=[1, 1])
    tokens = torch.randint(0, 512, (4, 9))
    loss = lm_loss(build_stage(spec)(tokens[:, :-1]), tokens[:, 1:])
    assert abs(loss.item() - torch.log(torch.tensor(512.0)).item()) < 0.1


def test_check_input_rejects_bad_tensors():
    spec = ModelSpec(vocab_size=256, d_model=16, n_heads=2, n_layers=2, max_seq_len=8, stage_layers=[1, 1])
    first, second = build_stage(spec, 0), build_stage(spec, 1)
    first.check_input(torch.zeros(2, 8, dtype=torch.int64))
    second.check_input(torch.zeros(2, 8, 16))
    bad = [
        (first, torch.zeros(2, 8), "int64 token ids"),
        (first, torch.full((2, 8), 256, dtype=torch.int64), "must lie in"),
        (first, torch.zeros(2, 9, dtype=torch.int64), "1..8 tokens"),
        (second, torch.zeros(2, 8, 15), "float32"),
        (second, torch.zeros(2, 8, 16, dtype=torch.float64), "float32"),
        (second, torch.full((2, 8, 16), float("nan")), "NaN"),
    ]
    for module, x, msg in bad:
        with pytest.raises(ValueError, match=msg):
            module.check_input(x)
