"""Who to believe, and on what evidence: the checks that let strangers train together when some of them lie.

No peer acts on another's word: each acts on signatures, digests and its own recomputation. The map:

* :mod:`swarm.trust.receipts` — a stage server signs every reply (:class:`~swarm.protocol.StageReceipt`: the
  digests of the request and reply tensors, the epoch of its parameters, the loss).
* :mod:`swarm.trust.spotcheck` — a trainer re-runs a sample of its calls on other servers of the stage
  (:class:`~swarm.trust.spotcheck.SpotChecker`, the listener the trainer gives its pipeline); the odd one out is
  convicted.
* :mod:`swarm.trust.evidence` — spot-check evidence: three signed answers that prove a server lied, checked by
  anyone without parameters (:func:`~swarm.trust.evidence.verify_evidence`), and its wire form.
* :mod:`swarm.trust.convictions` — convictions shared: evidence handed to servers, verified, listed in their
  records, fetched and verified by the peers that follow them.
* :mod:`swarm.trust.banlist` — the run coordinator's signed ban list, one object every part of a peer follows.
* :mod:`swarm.trust.statecheck` — a state downloaded from a live server is kept only if the stage's other
  servers vouch for it.
* :mod:`swarm.trust.authority` — who may commit a stage's checkpoint (a second peer's endorsement) and who may
  hand this peer fragments.
* :mod:`swarm.trust.standing` — the work a peer verified each key doing (checks passed, decaying): the weight of
  that key's word where a count of keys would let a Sybil decide.
* :mod:`swarm.trust.tickets` — admission in a run that takes only the peers its operator admitted: tickets signed
  by the run key, carried in every record a peer seals.
* :mod:`swarm.trust.invites` — admission by invite: a code whose hash the run key published, redeemed at the
  coordinator for the presenting peer's own ticket, up to its uses.

Checks of averaging itself (commitments, reduction receipts, audits, accusations, exclusions) live with the
all-reduce they check, in :mod:`swarm.averaging`. Who may lie about what, and what stops it:
``docs/threat-model.md``.
"""
