"""Checkpoints of stage states: safetensors shards, erasure-coded fragments, signed manifests."""

from swarm.checkpoint.erasure import Fragment, FragmentError, join_fragments, split_into_fragments
from swarm.checkpoint.service import FragmentService, get_fragment, put_fragment
from swarm.checkpoint.shard import ShardError, StageShard, decode_shard, encode_shard
from swarm.checkpoint.state import capture_stage_state, restore_stage_state
from swarm.checkpoint.store import FragmentStore, StoreFull, StoredFragment

__all__ = [
    "Fragment", "FragmentError", "join_fragments", "split_into_fragments",
    "ShardError", "StageShard", "decode_shard", "encode_shard",
    "FragmentStore", "StoreFull", "StoredFragment", "capture_stage_state", "restore_stage_state",
    "FragmentService", "get_fragment", "put_fragment",
]
