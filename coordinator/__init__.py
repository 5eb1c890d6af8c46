"""The coordinator app: ``swarm-coordinator`` (init, serve, status, demo)."""
