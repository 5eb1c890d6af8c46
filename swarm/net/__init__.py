"""How peers reach each other: tensors over libp2p streams, the run's records in its DHT, and the stage protocol.

* :mod:`swarm.net.transport` — requests and replies as streams of hivemind messages: chunking, size limits,
  deadlines, byte counters, the reply's end marker.
* :mod:`swarm.net.codecs` — wire codecs of float tensors (fp32, fp16, 8-bit and 2-4-bit blockwise, sparse).
* :mod:`swarm.net.stage_rpc` — the stage protocol as its callers see it: the RPCs, their limits, stubs, pings
  and state-digest questions.
* :mod:`swarm.net.directory` — publishing and reading the run's signed records (:class:`~swarm.net.directory.
  RunDirectory`, and its async face for a peer's event loop, :class:`~swarm.net.directory.AsyncRunDirectory`).
* :mod:`swarm.net.dht` — a run's address and joining its DHT (a node per peer, speaking as the peer's key).
* :mod:`swarm.net.dht_validation` — what the run's DHT nodes agree to store.
* :mod:`swarm.net.quota` — how many requests of one peer a handler serves at once, and how often.
"""
