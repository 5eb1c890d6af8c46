"""Corpus loading, the byte-level BPE tokenizer, and deterministic sharding of samples."""

from swarm.data.corpus import load_documents
from swarm.data.dataset import TokenDataset, prepare_dataset, shard_order
from swarm.data.tokenizer import load_or_train_tokenizer

__all__ = ["load_documents", "TokenDataset", "prepare_dataset", "shard_order", "load_or_train_tokenizer"]
