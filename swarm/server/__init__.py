"""A stage server: a peer that hosts one pipeline stage, serves trainers' forward and backward calls and averages
with the other servers of its stage.

* :mod:`swarm.server.session` — :class:`~swarm.server.session.ServerSession`, the process's life: join, pick a
  stage, announce, follow bans and convictions, rebalance, pause, drain.
* :mod:`swarm.server.served` — :class:`~swarm.server.served.ServedStage`, one stage as the server serves it,
  built whole (module, RPC server, optimizer, checkpoint duties) and thrown away on a move or pause.
* :mod:`swarm.server.stage` — :class:`~swarm.server.stage.StageServer`, the stage RPCs and their receipts.
* :mod:`swarm.server.compute` — the compute thread behind them: forward, backward, gradients to the optimizer,
  epoch transitions.
* :mod:`swarm.server.rebalance` — which stage to join, and when to move to another.
"""
