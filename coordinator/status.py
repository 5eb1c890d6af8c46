"""A snapshot of a run from its signed DHT records (servers, trainers, ban list), as a dict or rich tables.

The records every peer re-publishes each ``record_ttl_s / 3`` seconds are the run's metrics records: a
server's :class:`~swarm.protocol.ServerInfo` (throughput, epoch, loss, averaging counters, exclusions, history
of epoch times and losses), a trainer's :class:`~swarm.protocol.TrainerInfo` (samples, tokens, loss, validation
loss). Nothing is trusted that is not signed by its peer; records expire with ``record_ttl_s``.

``status --json`` shape (stable: keys are only ever added; the one exception, at protocol 2, renamed
``banned_by_coordinator``/``banned_by``/``ban_reasons`` to ``ban_reason``/``excluded_by``/``exclusion_reasons``
and split ``excluded`` off ``banned``)::

    {"run": {"run_id", "name", "spec_hash", "num_stages", "epoch", "total_epochs", "progress", "eta_s",
             "tokens", "samples_per_s", "loss", "train_loss", "val_loss", "loss_history": [[epoch, loss]],
             "peers": {"online", "joining", "lagging", "paused", "draining", "trainers", "banned", "excluded"},
             "recognition_age_s" (seconds since the coordinator signed the recognition; None: none valid),
             "admission" (the spec's [admission] policy: "open", "invite" or "allowlist"),
             "delegates" (peer id -> seconds its delegation to issue tickets lasts; None in an open run)},
     "stages": [{"stage", "servers_online", "servers", "throughput", "demand", "epoch", "lagging",
                 "samples", "samples_dropped", "last_round": {"group_size", "round_s"},
                 "recognized" (its online servers the run key recognizes; None: no recognition)}],
     "peers": [{"peer_id", "name", "version", "role", "stage", "state", "reachability", "epoch",
                "throughput", "samples_per_s", "samples", "contribution", "last_seen_s", "lagging", "loss",
                "rejected_parts", "flagged_parts", "banned", "ban_reason", "excluded",
                "admitted" (holds a valid ticket signed by the run key; None in an open run),
                "ticket_expires_s" (seconds until its newest ticket expires; None: none valid, or an open run),
                # servers also: "p2p_id", "excluded_by" (servers of its stage), "exclusion_reasons",
                #   "averaging_bytes", "failed_rounds", "convicted_by" (peers listing a spot-check conviction),
                #   "samples_dropped" (accumulated, then discarded before a step: see ServerInfo.samples_dropped),
                #   "refused_as_donor_by" (servers that downloaded its state and refused it),
                #   "vouched_by" (servers of its stage that verified its averaging work, ServerInfo.vouches),
                #   "standing" (the lower median of the weights its online stage-mates give it, 0..1; None alone),
                #   "peak_flops" (its device's measured FLOP/s), "model_flops" (model FLOP/s while computing),
                #   "mfu" (their ratio, None if unknown: swarm.kernels.flops),
                #   "recognized" (the run key's recognition names it, swarm.trust.recognition; None: no
                #   recognition is published)
                # trainers also: "tokens", "initial_loss", "val_loss", "share", "failures",
                #   "bytes_sent", "bytes_received"
                }],
     "healthy": bool}

Units: seconds, samples/s, nats/token; ``contribution`` and ``progress`` are fractions in [0, 1]. A server's
contribution is its share of the samples its stage's listed servers processed (0 while paused, when it also
announces 0 samples/s and is left out of the others' shares; where the run key's recognition names some of the
stage's servers, of the samples of those it names, at most 1); a trainer's, its share of
the trainers' samples/s. ``eta_s`` is the time to ``optim.total_epochs`` (the end of the learning-rate
schedule) at the slowest stage's recent epoch rate; ``None`` until two epochs were seen. A peer *lags* when
its record is older than a re-announce period plus slack, or a server is more than one epoch behind its stage.
A stage's ``epoch``, epoch rate (for ``eta_s``), ``throughput``, ``samples`` and who is ``excluded`` come from the
servers the run key's recognition names on it where it names some of its online ones (of them, for ``epoch``, rate
and ``throughput``, those still working: :func:`~swarm.server.served.counted_claims`), else from every record
(lower medians for epoch and rate): fresh keys' records then neither move nor mislead them.
``banned``: on the run's ban list (``ban_reason`` its reason); ``excluded``: more than half of the other online
servers of its stage excluded it from averaging (it is not routed to either). A banned peer with no record
left is listed with role ``unknown`` and state ``gone`` (``last_seen_s`` None).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from hivemind.utils import get_dht_time

from swarm.config import RunSpec
from swarm.net.directory import RunDirectory
from swarm.protocol import ServerInfo, ServerState, TrainerInfo
from swarm.server.rebalance import stage_demand
from swarm.server.served import counted_claims
from swarm.trainer.routing import excluded_by_stage
from swarm.trust.delegates import live_delegations
from swarm.trust.recognition import read_recognition
from swarm.trust.tickets import all_tickets


def _lag(directory: RunDirectory, record_time: float, now: float, slack_s: float = 2.0) -> bool:
    return now - record_time > directory.ttl / 3 + slack_s


def _epoch_rate(history: list[tuple[int, float, Optional[float]]]) -> Optional[float]:
    """Epochs per second over the newest half of a server's history (at least two points)."""
    recent = history[len(history) // 2:] if len(history) >= 4 else history
    if len(recent) < 2 or recent[-1][1] <= recent[0][1]:
        return None
    return (recent[-1][0] - recent[0][0]) / (recent[-1][1] - recent[0][1])


def _lower_median(values: list) -> Any:
    """The lower median of ``values`` (0 for none): what most of a stage's servers say, not its largest claim
    (a record's epoch or epoch rate is its signer's word, and keys cost nothing)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2] if ordered else 0


def _deciding(group: list[ServerInfo], online: list[ServerInfo], named: Optional[frozenset[str]]) -> tuple:
    """``(deciding, counted, vote)`` of a stage: the online servers whose records make its epoch, epoch rate and
    throughput, those whose samples it sums, and each record's vote on its exclusions (peer id -> vote, for
    :func:`~swarm.trainer.routing.excluded_by_stage`; None: one per record). Where the run key's recognition
    (``named``: peer ids; None: none published) names some of the ``online`` ones: the named ones still working
    (:func:`~swarm.server.served.counted_claims`, as rebalancing counts them), the named ones, and 1 for a named
    server, 0 for others; else every record. A fresh key's epoch, 10^6 samples/s or 2^53 samples then move none
    of them, and five fresh keys listing the stage's honest servers as excluded exclude nobody."""
    if named is None or not any(s.peer_id in named for s in online):
        return online, group, None
    recognized = [s for s in online if s.peer_id in named]
    return (counted_claims(online, named) or recognized, [s for s in group if s.peer_id in named],
            lambda peer_id: 1.0 if peer_id in named else 0.0)


