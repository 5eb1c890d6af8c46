"""``python -m coordinator`` is ``swarm-coordinator``."""

from coordinator.cli import main

main()
