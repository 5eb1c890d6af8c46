"""Corpus loading, the byte-level BPE tokenizer, and the trainers' deterministic data shares."""

from swarm.data.corpus import load_documents
from swarm.data.dataset import TokenDataset, prepare_dataset, share_order
from swarm.data.tokenizer import load_or_train_tokenizer

__all__ = ["load_documents", "TokenDataset", "prepare_dataset", "share_order", "load_or_train_tokenizer"]
