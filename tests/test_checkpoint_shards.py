"""Checkpoint shards: safetensors bytes, erasure-coded fragments (any k of n), verification, manifests."""

import itertools

import pytest
import torch

from swarm.checkpoint import (Fragment, FragmentError, ShardError, StageShard, decode_shard, encode_shard,
                              join_fragments, split_into_fragments)
from swarm.identity import Identity
from swarm.protocol import CheckpointManifest, FragmentEntry, ProtocolError, open_record, seal
from tests.conftest import endorsed


def _shard():
    gen = torch.Generator().manual_seed(0)
    return StageShard("run-x", 1, 7, {"param/w": torch.randn(300, 40, generator=gen),
                                      "param/b": torch.randn(40, generator=gen).half(),
                                      "opt/w/step": torch.tensor(3.0), "data/order": torch.arange(9)},
                      {"lr_step": 7, "data_position": [2, 128]})


def test_shard_round_trips_bit_exactly_with_its_metadata():
    shard = _shard()
    blob, sha = encode_shard(shard)
    back = decode_shard(blob, sha, run_id="run-x", stage=1)
    assert (back.run_id, back.stage, back.epoch, back.meta) == ("run-x", 1, 7, shard.meta)
    for name, t in shard.tensors.items():
        assert back.tensors[name].dtype == t.dtype and torch.equal(back.tensors[name], t)
    assert encode_shard(shard)[1] == sha  # deterministic: the hash addresses the content


def test_shard_errors_name_the_cause():
    blob, sha = encode_shard(_shard())
    with pytest.raises(ShardError, match="does not match the manifest"):
        decode_shard(blob[:-1] + b"\0", sha)
    with pytest.raises(ShardError, match="not 'run-y'"):
        decode_shard(blob, sha, run_id="run-y")
    with pytest.raises(ShardError, match="not 2"):
        decode_shard(blob, sha, stage=2)
    import hashlib
    junk = b"\x08" + b"\0" * 7 + b"not json"
    with pytest.raises(ShardError, match="does not parse"):
        decode_shard(junk, hashlib.sha256(junk).hexdigest())


