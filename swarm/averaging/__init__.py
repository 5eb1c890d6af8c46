"""Intra-stage averaging: the collaborative optimizer of a stage, compressors, robust aggregators, bans."""

from swarm.averaging.aggregation import Aggregator, MeanAggregator, make_aggregator
from swarm.averaging.compression import Compressor, make_compressor
from swarm.averaging.optimizer import build_stage_optimizer, lr_at_epoch

__all__ = [
    "Aggregator",
    "MeanAggregator",
    "make_aggregator",
    "Compressor",
    "make_compressor",
    "build_stage_optimizer",
    "lr_at_epoch",
]
