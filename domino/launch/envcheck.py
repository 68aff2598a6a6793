"""``python -m domino.launch.envcheck --out DIR``: checks a multi-node launch end to end.

Run as the job's command (directly, or under torchrun), each process records the launch environment
it saw, initialises ``torch.distributed`` from it (``env://``: RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), all-reduces ``rank + 1`` over gloo and writes ``DIR/envcheck-rank<RANK>.json``. A correct
launch gives every rank the sum ``world_size * (world_size + 1) / 2``. With ``--storage`` rank 0 also writes
``DIR/storage-probe.json`` and the last rank (on the last node: torchrun numbers ranks node by node) reads it
and answers in ``DIR/storage-reply.json``, so rank 0 prints one ``storage:`` line naming both hosts, both
processes' UIDs and the files' owners: the claim written on one node is read on another. Useful on a real cluster as
a smoke job (``--command 'torchrun -m domino.launch.envcheck --out /mnt/domino/envcheck'``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from typing import List, Optional

from domino.atomic_files import atomic_write

#: Variables the training operator injects, and the ones torchrun adds for its workers.
RECORDED = (
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE",
    "PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT",
    "PYTHONUNBUFFERED", "DOMINO_JOB_NAME", "TORCHELASTIC_RUN_ID",
)


def main(argv: Optional[List[str]] = None) -> int:
    """Records the env, all-reduces across the job, writes the report; returns 0 when the sum is right."""
    parser = argparse.ArgumentParser(prog="python -m domino.launch.envcheck", description=__doc__, allow_abbrev=False)
    parser.add_argument("--out", required=True, help="Directory for envcheck-rank<RANK>.json.")
    parser.add_argument("--extra-env", nargs="*", default=[], help="More variable names to record.")
    parser.add_argument("--storage", action="store_true", help="Also write a file on rank 0, read it on the last "
                        "rank and print who wrote and read it (the claim shared across nodes).")
    args = parser.parse_args(argv)
    seen = {k: os.environ[k] for k in (*RECORDED, *args.extra_env) if k in os.environ}
    print(f"envcheck on {socket.gethostname()}: " + " ".join(f"{k}={v}" for k, v in sorted(seen.items())),
          flush=True)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    expected = world * (world + 1) / 2
    dist.barrier()
    os.makedirs(args.out, exist_ok=True)
    if args.storage:
        _storage(args.out, rank, world, dist.barrier)
    dist.destroy_process_group()
    with atomic_write(os.path.join(args.out, f"envcheck-rank{rank}.json"), "w") as handle:
        json.dump({"rank": rank, "world_size": world, "all_reduce": value.item(), "expected": expected,
                   "env": seen}, handle, indent=2, sort_keys=True)
    print(f"envcheck rank {rank}/{world}: all_reduce={value.item():g} expected={expected:g}", flush=True)
    return 0 if value.item() == expected else 1


def _storage(out: str, rank: int, world: int, barrier) -> None:
    """Rank 0 writes the probe, the last rank reads it and answers, rank 0 reads the answer and prints it."""
    probe, reply = os.path.join(out, "storage-probe.json"), os.path.join(out, "storage-reply.json")
    if rank == 0:
        with atomic_write(probe, "w") as handle:
            json.dump({"host": socket.gethostname(), "uid": os.getuid()}, handle)
    barrier()  # the probe is on the claim before the last rank looks
    if rank == world - 1:
        with open(probe) as handle:
            wrote = json.load(handle)
        with atomic_write(reply, "w") as handle:
            json.dump({"wrote": wrote, "probe_owner": os.stat(probe).st_uid, "host": socket.gethostname(),
                       "uid": os.getuid()}, handle)
    barrier()  # the answer is on the claim before rank 0 reads it
    if rank == 0:
        with open(reply) as handle:
            read = json.load(handle)
        print(f"storage: written on {read['wrote']['host']} as uid {read['wrote']['uid']} (file owner "
              f"{read['probe_owner']}), read on {read['host']} as uid {read['uid']} (answer's owner "
              f"{os.stat(reply).st_uid})", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
