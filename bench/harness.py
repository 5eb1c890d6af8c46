"""In-process harness for the averaging sweeps: many simulated peers, the real compressor and reducer code.

One round of :func:`train` is what a stage's servers do in one epoch, with the network taken out:

* every peer computes the gradient of its own micro-batches (all stages chained as one; all honest peers
  hold the same parameters, since the robust all-reduce hands every honest peer bit-identical results);
* Byzantine peers corrupt theirs (:mod:`swarm.attacks`; ALIE and IPM see the honest gradients);
  with a trainer attack the attackers are trainers instead, feeding one server whose
  :class:`~swarm.averaging.contributions.TrainerContributions` combine and score them (its trainer exclusions
  kept across epochs);
* each peer runs its own :class:`~swarm.averaging.compression.Compressor` (its own error feedback) through the
  phases; partition ``j`` is reduced by :func:`~swarm.averaging.reducer.reduce_partition` over the parts as
  decoded from the wire encoding, and its encoded aggregate (corrupted if peer ``j`` is a lying reducer) is
  what every peer receives — exactly the data path of :mod:`swarm.averaging.allreduce`;
* every honest peer keeps its own :class:`~swarm.averaging.exclusion.ExclusionBook` and
  :class:`~swarm.averaging.history.PartHistory` and scores only the senders of the partition it reduced
  (:func:`~swarm.averaging.reducer.as_scored_by`), as a real peer does; each partition is audited with probability
  ``audit_probability`` by the peer :func:`~swarm.averaging.audit.audit_plan` draws (signatures and the
  evidence exchange are left out: the auditor's comparison and its outcome are the same, and a confirmed lie or
  a refuted accusation is verified, so it lands in every honest book); a peer leaves the group once most honest
  peers excluded it (matchmaking keeps excluded peers out of the excluders' groups);
* AdamW steps on the aggregate.

With ``[averaging] mode = "outer"`` in the spec (:mod:`swarm.averaging.outer`), each peer keeps its own copy of
the model and an AdamW of its own, takes ``inner_steps`` inner steps on its share of the epoch's samples, and the
all-reduce above runs on the pseudo-gradients, followed by the outer SGD-Nesterov step every peer then starts from.

Bytes here are the encoded tensors' sizes; the benchmarks count real wire bytes with real averagers.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from bench.harness_hops import Groups, HopStats, grid, hop_round
from swarm.attacks import TRAINER_ATTACKS, make_attack
from swarm.attacks.adaptive import apart
from swarm.averaging.aggregation import make_aggregator
from swarm.averaging.allreduce import digest
from swarm.averaging.compression import ElementwiseCompressor, PhaseResult, flatten, make_compressor, unflatten
from swarm.averaging.contributions import TrainerContributions
from swarm.averaging.audit import audit_plan, matches
from swarm.averaging.history import PartHistory
from swarm.averaging.exclusion import ExclusionBook, ExclusionPolicy, worst
from swarm.averaging.reducer import NoValidParts, ReducePolicy, as_scored_by, partition_bounds, reduce_partition
from swarm.averaging.outer import make_outer_optimizer
from swarm.averaging.schedule import lr_at_epoch, make_scheduler, make_torch_optimizer
from swarm.config import RunSpec
from swarm.data import prepare_dataset
from swarm.model import build_stage, lm_loss

BENCH_SPEC = RunSpec.parse_toml("""
name = "bench-averaging"
[model]
vocab_size = 1024
d_model = 96
n_heads = 4
n_layers = 2
max_seq_len = 64
stage_layers = [2]
[data]
source = "shakespeare"
seq_len = 64
max_bytes = 1500000
num_shares = 16
[tokenizer]
train_bytes = 1500000
[optim]
lr = 2e-3
warmup_epochs = 5
total_epochs = 150
[training]
micro_batch_size = 8
target_batch_size = 112
""", source="the averaging bench spec")


def bench_spec(**averaging) -> RunSpec:
    """The bench spec with these ``[averaging]`` fields (validated: a misspelt one raises SpecError)."""
    return BENCH_SPEC.updated(averaging=averaging)


def outer_spec(spec: RunSpec, inner_steps: int) -> RunSpec:
    """``spec`` in ``outer`` mode with ``inner_steps``; the schedule's warm-up and length, which count epochs (outer
    steps there), shrink by ``inner_steps`` so that every mode warms up and decays over the same samples."""
    o = spec.optim
    return spec.updated(averaging={"mode": "outer", "inner_steps": inner_steps},
                        optim={"warmup_epochs": round(o.warmup_epochs / inner_steps),
                               "total_epochs": max(1, round(o.total_epochs / inner_steps))})


@dataclass
class HarnessResult:
    val_loss: float  # nats/token on held-out text, mean of the last 3 evaluations (every EVAL_EVERY rounds)
    rounds: int
    samples: int
    excluded_at: dict = field(default_factory=dict)  # peer index -> round most honest peers had excluded it
    honest_excluded: int = 0  # honest peers excluded by at least one honest peer
    kappas: list = field(default_factory=list)  # per partition reduced with attackers in the group: the error's kappa
    bytes_per_round: float = 0.0  # encoded bytes one peer sends per round (parts + aggregates it returns)
    hops: HopStats = field(default_factory=HopStats)  # with bounded groups: what the hops did
    seconds: float = 0.0


class Books:
    """The exclusion books of the honest peers, each fed only with what that peer saw."""

    def __init__(self, honest: list[int], policy: ExclusionPolicy):
        self.books = {i: ExclusionBook(policy) for i in honest}

    def record_round(self, reducer: int, verdicts: dict) -> None:
        """Reducer ``reducer``'s verdicts on its partition's senders (an attacker's own book is not kept)."""
        if reducer in self.books:
            self.books[reducer].record_round(verdicts)

    def exclude_everywhere(self, peer: str, reason: str) -> None:
        """A verified verdict (a confirmed audit, a refuted accusation): every honest peer excludes ``peer``."""
        for book in self.books.values():
            book.exclude(peer, reason)

    def excluded(self) -> set[str]:
        """Peers that most honest peers excluded: they are out of the group."""
        counts: dict[str, int] = {}
        for book in self.books.values():
            for peer in book.excluded():
                counts[peer] = counts.get(peer, 0) + 1
        return {p for p, c in counts.items() if 2 * c > len(self.books)}

    def excluded_by_any(self) -> set[str]:
        return {p for book in self.books.values() for p in book.excluded()}

    def is_excluded(self, peer: str) -> bool:
        return peer in self.excluded()


def _grad(model, inputs, targets) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    return [p.grad.detach().clone() for p in model.parameters()]


EVAL_EVERY = 5  # the reported validation loss is the mean of the evaluations at the last 3 multiples of this


def val_loss(model, dataset, spec, batches: int = 32) -> float:
    """Mean loss (nats/token) of ``model`` over the validation split's first ``batches`` micro-batches."""
    b = spec.training.micro_batch_size
    n = min(batches, dataset.num_samples("val") // b)
    with torch.no_grad():
        losses = [float(lm_loss(model(x[:, :-1]), x[:, 1:]))
                  for x in (dataset.batch(list(range(i * b, (i + 1) * b)), "val") for i in range(n))]
    return sum(losses) / len(losses)


def train(spec: RunSpec, cache_dir: Path, *, peers: int = 7, byzantine: int = 0, attack: Optional[str] = None,
          aggregator: str = "centered_clip", compression: str = "none", rank: int = 4, rounds: int = 60,
          checks: bool = True, audit_probability: float = 0.5, seed: int = 0, pre: str = "none",
          history: bool = True, groups: Optional[Groups] = None) -> HarnessResult:
    """Train ``rounds`` epochs with ``peers`` simulated servers, the last ``byzantine`` of them attackers.

    ``groups``: the servers average in bounded groups, hop by hop (:mod:`harness_hops`); None: one group.

    ``checks=False`` turns the reducer's norm check and exclusions off (plain averaging: the control);
    ``history=False`` only the history check (:mod:`swarm.averaging.history`).
    For trainer attacks (``label_flip``, ``grad_flip``) the peers are trainers of one server.
    """
    start = time.perf_counter()
    torch.manual_seed(seed)
    dataset = prepare_dataset(spec, cache_dir)
    model = torch.nn.Sequential(*[build_stage(spec.model, k) for k in range(spec.model.num_stages)])
    opt = make_torch_optimizer(spec.optim, model.parameters())
    sched = make_scheduler(spec.optim, opt)
    params = list(model.parameters())
    avg = spec.averaging
    agg = make_aggregator(aggregator, pre=pre, trim=avg.trim, tau_ratio=avg.clip_tau, iterations=avg.clip_iterations,
                          byzantine_fraction=avg.byzantine_fraction, bucket_size=avg.bucket_size)
    policy = ReducePolicy(reject_norm_ratio=10.0 if checks else 1e30, outlier_ratio=3.0 if checks else 1e30)
    trainer_mode = attack in TRAINER_ATTACKS
    probe = _probe(agg, policy, byzantine)
    attackers = {peers - 1 - i: make_attack(attack, n=peers, f=byzantine, seed=i, probe=probe)
                 for i in range(byzantine)}
    book = Books([i for i in range(peers) if i not in attackers],
                 ExclusionPolicy(threshold=3.0 if checks else math.inf))
    histories = {i: PartHistory(own=str(i)) for i in range(peers) if i not in attackers} if checks and history else {}
    compressors = [make_compressor(compression, rank=rank, fraction=avg.topk_fraction, chunk=avg.topk_chunk,
                                   bits=avg.topk_bits) for _ in range(peers)]
    outer = _OuterHarness(spec, model, peers) if avg.mode == "outer" else None
    b = spec.training.micro_batch_size
    per_peer = max(1, spec.training.target_batch_size // (b * peers))
    # one data stream per peer: honest peers see the same samples whether or not attackers are present
    gens = [torch.Generator().manual_seed(seed * 1000 + i) for i in range(peers)]
    result = HarnessResult(val_loss=float("nan"), rounds=rounds, samples=0)
    bytes_sent, evals = 0, []
    # one server's trainer accounts, kept across epochs as a server keeps them (its trainer exclusions persist)
    contrib = TrainerContributions(aggregator=agg if checks else make_aggregator("mean"),
                                   clip_ratio=5.0 if checks else 0.0, outlier_ratio=2.0 if checks else 0.0)
    for r in range(rounds):
        active = [i for i in range(peers) if not book.is_excluded(str(i))]
        grads = {}
        for i in active:
            grads[i] = _peer_gradient(outer.models[i] if outer else model, dataset, spec, per_peer, gens[i],
                                      attackers.get(i) if trainer_mode else None)
            result.samples += per_peer * b
        if outer is not None:
            outer.inner_step(grads)
            if (r + 1) % avg.inner_steps:
                continue
            grads = outer.pseudo_gradients(active)
        if trainer_mode:  # one server combines its trainers' contributions
            contrib.reset()
            for i in active:
                contrib.add(str(i), grads[i], per_peer * b)
            averaged = contrib.combine(params)
            for excluded in contrib.new_exclusions:
                result.excluded_at.setdefault(int(excluded.peer), r + 1)
            result.honest_excluded = len(set(contrib.exclusion.excluded()) - {str(i) for i in attackers})
        else:
            def all_reduce(values, voters, comps, hop, label):
                return _all_reduce(values, voters, attackers, comps, agg, policy, book, r, seed,
                                   audit_probability if checks else 0.0, result.kappas,
                                   histories if hop == 0 else {}, scored=hop == 0, label=label)

            if groups is not None and len(active) > groups.size:
                plan = grid(active, set(attackers), groups, r, seed)
                averaged, sent = hop_round(all_reduce, grads, attackers, compressors, plan, result.hops)
            else:
                outs, sent = all_reduce(grads, active, compressors, 0, "")
                honest = [i for i in active if i not in attackers] or active
                averaged = outs[honest[0]]
            bytes_sent += sent
            for peer in book.excluded():
                result.excluded_at.setdefault(int(peer), r + 1)
            result.honest_excluded = len(book.excluded_by_any() - {str(i) for i in attackers})
        if outer is not None:
            outer.outer_step(averaged)
            every = max(1, EVAL_EVERY // avg.inner_steps) * avg.inner_steps
            if r >= rounds - 3 * every and (rounds - 1 - r) % every == 0:
                evals.append(val_loss(model, dataset, spec))
            continue
        for p, g in zip(params, averaged):
            p.grad = g.clone()
        opt.step()
        sched.step()
        if r >= rounds - 3 * EVAL_EVERY and (rounds - 1 - r) % EVAL_EVERY == 0:
            evals.append(val_loss(model, dataset, spec))
    result.bytes_per_round = bytes_sent / max(1, rounds // (avg.inner_steps if outer else 1))
    result.val_loss = sum(evals) / len(evals)
    result.seconds = time.perf_counter() - start
    return result


PROBE_VALUES = 32768
"""A tuned attacker probes the rule on this many coordinates (a fixed random sample): a tenth of the bench model's,
enough to rank the scales it tries, at a tenth of the cost."""


def _probe(agg, policy: ReducePolicy, byzantine: int):
    """What a rule-aware attacker runs to tune its lie (:data:`swarm.attacks.Probe`): the reducer's checks and rule
    on the honest vectors plus ``byzantine`` copies of ``bad``, each moved apart as the attackers move theirs
    (:func:`swarm.attacks.adaptive.apart`), on :data:`PROBE_VALUES` sampled coordinates."""
    sample: dict = {}

    def probe(honest: torch.Tensor, bad: torch.Tensor) -> tuple[float, bool]:
        numel = bad.numel()
        if numel not in sample:
            sample[numel] = torch.randperm(numel, generator=torch.Generator().manual_seed(0))[:PROBE_VALUES]
        idx = sample[numel]
        h, b = honest[:, idx], bad[idx]
        gen = torch.Generator().manual_seed(7)  # the attackers keep their vectors apart, as they will when they send
        parts = {f"h{i}": row for i, row in enumerate(h)} | {f"b{i}": apart(b, h, 0.4, gen) for i in range(byzantine)}
        try:
            red = reduce_partition(parts, dict.fromkeys(parts, 1.0), idx.numel(), agg, policy)
        except NoValidParts:
            return 0.0, True
        caught = any(not v.accepted or v.flagged for s, v in red.verdicts.items() if s.startswith("b"))
        return float((red.aggregate - h.mean(0)).norm()), caught
    return probe


def kappa_seen(aggregate: torch.Tensor, honest: torch.Tensor) -> Optional[float]:
    """The kappa of Allouah et al. 2023 that this one aggregation needed: ``|aggregate - mean_H|^2`` over the honest
    parts' mean squared distance to their mean (``honest`` float32 ``(h, numel)``); None when they all agree."""
    mean = honest.double().mean(0)
    var = float((honest.double() - mean).pow(2).sum(1).mean())
    return float((aggregate.double() - mean).pow(2).sum()) / var if var > 0 else None


def _peer_gradient(model, dataset, spec, micro_batches: int, gen, attacker) -> list[torch.Tensor]:
    """One peer's mean gradient over ``micro_batches`` micro-batches drawn with ``gen`` (a trainer attacker's
    corrupted)."""
    b, n_train, acc = spec.training.micro_batch_size, dataset.num_samples("train"), None
    for _ in range(micro_batches):
        batch = dataset.batch(torch.randint(0, n_train, (b,), generator=gen).tolist())
        x, y = batch[:, :-1], batch[:, 1:]
        if attacker is not None:
            x, y = attacker.corrupt_batch(x, y, spec.model.vocab_size)
        g = _grad(model, x, y)
        if attacker is not None:
            g = [attacker.corrupt_grad(t) for t in g]
        acc = g if acc is None else [a + t for a, t in zip(acc, g)]
    return [t / micro_batches for t in acc]


class _OuterHarness:
    """DiLoCo's loop over simulated peers: each peer's model copy and inner AdamW, the outer SGD-Nesterov on the
    shared model (:mod:`swarm.averaging.outer`; the schedule by outer epoch, as a stage's server runs it)."""

    def __init__(self, spec: RunSpec, model: torch.nn.Module, peers: int):
        self.spec, self.model, self.epoch = spec, model, 0
        self.models = [copy.deepcopy(model) for _ in range(peers)]
        self.inner = [make_torch_optimizer(spec.optim, m.parameters()) for m in self.models]
        self.outer = make_outer_optimizer(spec, model.parameters())

    def inner_step(self, grads: dict) -> None:
        lr = self.spec.optim.lr * lr_at_epoch(self.spec.optim, self.epoch)
        for i, g in grads.items():
            for p, t in zip(self.models[i].parameters(), g):
                p.grad = t
            for group in self.inner[i].param_groups:
                group["lr"] = lr
            self.inner[i].step()

    def pseudo_gradients(self, active: list[int]) -> dict:
        return {i: [(o - p).detach() for o, p in zip(self.model.parameters(), self.models[i].parameters())]
                for i in active}

    @torch.no_grad()
    def outer_step(self, averaged: list[torch.Tensor]) -> None:
        for p, g in zip(self.model.parameters(), averaged):
            p.grad = g.clone()
        with torch.enable_grad():
            self.outer.step()
        for m in self.models:
            for q, p in zip(m.parameters(), self.model.parameters()):
                q.copy_(p)
        self.epoch += 1


def _all_reduce(grads, active, attackers, compressors, agg, policy, book, r, seed, audit_probability, kappas,
                histories, scored: bool = True, label: str = ""):
    """One averaging round among ``active`` peers (one group); returns (peer -> averaged tensors, encoded bytes
    ``active[0]`` sent). Appends to ``kappas`` the :func:`kappa_seen` of every partition reduced while an attacker in
    the group lied (a failed partition counts as a zero aggregate). ``scored=False``: the reducers' verdicts are not
    recorded (a later hop of bounded groups, whose parts are blocks' aggregates); ``label`` names the group in the
    audit draw."""
    honest = [i for i in active if i not in attackers]
    honest_flat = torch.stack([flatten(grads[i]) for i in honest or active])  # a group of attackers only: their own
    numel = honest_flat.shape[1]
    mine = _attackers_partitions(compressors[active[0]], numel, active, attackers)
    inputs = {}
    for i in active:
        tensors = grads[i]
        if i in attackers:
            attackers[i].focus(mine)
            tensors = unflatten(attackers[i].corrupt_part(flatten(tensors), r, honest=honest_flat), tensors)
        inputs[i] = tensors
    lying = any(not all(torch.equal(a, b) for a, b in zip(inputs[i], grads[i])) for i in attackers if i in active)
    gens = {i: compressors[i].phases(inputs[i], seed * 100003 + r) for i in active}
    phases = {i: next(g) for i, g in gens.items()}
    verdicts: dict = {}
    sent_bytes = 0
    outputs = {}
    outputs_by_partition: dict = {}
    while phases:
        any_phase = next(iter(phases.values()))
        codec, numel = any_phase.codec, any_phase.vector.numel()
        bounds = partition_bounds(numel, [1.0] * len(active), codec.block)
        aggregate = torch.empty(numel)
        sent = {i: torch.empty(numel) for i in active}
        for j, (a, b) in zip(active, bounds):
            if b <= a:
                continue
            parts, weights = {}, {}
            for i in active:
                encoded = codec.encode(phases[i].vector[a:b])
                parts[str(i)] = codec.decode(encoded, b - a)
                sent[i][a:b] = parts[str(i)]
                claim = attackers[i].claim if i in attackers else None
                weights[str(i)] = 1.0 if claim is None else claim
                if i == active[0] and j != i:
                    sent_bytes += sum(t.numel() * t.element_size() for t in encoded)
            try:
                red = reduce_partition(parts, weights, b - a, agg, policy)
                out = red.aggregate
                if j in histories:
                    histories[j].observe((codec.name, a, b), parts, red)
                for sender, v in as_scored_by(red, str(j), parts, policy.copy_ratio).items():  # reducer j scores its senders only
                    verdicts.setdefault(j, {}).setdefault(sender, []).append(v)
            except NoValidParts:
                out = torch.zeros(b - a)
            if lying and len(honest) > 1:
                kappas.append(kappa_seen(out, torch.stack([parts[str(i)] for i in honest])))
            honest_out = out
            if j in attackers:
                out = attackers[j].corrupt_aggregate(out)
            encoded = codec.encode(out)
            if j == active[0]:
                sent_bytes += (len(active) - 1) * sum(t.numel() * t.element_size() for t in encoded)
            aggregate[a:b] = codec.decode(encoded, b - a)
            outputs_by_partition[j] = (digest(encoded), aggregate[a:b].clone(), honest_out)
        _audit(outputs_by_partition, active, attackers, codec, book, audit_probability,
               f"{seed}:{r}:{label}:{len(outputs)}")
        outputs_by_partition.clear()
        next_phases = {}
        for i in active:
            try:
                next_phases[i] = gens[i].send(PhaseResult(aggregate=aggregate.clone(), sent=sent[i]))
            except StopIteration as stop:
                outputs[i] = stop.value
        phases = next_phases
    for j, seen in verdicts.items():
        if scored:
            book.record_round(j, {sender: worst(vs) for sender, vs in seen.items()})
    return outputs, sent_bytes


def _attackers_partitions(compressor, numel: int, active: list, attackers: dict):
    """The coordinates the attackers reduce, bool ``(numel,)``, for a compressor whose phase is the gradient itself
    (cut at its codec's block); None for others (topk, powersgd: their phases are not the gradient's
    coordinates)."""
    codec = getattr(compressor, "codec", None)
    if codec is None or not isinstance(compressor, ElementwiseCompressor):
        return None
    mine = torch.zeros(numel, dtype=torch.bool)
    for j, (a, b) in zip(active, partition_bounds(numel, [1.0] * len(active), codec.block)):
        mine[a:b] = j in attackers
    return mine


def _audit(outputs, active, attackers, codec, book, probability, group):
    """The audit of :mod:`swarm.averaging.audit` on one phase: the planned auditor recomputes a partition
    (here: compares with what an honest reducer returned) and a confirmed mismatch excludes the reducer; a false
    accusation is refuted by the other peers and excludes the accuser."""
    peers = [str(i) for i in active]
    plan = audit_plan(group, {active.index(j): d for j, (d, _, _) in outputs.items()}, peers, peers, probability)
    for index, auditor in plan.items():
        j = active[index]
        _, received, honest_out = outputs[j]
        lying = not matches(received, honest_out, codec)[0]
        accuser = int(auditor) in attackers and getattr(attackers[int(auditor)], "accuse_always", False)
        if lying and int(auditor) not in attackers:
            book.exclude_everywhere(str(j), "audit: wrong aggregate")
        elif accuser and not lying:
            book.exclude_everywhere(auditor, "false accusation")

