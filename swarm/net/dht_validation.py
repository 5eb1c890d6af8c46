"""A hivemind record validator for one run's DHT keys: a value nobody could have signed is never stored or read.

hivemind keeps, per key, the value with the latest expiration, and a plain value replaces a dictionary: one
``store`` of junk at ``{run}/stage/1`` would hide every server of that stage, and junk at ``{run}/spec`` would
keep new peers out. Every node of the run (servers, trainers, the coordinator) runs
:class:`RunRecordValidator`, which hivemind calls on every value another node asks it to store and on every
value a lookup brings back (``hivemind.dht.validation``, the mechanism of its own ``RSASignatureValidator``):

* under the run's dictionary keys (servers, their histories, trainers, storage, checkpoints, rollback orders,
  bans, the stages' averagers' accusations) only
  sub-key values that are sealed records of the key's kind, signed by the owner of their sub-key, stored under
  their own sub-key and (announcements) to expire within the lifetime their signer gave them, are valid
  (:func:`~swarm.protocol.open_record`, its *Shadowing* rules); a plain value is not;
* under ``{run}/spec`` only the run's genuine sealed spec (:func:`~swarm.protocol.open_spec`);
* under ``{run}/tickets``, ``{run}/invites``, ``{run}/recognition`` and ``{run}/delegates`` only records the run
  key signed (:func:`~swarm.protocol.open_run_key_record`; a ticket: or a delegate the run key named,
  :func:`~swarm.protocol.open_ticket`), stored to expire by the record's own expiry (in every run: a
  stranger's ticket would hide a peer's real one, a stranger's recognition the coordinator's).

Honest nodes refuse the junk, and a reader drops the answer of a node that serves it and keeps the others', so
an outsider's store hides nothing (an answer is dropped whole if one of its sub-keys fails: honest nodes never
hold such a value). Keys that are not the run's (hivemind's own progress and matchmaking keys) pass through: who may
write progress is judged by its readers (:mod:`swarm.averaging.progress`).
"""

from __future__ import annotations

import logging
from typing import Type

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer

from swarm.config import MAX_STAGE_STRIPE_BITS, SpecError
from swarm.protocol import (
    AVERAGERS,
    EXPIRY_SLACK_S,
    Accusation,
    BanList,
    CheckpointManifest,
    Endorsement,
    ProtocolError,
    Record,
    RollbackOrder,
    ServerHistory,
    ServerInfo,
    SpecRecord,
    StorageInfo,
    Ticket,
    Delegation,
    Invite,
    Recognition,
    open_run_key_record,
    TrainerInfo,
    accusations_key,
    bans_key,
    check_carried,
    checkpoints_key,
    history_key,
    open_record,
    open_spec,
    open_ticket,
    rollback_key,
    spec_key,
    stage_keys,
    stage_stripe,
    stripe_names,
    storage_key,
    tickets_key,
    delegates_key,
    invites_key,
    trainers_key,
    recognition_key,
)

logger = logging.getLogger(__name__)

MAX_STAGES = 256
"""Stage keys covered (a run has fewer stages; the validator is built before the spec is known)."""


def run_keys(run_id: str, max_stages: int = MAX_STAGES) -> dict[str, Type[Record]]:
    """The run's DHT keys -> the record kind each holds (every stripe key of every stage's server records)."""
    keys: dict[str, Type[Record]] = {spec_key(run_id): SpecRecord, trainers_key(run_id): TrainerInfo,
                                     storage_key(run_id): StorageInfo, rollback_key(run_id): RollbackOrder,
                                     bans_key(run_id): BanList, tickets_key(run_id): Ticket,
                                     invites_key(run_id): Invite, recognition_key(run_id): Recognition,
                                     delegates_key(run_id): Delegation}
    for k in range(max_stages):
        keys.update({key: ServerInfo for bits in range(MAX_STAGE_STRIPE_BITS + 1) for key in stage_keys(run_id, k, bits)})
        keys[history_key(run_id, k)] = ServerHistory
        keys[checkpoints_key(run_id, k)] = CheckpointManifest
        for averager in AVERAGERS:
            keys[accusations_key(f"{run_id}-stage{k}_{averager}")] = Accusation
    return keys


