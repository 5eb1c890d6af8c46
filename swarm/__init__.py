"""swarm: volunteer swarm training of one language model over a hivemind DHT (SWARM parallelism).

The library behind the ``swarm-peer`` and ``swarm-coordinator`` apps. Public surface: the run's spec and a
peer's settings, its identity, and the two roles, each startable in-process::

    await ServerSession(address, PeerSettings(), stage=0).run()     # a stage server
    await Trainer(address, PeerSettings(), TrainerOptions()).run()  # a trainer

(``ServerSession``, ``Trainer`` and ``TrainerOptions`` are imported on first use: they pull in torch and hivemind.)
"""

__version__ = "0.1.0"

from swarm.config import PROTOCOL_VERSION, RunSpec, SpecError  # noqa: E402
from swarm.settings import PeerSettings  # noqa: E402
from swarm.identity import Identity  # noqa: E402

_LAZY = {"ServerSession": "swarm.server.session", "Trainer": "swarm.trainer.session",
         "TrainerOptions": "swarm.trainer.session"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'swarm' has no attribute {name!r}")


__all__ = ["__version__", "PROTOCOL_VERSION", "PeerSettings", "RunSpec", "SpecError", "Identity", "ServerSession",
           "Trainer", "TrainerOptions"]