def _server_row(s: ServerInfo, k: int, online: list[ServerInfo], excluded_by_most: set[str], stage_samples: int,
                stage_epoch: int, banned: dict[str, str], now: float, directory: RunDirectory,
                recognized: Optional[frozenset[str]] = None) -> dict[str, Any]:
    others = [o for o in online if o.p2p_id != s.p2p_id]
    return {
        "peer_id": s.peer_id, "name": s.name, "version": s.version, "role": "server", "stage": k,
        "state": str(s.state), "reachability": s.reachability, "epoch": s.epoch,
        "throughput": round(s.throughput, 3), "samples_per_s": round(s.throughput, 3), "samples": s.samples,
        "samples_dropped": s.samples_dropped,
        "contribution": round(min(1.0, s.samples / stage_samples), 4)
        if stage_samples and s.state != ServerState.PAUSED else 0.0,
        "last_seen_s": round(max(0.0, now - s.time), 1),
        "lagging": _lag(directory, s.time, now) or (s.state == ServerState.ONLINE and s.epoch < stage_epoch - 1),
        "loss": s.loss, "p2p_id": s.p2p_id, "banned": s.peer_id in banned, "ban_reason": banned.get(s.peer_id),
        "excluded": s.p2p_id in excluded_by_most, "excluded_by": sum(s.p2p_id in o.excluded for o in others),
        "exclusion_reasons": sorted({o.excluded[s.p2p_id] for o in others if s.p2p_id in o.excluded}),
        "rejected_parts": s.averaging.get("rejected", 0), "flagged_parts": s.averaging.get("flagged", 0),
        "averaging_bytes": s.averaging.get("sent", 0) + s.averaging.get("received", 0),
        "failed_rounds": s.averaging.get("failed", 0),
        "refused_as_donor_by": sum(s.p2p_id in o.donors_refused for o in others),
        "vouched_by": sum(s.p2p_id in o.vouches for o in others),
        "standing": _lower_median([o.vouches.get(s.p2p_id, 0.0) for o in others]) if others else None,
        "peak_flops": s.peak_flops, "model_flops": round(s.achieved_flops, 1),
        "mfu": round(s.mfu, 4) if s.mfu is not None else None,
        "recognized": s.peer_id in recognized if recognized is not None else None,
    }


