"""swarm: volunteer swarm training of one language model over a hivemind DHT (SWARM parallelism).

The library behind the ``swarm-peer`` and ``swarm-coordinator`` apps. Public surface:
"""

__version__ = "0.1.0"

from swarm.config import PROTOCOL_VERSION, PeerSettings, RunSpec, SpecError  # noqa: E402
from swarm.identity import Identity  # noqa: E402

__all__ = ["__version__", "PROTOCOL_VERSION", "PeerSettings", "RunSpec", "SpecError", "Identity"]
