"""Token samples with a held-out validation split, and deterministic, non-overlapping trainer shares.

Documents are cut at line breaks into pieces of at most :data:`PIECE_BYTES`; the pieces whose name hashes
lowest (``val_fraction`` of them, at least one) form the validation split, so the split does not depend on
document order and never leaks training text. Each split is tokenized once and cached as an int32 array;
sample ``i`` is tokens ``[i*T, i*T + T + 1)`` (inputs are the first ``T``, targets the last ``T``).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from swarm.config import RunSpec
from swarm.data.corpus import CorpusError, load_documents
from swarm.data.tokenizer import EOS, load_or_train_tokenizer

logger = logging.getLogger(__name__)

PIECE_BYTES = 64 * 1024


def _pieces(docs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    out = []
    for name, text in docs:
        start, i = 0, 0
        while start < len(text):
            end = len(text) if len(text) - start <= PIECE_BYTES else text.rfind("\n", start, start + PIECE_BYTES) + 1
            if end <= start:
                end = start + PIECE_BYTES
            out.append((f"{name}#{i}", text[start:end]))
            start, i = end, i + 1
    return out


@dataclass
class TokenDataset:
    """Train and validation token streams of one run; ``seq_len`` tokens per sample.

    ``train``/``val`` are int32 arrays of token ids. :meth:`sample` returns an int64 tensor ``(seq_len+1,)``.
    """

    train: np.ndarray
    val: np.ndarray
    seq_len: int
    tokenizer_sha256: str
    tokenizer_json: str = ""  # the ``tokenizers`` JSON (exported beside a model, decodes generated text)

    def num_samples(self, split: str = "train") -> int:
        return max(0, (len(getattr(self, split)) - 1) // self.seq_len)

    def sample(self, index: int, split: str = "train") -> torch.Tensor:
        tokens = getattr(self, split)
        if not 0 <= index < self.num_samples(split):
            raise IndexError(f"sample {index} out of range for the {split} split ({self.num_samples(split)} samples)")
        start = index * self.seq_len
        return torch.from_numpy(tokens[start : start + self.seq_len + 1].astype(np.int64))

    def batch(self, indices: list[int], split: str = "train") -> torch.Tensor:
        """int64 ``(len(indices), seq_len + 1)``."""
        return torch.stack([self.sample(i, split) for i in indices])


def share_order(num_samples: int, share: int, num_shares: int, seed: int, pass_index: int = 0) -> list[int]:
    """Sample indices of a trainer's data share ``share`` for one pass over the data, in training order.

    The pass is a seeded permutation of all samples; share ``s`` takes positions ``s, s + num_shares, ...``.
    Shares of the same pass are disjoint and together cover every sample exactly once.
    """
    if not 0 <= share < num_shares:
        raise ValueError(f"data share {share} out of range for {num_shares} shares")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + pass_index)
    perm = torch.randperm(num_samples, generator=gen)
    return perm[share::num_shares].tolist()


def prepare_dataset(spec: RunSpec, cache_dir: Path) -> TokenDataset:
    """Load the run's corpus, train or load its tokenizer, tokenize both splits (cached under ``cache_dir``).

    :raises CorpusError: unreadable source, or too little text for a validation split and a training sample.
    """
    cache_dir = Path(cache_dir)
    d = spec.data
    pieces = _pieces(load_documents(d.source, cache_dir, d.text_field, d.max_bytes))
    if len(pieces) < 2:
        raise CorpusError(f"data source {d.source!r} yields {len(pieces)} piece(s) of text; a run needs at least 2 (train and validation)")
    ranked = sorted(pieces, key=lambda p: hashlib.sha256(p[0].encode()).digest())
    n_val = max(1, round(d.val_fraction * len(pieces)))
    val_names = {name for name, _ in ranked[:n_val]}
    train_texts = [t for n, t in pieces if n not in val_names]
    val_texts = [t for n, t in pieces if n in val_names]
    corpus_key = _corpus_key(spec, pieces)

    def _training_text():
        budget = spec.tokenizer.train_bytes
        for text in train_texts:
            if budget <= 0:
                return
            yield text[:budget]
            budget -= len(text)

    tok = load_or_train_tokenizer(_training_text(), spec.model.vocab_size, cache_dir, corpus_key)
    tok_sha = hashlib.sha256(tok.to_str().encode()).hexdigest()
    if tok.get_vocab_size() > spec.model.vocab_size:
        raise CorpusError(f"tokenizer has {tok.get_vocab_size()} tokens > model.vocab_size={spec.model.vocab_size}")
    folder, name = cache_dir / "tokens", f"{corpus_key[:16]}-{tok_sha[:16]}"
    ds = TokenDataset(_tokens(folder / f"{name}-train.npy", tok, train_texts),
                      _tokens(folder / f"{name}-val.npy", tok, val_texts), d.seq_len, tok_sha, tok.to_str())
    if ds.num_samples("train") < 1 or ds.num_samples("val") < 1:
        raise CorpusError(
            f"corpus gives {ds.num_samples('train')} train / {ds.num_samples('val')} validation samples of "
            f"{d.seq_len} tokens; use more text or a smaller data.seq_len"
        )
    logger.info(
        "dataset: %d train / %d val samples of %d tokens, tokenizer sha256 %s",
        ds.num_samples("train"), ds.num_samples("val"), d.seq_len, tok_sha[:16],
    )
    return ds


def _corpus_key(spec: RunSpec, pieces: list[tuple[str, str]]) -> str:
    """SHA-256 (hex) of what the tokens depend on: the source settings and every piece of text."""
    d = spec.data
    h = hashlib.sha256(f"{d.source}|{d.max_bytes}|{d.val_fraction}|{spec.tokenizer.train_bytes}".encode())
    for name, text in pieces:
        h.update(name.encode())
        h.update(hashlib.sha256(text.encode()).digest())
    return h.hexdigest()


def _tokens(path: Path, tok, texts: list[str]) -> np.ndarray:
    """The token ids of ``texts`` (each followed by EOS) as int32, cached at ``path`` (written atomically)."""
    if path.exists():
        return np.load(path)
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    arr = np.asarray(ids, dtype=np.int32)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npy")
    np.save(tmp, arr)
    tmp.replace(path)
    return arr