def _trainer_row(t: TrainerInfo, total_rate: float, banned: dict[str, str], now: float,
                 directory: RunDirectory) -> dict[str, Any]:
    return {
        "peer_id": t.peer_id, "name": t.name, "version": t.version, "role": "trainer", "stage": None,
        "state": t.state, "reachability": t.reachability, "epoch": None,
        "throughput": round(t.samples_per_s, 3), "samples_per_s": round(t.samples_per_s, 3), "samples": t.samples,
        "contribution": round(t.samples_per_s / total_rate, 4) if total_rate else 0.0,
        "last_seen_s": round(max(0.0, now - t.time), 1), "lagging": _lag(directory, t.time, now),
        "loss": t.loss, "banned": t.peer_id in banned, "ban_reason": banned.get(t.peer_id), "excluded": False,
        "rejected_parts": 0, "flagged_parts": 0, "tokens": t.tokens, "initial_loss": t.initial_loss,
        "val_loss": t.val_loss, "share": t.share, "failures": t.failures, "bytes_sent": t.bytes_sent,
        "bytes_received": t.bytes_received,
    }


def _gone_row(peer_id: str, reason: str) -> dict[str, Any]:
    """A banned peer that publishes no record (it stopped, as banned peers do): listed so it can be unbanned."""
    return {
        "peer_id": peer_id, "name": "", "version": "", "role": "unknown", "stage": None, "state": "gone",
        "reachability": "unknown", "epoch": None, "throughput": 0.0, "samples_per_s": 0.0, "samples": 0,
        "contribution": 0.0, "last_seen_s": None, "lagging": False, "loss": None, "rejected_parts": 0,
        "flagged_parts": 0, "banned": True, "ban_reason": reason, "excluded": False,
    }


def snapshot(directory: RunDirectory, spec: RunSpec) -> dict[str, Any]:
    """Read every stage's servers and their histories, the trainers and the ban list once and summarise them
    (shape above)."""
    stage_ids = range(spec.model.num_stages)
    with ThreadPoolExecutor(2 * len(stage_ids) + 5) as pool:  # (one DHT lookup each, all in flight at once)
        reading = {k: pool.submit(directory.servers, k) for k in stage_ids}
        reading_histories = {k: pool.submit(directory.histories, k) for k in stage_ids}
        reading_trainers, reading_bans = pool.submit(directory.trainers), pool.submit(directory.bans)
        reading_recognition = pool.submit(read_recognition, directory)
        ticketed = spec.admission.policy != "open"  # (its tickets and delegations)
        reading_admission = [pool.submit(read, directory) for read in (all_tickets, live_delegations) if ticketed]
        servers = {k: f.result() for k, f in reading.items()}
        histories = {k: f.result() for k, f in reading_histories.items()}
        trainers, (ban_list, _) = reading_trainers.result(), reading_bans.result()
        recognition = reading_recognition.result()
        tickets, delegates = (_expiries(reading_admission[0].result()), reading_admission[1].result()) if ticketed \
            else (None, None)
    banned = dict(ban_list.banned) if ban_list is not None else {}
    now = get_dht_time()
    demand = stage_demand(spec.model)
    stages, peers, rates = [], [], []
    for k, group in servers.items():
        online = [s for s in group if s.state == ServerState.ONLINE]
        named = frozenset(recognition.servers.get(k, ())) if recognition is not None else None
        deciding, counted, vote = _deciding(group, online, named)
        epoch = _lower_median([s.epoch for s in deciding or group])  # one key's record cannot move it
        stage_samples = sum(s.samples for s in counted if s.state != ServerState.PAUSED)
        excluded_by_most = excluded_by_stage(group, vote)
        rows = [_server_row(s, k, online, excluded_by_most, stage_samples, epoch, banned, now, directory, named)
                for s in group]
        peers += rows
        stage_rates = [r for r in (_epoch_rate(histories[k].get(s.peer_id, [])) for s in deciding) if r]
        rates.append(_lower_median(stage_rates) if stage_rates else None)
        stages.append({
            "stage": k, "servers_online": len(online), "servers": len(group),
            "throughput": round(sum(s.throughput for s in deciding), 3), "demand": round(demand[k], 3),
            "epoch": epoch, "lagging": sum(r["lagging"] for r in rows),
            "samples": sum(s.samples for s in counted), "samples_dropped": sum(s.samples_dropped for s in counted),
            "last_round": {"group_size": max((s.peers_in_last_round for s in online), default=0),
                           "round_s": round(sum(s.round_s for s in online) / len(online), 3) if online else None},
            "recognized": sum(s.peer_id in named for s in online) if named is not None else None,
        })
    total_rate = sum(t.samples_per_s for t in trainers)
    peers += [_trainer_row(t, total_rate, banned, now, directory) for t in trainers]
    listing = [r.convicted for group in servers.values() for r in group] + [t.convicted for t in trainers]
    for row in peers:
        if row["role"] == "server":
            row["convicted_by"] = sum(row["peer_id"] in c for c in listing)
    listed = {p["peer_id"] for p in peers}
    peers += [_gone_row(peer, reason) for peer, reason in sorted(banned.items()) if peer not in listed]
    for row in peers:
        expires = tickets.get(row["peer_id"], now) if tickets is not None else None
        row["admitted"] = expires > now if expires is not None else None
        row["ticket_expires_s"] = round(expires - now, 1) if expires is not None and expires > now else None
    last = [s for s in servers.get(spec.model.num_stages - 1, []) if s.state == ServerState.ONLINE]
    run = _run_summary(directory, spec, trainers, stages, peers, rates, banned)
    run.update(_losses(last, histories[spec.model.num_stages - 1], trainers))
    run["recognition_age_s"] = round(max(0.0, now - recognition.time), 1) if recognition is not None else None
    run["admission"], run["delegates"] = str(spec.admission.policy), _delegates(delegates, now)
    return {"run": run, "stages": stages, "peers": peers, "healthy": all(s["servers_online"] > 0 for s in stages)}


