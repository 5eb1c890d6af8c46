"""The peer app: ``swarm-peer`` (join a run as a stage server or a trainer)."""
