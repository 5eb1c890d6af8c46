"""A trainer: a peer that streams micro-batches of its data share through one server per stage.

* :mod:`swarm.trainer.session` — :class:`~swarm.trainer.session.Trainer`, the process's life: join, claim a data
  share, train, report progress, validate.
* :mod:`swarm.trainer.pipeline` — :class:`~swarm.trainer.pipeline.RemotePipeline`, a micro-batch through the
  stages with retries, and the listener it tells of its calls (the trainer's spot checks).
* :mod:`swarm.trainer.routing` — stochastic wiring and back-off: which server of a stage gets a micro-batch.
* :mod:`swarm.trainer.inflight` — how many micro-batches to keep in flight: the pipeline's measured
  bandwidth-delay product.
"""
