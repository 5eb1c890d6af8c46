"""A peer that attacks the run, for tests only::

    python -m tests.byzantine_peer <attack> <run address> [--role server|trainer] [--stage K] [--share S]
                                   [--concurrency N]

It is ``swarm-peer join`` with the attack installed from outside: the app's own ``run_server`` /
``run_trainer`` run unchanged, given the stage optimizer, stage server or trainer's pipeline that
:mod:`swarm.attacks` builds (server attacks corrupt what the server averages, ``lying_server`` what it answers
trainers, trainer attacks the micro-batches it streams).
Nothing in the library or the app knows about attacks. Settings come from ``SWARM_*`` as for any peer.
"""

from __future__ import annotations

import argparse

from peer.server import run_server
from peer.trainer import run_trainer
from swarm.attacks import ATTACKS, SERVER_LIES, TRAINER_ATTACKS, byzantine_optimizer, byzantine_pipeline, lying_server
from swarm.settings import PeerSettings
from swarm.host import keep_freed_memory, share_tensors_by_descriptor
from swarm.logs import configure_logging
from swarm.trainer.session import TrainerOptions


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.byzantine_peer", description=__doc__.splitlines()[0])
    parser.add_argument("attack", choices=ATTACKS + SERVER_LIES)
    parser.add_argument("address")
    parser.add_argument("--role", choices=("server", "trainer"), default="server")
    parser.add_argument("--stage", type=int)
    parser.add_argument("--share", type=int)
    parser.add_argument("--concurrency", type=int, default=2)
    args = parser.parse_args()
    if (args.role == "trainer") != (args.attack in TRAINER_ATTACKS):
        parser.error(f"{args.attack!r} is not a {args.role} attack")
    configure_logging("INFO")
    keep_freed_memory()
    share_tensors_by_descriptor()
    settings = PeerSettings()
    if args.attack in SERVER_LIES:  # answers half of its training calls wrongly (caught by spot checks)
        run_server(args.address, settings, args.stage, server_factory=lying_server(0.5, seed=args.stage or 0))
    elif args.role == "server":
        run_server(args.address, settings, args.stage, optimizer_factory=byzantine_optimizer(args.attack))
    else:
        run_trainer(args.address, settings, TrainerOptions(share=args.share, concurrency=args.concurrency),
                    pipeline_factory=byzantine_pipeline(args.attack))


if __name__ == "__main__":
    main()
