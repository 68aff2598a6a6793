"""The program torchrun's ``--run-path`` runs in each rank that :mod:`domino.cli.torchrun` forks: the ``domino``
command line of ``sys.argv``."""

import sys

from domino.cli.torchrun import rank_main

rank_main(sys.argv[1:])
