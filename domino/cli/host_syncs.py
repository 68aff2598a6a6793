"""``python -m domino.cli.host_syncs OUT <domino arguments>``: any ``domino`` verb under the host-read probe of
:mod:`domino.train.host_syncs` (alone or under torchrun; each rank writes ``OUT.rank<R>.json``)."""

from __future__ import annotations

import sys
from typing import List, Optional

from domino.cli.main import _ran_torch_distributed, leave_process
from domino.cli.main import main as domino_main
from domino.train.host_syncs import run_probed


def main(argv: Optional[List[str]] = None) -> int:
    """Runs the CLI with ``argv[1:]`` under the probe, writing ``argv[0].rank<R>.json``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2:
        print("usage: python -m domino.cli.host_syncs OUT <domino arguments, e.g. pretrain --preset tiny>",
              file=sys.stderr)
        return 2
    return run_probed(argv[0], domino_main, argv[1:])


if __name__ == "__main__":
    status = main()
    if _ran_torch_distributed():
        # As `domino` itself: no interpreter finalization after torch.distributed ran (gloo's worker threads can
        # abort a finished run then, pytorch/pytorch#190489; cli/main.py leave_process says why). The probe's
        # files are written before main() returns.
        leave_process(status)
    sys.exit(status)
