"""A byte-level BPE tokenizer (Hugging Face ``tokenizers``), trained locally and cached by its inputs.

Training is deterministic for the same text, vocabulary size and library version, so every trainer of a
run trains the same tokenizer; its SHA-256 is logged so that a mismatch can be seen.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

logger = logging.getLogger(__name__)

EOS = "<|endoftext|>"


def load_or_train_tokenizer(texts: Iterable[str], vocab_size: int, cache_dir: Path, corpus_key: str) -> Tokenizer:
    """The tokenizer for ``corpus_key`` (a digest of the training text) and ``vocab_size``; trains and caches it.

    ``texts`` is consumed only when the cache misses. Token id 0 is :data:`EOS`.
    """
    path = Path(cache_dir) / "tokenizers" / f"bpe-{vocab_size}-{corpus_key[:16]}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tok.save(str(tmp))
    tmp.replace(path)
    logger.info("trained tokenizer %s (sha256 %s)", path.name, hashlib.sha256(tok.to_str().encode()).hexdigest()[:16])
    return tok
