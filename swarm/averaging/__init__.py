"""Intra-stage averaging: the collaborative optimizer of a stage, compressors, robust aggregators, exclusions,
audits."""

from swarm.averaging.aggregation import Aggregator, MeanAggregator, make_aggregator
from swarm.averaging.compression import Compressor, make_compressor
from swarm.averaging.optimizer import StageOptimizer
from swarm.averaging.schedule import lr_at_epoch

__all__ = [
    "Aggregator",
    "MeanAggregator",
    "make_aggregator",
    "Compressor",
    "make_compressor",
    "StageOptimizer",
    "lr_at_epoch",
]
