"""``python -m domino.cli.torchrun ARGS``: torchrun, with the ranks of ``-m domino`` forked from a warm agent.

A restart (a preemption's new pod, torchrun's own worker restart) pays for two interpreters: torchrun's agent
imports torch, then each rank imports torch, DeepSpeed and domino again before its first step, about 2.5 s of
the 5 s a preemption costs on a quiet CPU machine (``benchmarks/RESULTS.md``, the timeline of one preemption).
Here the agent imports them once, then runs torchrun unchanged (``torch.distributed.run``'s own parser,
rendezvous, monitoring and restarts) with the ranks as a function entry point and ``--start-method fork``, which
torchrun supports for function entry points (torch 2.13 ``distributed/run.py`` ``config_from_args`` and
``--run-path``; ``elastic/multiprocessing/api.py`` ``MultiprocessContext``): each rank is a fork of the warm agent
with torchrun's environment for its rank, and runs the same ``domino`` command line.

Only a ``-m domino`` program is forked, and only while nothing initialised CUDA in the agent (a forked child
cannot use a CUDA context its parent created): torch is told to check for CUDA through NVML
(``PYTORCH_NVML_BASED_CUDA_CHECK=1``, torch's documented setting for forked workers), and if CUDA was
initialised anyway the ranks start as torchrun starts them, with one line saying why. Anything else goes to plain
torchrun. With ``DOMINO_WARM_RANKS=1`` in the container's environment the signal relay
(:mod:`domino.launch.signal_relay`) starts torchrun this way for ``-m domino`` commands. Opt-in for now: on a
2-core CPU machine with one rank per pod it saved 0-15 % of a preemption (the ranks' imports, less a slower
exit of the larger agent and a slower first checkpoint read in the forked rank; benchmarks/RESULTS.md), the
saving grows with the ranks per node, and the fork has not run on a GPU node.

A rank leaves as ``domino`` does: a failure with its status and without interpreter finalization
(:func:`domino.cli.main.leave_process`); a success by returning, which torchrun's function entry points must
do (their return value is how the agent knows the rank finished), after which multiprocessing ends the child
with ``os._exit``, again without finalization.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import traceback
from typing import List, Optional, Sequence

logger = logging.getLogger(__name__)

#: What a rank imports before its first step, beyond torch and DeepSpeed (torch's optimizers import ``torch._dynamo``
#: when the first one is built; the checkpoints import torch's distributed checkpoint).
WARM_MODULES = ("torch._dynamo", "torch.distributed.checkpoint", "domino.cli.main", "domino.train.gpt_recipe",
                "domino.train.pretrain", "domino.train.inprocess")
#: The file torchrun's ``--run-path`` runs in each forked rank.
RANK_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchrun_rank.py")


def _warm_imports() -> Optional[str]:
    """Imports what every rank imports before its first step; returns why the ranks cannot be forked, or None."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    if not torch.cuda.is_available():  # NVML-based: no CUDA context is created by asking
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as domino.optim.deepspeed_runtime sets it before the import
    from domino.optim import deepspeed_runtime

    deepspeed_runtime.import_deepspeed()
    for module in WARM_MODULES:
        importlib.import_module(module)

    if torch.cuda.is_initialized():
        return "CUDA was initialised while importing: the ranks start as torchrun starts them"
    for stream in (sys.stdout, sys.stderr):  # a fork copies what is still buffered
        stream.flush()
    return None


def forks_domino(args) -> bool:
    """Whether torchrun's parsed ``args`` run ``-m domino``, the program this launcher forks."""
    return bool(args.module) and args.training_script == "domino" and not args.no_python and not args.run_path


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Parses torchrun's command line and runs it, forking the ranks of ``-m domino`` from this warm process."""
    from torch.distributed import run as torchrun

    args = torchrun.parse_args(list(sys.argv[1:] if argv is None else argv))
    if forks_domino(args):
        reason = _warm_imports()
        if reason is None:
            args.module, args.run_path, args.start_method = False, True, "fork"
            args.training_script = RANK_SCRIPT
        else:
            logger.warning("%s", reason)
    torchrun.run(args)


def rank_main(argv: List[str]) -> None:
    """One forked rank: ``domino ARGV``; returns on success (see the module docstring), else leaves with the
    command's status."""
    from domino.cli.main import leave_process, main as domino_main

    # A fork inherits the agent's handlers: torchrun's raise SignalException for SIGTERM, SIGINT, SIGHUP and SIGQUIT
    # (torch 2.13 elastic/multiprocessing/api.py ``PContext.start``, before the fork). A rank starts with the
    # handlers a fresh interpreter has, as an exec'd rank does; domino installs its own where it needs them.
    for name in ("SIGTERM", "SIGHUP", "SIGQUIT"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = ["domino", *argv]
    try:
        domino_main(argv)
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if code:
            leave_process(code)
        return
    except BaseException:  # noqa: BLE001  as Python reports an uncaught exception, then the status 1
        traceback.print_exc()
        leave_process(1)


if __name__ == "__main__":
    main()