def test_any_k_of_n_fragments_restore_the_shard():
    blob, sha = encode_shard(_shard())
    k, n = 3, 5
    fragments = split_into_fragments(blob, k, n)
    assert len(fragments) == n and all(len(f.data) == -(-len(blob) // k) for f in fragments)
    for subset in itertools.combinations(fragments, k):
        assert join_fragments(subset, k, n, len(blob), sha) == blob


def test_corrupt_duplicate_or_missing_fragments_are_refused():
    blob, sha = encode_shard(_shard())
    fragments = split_into_fragments(blob, 2, 4)
    bad = Fragment(1, b"\0" + fragments[1].data[1:], fragments[1].sha256)
    with pytest.raises(FragmentError, match="fragment 1 does not match its hash"):
        join_fragments([fragments[0], bad], 2, 4, len(blob), sha)
    with pytest.raises(FragmentError, match="1 valid fragments, 2 needed"):
        join_fragments([fragments[3], fragments[3]], 2, 4, len(blob), sha)
    with pytest.raises(ValueError, match="k <= n"):
        split_into_fragments(blob, 5, 4)


def test_manifest_is_signed_and_lists_fragments():
    blob, sha = encode_shard(_shard())
    fragments = split_into_fragments(blob, 2, 4)
    me = Identity.generate()
    manifest = CheckpointManifest(
        run_id="run-x", peer_id=me.peer_id, time=0.0, stage=1, epoch=7, shard_sha256=sha, size=len(blob), k=2, n=4,
        fragments=[FragmentEntry(index=f.index, sha256=f.sha256, holders=[me.peer_id]) for f in fragments],
        **endorsed("run-x", me, stage=1, epoch=7))
    opened, _ = open_record(seal(manifest, me), CheckpointManifest, run_id="run-x")
    assert opened == manifest
    with pytest.raises(ProtocolError):
        open_record(seal(manifest, me), CheckpointManifest, run_id="run-y")


def test_a_manifest_counts_only_with_a_second_peers_matching_endorsement():
    """A fresh key alone cannot commit a checkpoint: it needs another peer's endorsement of the same stage,
    epoch, state and writer (swarm.trust.authority)."""
    me, other = Identity.generate(), Identity.generate()
    fields = dict(run_id="run-x", peer_id=me.peer_id, time=0.0, stage=1, epoch=7, shard_sha256="a" * 64, size=1,
                  k=1, n=1, fragments=[FragmentEntry(index=0, sha256="b" * 64)])
    with pytest.raises(ValueError, match="endorsements"):
        CheckpointManifest(**fields, state_sha256="c" * 64, endorsements=[])
    good = CheckpointManifest(**fields, **endorsed("run-x", me, stage=1, epoch=7, endorser=other))
    assert open_record(seal(good, me), CheckpointManifest, run_id="run-x")[0] == good
    bad = {
        "its writer": endorsed("run-x", me, stage=1, epoch=7, endorser=me),
        "another epoch": endorsed("run-x", me, stage=1, epoch=8, endorser=other),
        "another state": endorsed("run-x", me, stage=1, epoch=7, state_sha256="d" * 64, endorser=other),
        "another writer": endorsed("run-x", other, stage=1, epoch=7, endorser=Identity.generate()),
    }
    for what, endorsement in bad.items():
        forged = good.model_copy(update={"endorsements": endorsement["endorsements"]})
        with pytest.raises(ProtocolError, match="endorse"):
            open_record(seal(forged, me), CheckpointManifest, run_id="run-x")  # endorsed by ``what``


def test_stage_state_restores_bit_exactly_and_training_continues_identically(tiny_spec):
    from swarm.averaging.schedule import make_torch_optimizer
    from swarm.checkpoint.state import capture_stage_state, restore_stage_state
    from swarm.model import build_stage

    def step(module, opt, seed):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randint(0, tiny_spec.model.vocab_size, (2, 16), generator=gen)
        module(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()

    a = build_stage(tiny_spec.model, 0)
    opt_a = make_torch_optimizer(tiny_spec.optim, a.parameters())
    for s in range(3):
        step(a, opt_a, s)
    blob, sha = encode_shard(capture_stage_state("run-x", 0, 3, a, opt_a, {"data_position": 24}))
    shard = decode_shard(blob, sha, run_id="run-x", stage=0)
    b = build_stage(tiny_spec.model, 0)
    opt_b = make_torch_optimizer(tiny_spec.optim, b.parameters())
    restore_stage_state(shard, b, opt_b)
    assert shard.meta == {"data_position": 24} and shard.epoch == 3
    step(a, opt_a, 99)
    step(b, opt_b, 99)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), n
    with pytest.raises(ShardError, match="another model"):
        restore_stage_state(shard, build_stage(tiny_spec.model, 1), opt_b)


def test_a_loaded_state_is_written_into_the_tensors_the_optimizer_already_holds(tiny_spec):
    """hivemind's state averager averages the optimizer's own statistics tensors (shared memory): a load must
    overwrite those, not replace them, or the server's Adam moments are never averaged again."""
    from swarm.averaging.schedule import make_stage_torch_optimizer
    from swarm.checkpoint.state import load_named_state, named_state
    from swarm.model import build_stage

    source, target = build_stage(tiny_spec.model, 1), build_stage(tiny_spec.model, 1)
    opt_source = make_stage_torch_optimizer(tiny_spec.optim, source.parameters())
    source(torch.randn(2, 16, tiny_spec.model.d_model)).float().square().mean().backward()
    opt_source.step()
    opt_target = make_stage_torch_optimizer(tiny_spec.optim, target.parameters())
    held = [t for p in target.parameters() for t in opt_target.state[p].values()]
    load_named_state(named_state(source, opt_source), target, opt_target)
    now = [t for p in target.parameters() for t in opt_target.state[p].values()]
    assert all(a is b for a, b in zip(held, now)) and len(held) == len(now)
    loaded = named_state(target, opt_target)
    assert all(torch.equal(v, loaded[k]) for k, v in named_state(source, opt_source).items())


def test_the_servers_of_a_stage_take_turns_writing_its_checkpoints():
    """Whoever reads the same servers names the same writer of an epoch; over epochs the turn spreads over all of
    them (no one server encodes every checkpoint, and a key ground to sort first is no more often the writer)."""
    from collections import Counter

    from swarm.checkpoint.commit import writer_of

    servers = [Identity.generate().peer_id for _ in range(8)]
    turns = Counter(writer_of("run-x", 1, epoch, servers) for epoch in range(800))
    assert set(turns) == set(servers) and max(turns.values()) < 3 * 800 / 8
    assert all(writer_of("run-x", 1, e, servers) == writer_of("run-x", 1, e, reversed(servers)) for e in range(50))
    assert sum(writer_of("run-x", 0, e, servers) != writer_of("run-x", 1, e, servers) for e in range(50)) > 25
    lowest = ["0" * 16, *servers]  # the lowest id writes only its share
    assert sum(writer_of("run-x", 1, e, lowest) == "0" * 16 for e in range(900)) < 3 * 900 / 9
    with pytest.raises(ValueError):
        writer_of("run-x", 1, 7, [])