class RunRecordValidator(RecordValidatorBase):
    """Valid values under run ``run_id``'s keys: see the module docstring. Picklable (it runs in the DHT's
    process)."""

    def __init__(self, run_id: str, max_stages: int = MAX_STAGES):
        self.run_id = run_id
        keys = run_keys(run_id, max_stages)
        ids = {key: DHTID.generate(source=key).to_bytes() for key in keys}
        self._kinds = {ids[key]: kind for key, kind in keys.items()}
        self._stripes = {ids[key]: stripe for k in range(max_stages) for bits in range(1, MAX_STAGE_STRIPE_BITS + 1)
                         for key, stripe in zip(stage_keys(run_id, k, bits), stripe_names(bits))}

    def validate(self, record: DHTRecord) -> bool:
        kind = self._kinds.get(record.key)
        if kind is None:
            return True  # not one of this run's keys
        try:
            sealed = MSGPackSerializer.loads(record.value)
            if kind is SpecRecord:
                if record.subkey != DHTProtocol.IS_REGULAR_VALUE:
                    return False
                open_spec(sealed, self.run_id)
                return True
            if record.subkey in DHTProtocol.RESERVED_SUBKEYS:
                return False  # a plain value would replace the key's whole dictionary
            subkey = MSGPackSerializer.loads(record.subkey)
            if not isinstance(subkey, str) or not isinstance(sealed, bytes):
                return False
            stripe = self._stripes.get(record.key)
            if stripe is not None and stage_stripe(subkey, len(stripe)) != stripe:
                return False  # a server record in another stripe than its peer id's (readers of one stripe miss it)
            if kind in (Ticket, Invite, Recognition, Delegation):  # the run key's only (a ticket: or its delegate's),
                # kept no longer than it lives (an old ticket stored to expire late would hide its renewal: hivemind
                # keeps, per sub-key, the value expiring last)
                found = (open_ticket(sealed, self.run_id, subkey) if kind is Ticket
                         else open_run_key_record(sealed, kind, self.run_id, subkey))
                return record.expiration_time <= found.expires + EXPIRY_SLACK_S
            open_record(sealed, kind, run_id=self.run_id, subkey=subkey, expiration=record.expiration_time)
            return True
        except (ProtocolError, SpecError, ValueError, TypeError) as e:
            logger.debug("refused a DHT value under a %s key of run %s: %s", kind.__name__, self.run_id, e)
            return False
        except Exception as e:  # msgpack's own errors on junk bytes
            logger.debug("refused a malformed DHT value of run %s: %r", self.run_id, e)
            return False


class TicketValidator(RecordValidatorBase):
    """For a run whose ``[admission] policy`` is not ``open``: a record under the run's keys counts only if its
    signer carries a ticket the run key (or its delegate) signed, naming it, valid when the record was dated
    (:func:`swarm.protocol.check_carried`), and so does every endorsement a manifest embeds. The spec, the ban
    list, tickets, invites, delegations and the recognition are the run key's own (:class:`RunRecordValidator`
    checks their signer; a ticket's may be a delegate the run key named).
    Added to a DHT node once it read the spec (``hivemind.DHT.add_validators``); picklable."""

    EXEMPT = (SpecRecord, BanList, Ticket, Invite, Recognition, Delegation)

    def __init__(self, run_id: str, max_stages: int = MAX_STAGES):
        self.run_id, self.max_stages = run_id, max_stages
        self._kinds = {DHTID.generate(source=key).to_bytes(): kind for key, kind in run_keys(run_id, max_stages).items()
                       if kind not in self.EXEMPT}

    def __getstate__(self) -> dict:
        # sent through the DHT process's pipe (add_validators): hivemind 1.1.12 fails to read a message of the
        # size of the key table (BlockingIOError in the DHT process, which then dies), so the table is rebuilt there
        return {"run_id": self.run_id, "max_stages": self.max_stages}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["run_id"], state["max_stages"])

    def validate(self, record: DHTRecord) -> bool:
        kind = self._kinds.get(record.key)
        if kind is None or record.subkey in DHTProtocol.RESERVED_SUBKEYS:
            return True  # not a ticketed key; a plain value is RunRecordValidator's to refuse
        try:
            sealed = MSGPackSerializer.loads(record.value)
            rec, _ = open_record(sealed, kind, run_id=self.run_id)
            check_carried(sealed, self.run_id, rec.time)
            for endorsement in getattr(rec, "endorsements", ()):
                check_carried(endorsement, self.run_id, open_record(endorsement, Endorsement, run_id=self.run_id)[0].time)
            return True
        except (ProtocolError, ValueError, TypeError) as e:
            logger.debug("refused a DHT value of run %s without a valid ticket: %s", self.run_id, e)
            return False
        except Exception as e:  # msgpack's own errors on junk bytes
            logger.debug("refused a malformed DHT value of run %s: %r", self.run_id, e)
            return False
