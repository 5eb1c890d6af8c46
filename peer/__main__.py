"""Run a peer: ``python -m peer join <run address> [--role trainer]`` (same as ``swarm-peer``)."""

from peer.cli import main

main()