def _delegates(delegates: Optional[dict], now: float) -> Optional[dict[str, float]]:
    """Peer id -> seconds its delegation lasts (:func:`~swarm.trust.delegates.live_delegations`); None: an open run."""
    return {p: round(d.expires - now, 1) for p, (d, _) in delegates.items()} if delegates is not None else None


def _expiries(tickets: list) -> dict[str, float]:
    """Peer id -> when its newest ticket of ``tickets`` (``(Ticket, sealed)``, :func:`~swarm.trust.tickets.
    all_tickets`) expires, DHT time."""
    out: dict[str, float] = {}
    for ticket, _ in tickets:
        out[ticket.subject] = max(out.get(ticket.subject, 0.0), ticket.expires)
    return out


def _losses(last: list[ServerInfo], histories: dict[str, list], trainers: list[TrainerInfo]) -> dict[str, Any]:
    """The run's losses: the trainers' mean, the last stage's online servers' lowest EMA (``last``), the newest
    validation loss and the loss curve their histories (peer id -> history) draw, nats/token."""
    losses = [t.loss for t in trainers if t.loss is not None]
    vals = sorted((t.val_time, t.val_loss) for t in trainers if t.val_loss is not None)
    curve: dict[int, float] = {}
    for s in last:
        for e, _, loss in histories.get(s.peer_id, []):
            if loss is not None:
                curve.setdefault(e, loss)
    return {
        "loss": sum(losses) / len(losses) if losses else None,
        "train_loss": min((s.loss for s in last if s.loss is not None), default=None),
        "val_loss": vals[-1][1] if vals else None,
        "loss_history": [[e, round(v, 5)] for e, v in sorted(curve.items())],
    }


def _run_summary(directory: RunDirectory, spec: RunSpec, trainers: list[TrainerInfo], stages: list[dict],
                 peers: list[dict], rates: list, banned: dict[str, str]) -> dict[str, Any]:
    """The ``run`` part of a snapshot but its losses (:func:`_losses`)."""
    epoch = min((s["epoch"] for s in stages), default=0)
    total = spec.optim.total_epochs
    known = [r for r in rates if r]
    eta = max(0.0, (total - epoch) / min(known)) if known and len(known) == len(rates) else None
    count = lambda pred: sum(1 for p in peers if pred(p))  # noqa: E731
    return {
        "run_id": directory.run_id, "name": spec.name, "spec_hash": spec.spec_hash(),
        "num_stages": spec.model.num_stages, "epoch": epoch, "total_epochs": total,
        "progress": round(min(1.0, epoch / total), 4), "eta_s": round(eta, 1) if eta is not None else None,
        "tokens": sum(t.tokens for t in trainers), "samples_per_s": round(sum(t.samples_per_s for t in trainers), 3),
        "peers": {
            "online": count(lambda p: p["state"] in ("online", "training") and not p["lagging"]),
            "joining": count(lambda p: p["state"] == "joining"),
            "lagging": count(lambda p: p["lagging"]),
            "paused": count(lambda p: p["state"] == "paused"),
            "draining": count(lambda p: p["state"] == "draining"),
            "trainers": len(trainers), "banned": len(banned), "excluded": count(lambda p: p["excluded"]),
        },
    }
