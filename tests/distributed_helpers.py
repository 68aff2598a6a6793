"""Runs a function on N real ``torch.distributed`` (gloo) processes and collects what each returns.

Usage in a test::

    def _body(rank, world_size, some_arg):   # module-level, so it can be pickled by spawn
        ...                                    # torch.distributed is initialised here
        return {"loss": 1.0}                   # anything picklable

    results = run_distributed(_body, 2, some_arg)   # list indexed by rank

The ranks are forked from a ``multiprocessing`` fork server that has imported torch once (``spawn`` would import
it again in every rank: 2-3 s each on the CI machine). A forked rank starts with the caller's working directory,
``sys.path`` and ``sys.argv`` (``multiprocessing/spawn.py`` ``get_preparation_data``, applied in the child by
``prepare``) but the fork server's environment, so :func:`run_distributed` hands the caller's ``os.environ``
over as well: the rank sees what a spawned one would.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import tempfile
import traceback
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """An unused TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported once by the fork server, before any rank is forked; nothing in them starts threads or a process group.
PRELOAD = ["torch", "torch.distributed", "torch.multiprocessing", "domino.runtime.state"]
multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple,
            environ: Dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # report the failure to the parent instead of hanging the other ranks
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        raise
    finally:
        from domino.runtime import state

        state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any) -> List[Any]:
    """Spawns ``world_size`` gloo ranks running ``fn(rank, world_size, *args)``; returns results by rank.

    Raises:
        AssertionError: with the failing rank's traceback when any rank raised.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(_worker, args=(world_size, free_port(), out_dir, fn, args, dict(os.environ)),
                               nprocs=world_size, join=True, start_method="forkserver")
        except mp.ProcessRaisedException:
            pass  # the per-rank file below holds the readable traceback
        results = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            assert os.path.exists(path), f"rank {rank} died without a result"
            record = torch.load(path, weights_only=False)
            assert record["ok"], f"rank {rank} failed:\n{record['error']}"
            results.append(record["result"])
        return results
