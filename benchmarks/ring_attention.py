"""How much of context parallelism's ring communication is hidden under attention's compute, on real gloo ranks.

Runs ``domino.parallel.ring_attention.ring_attention`` forward + backward on CP ranks (processes of one thread each,
loopback gloo) at several sequence lengths, three ways, each on the same blocks:

* **overlapped**: as shipped: the next key/value block's (and the last step's gradient's) transfer in flight while
  the current block is computed;
* **synchronous**: every transfer waited at once after its launch (the ring without overlap);
* **compute only**: no transfer at all (each rank computes on its own block every step: the same kernels and
  shapes, wrong values, for timing only).

``exposed = overlapped - compute only`` is the communication the schedule leaves in the step, ``transfer =
synchronous - compute only`` what it would cost unhidden; ``hidden = 1 - exposed / transfer``. Beside them, the
other exchange, ``domino.parallel.all_to_all_attention`` (``--cp-comm-type a2a``: two all-to-alls each way and
one whole-sequence SDPA of ``1 / CP`` of the heads; on the same emulated link when there is one). Medians over
``--repeats`` timed calls after one warm-up. Also the unsplit causal SDPA forward + backward of the whole sequence
on one process, for scale (CP's ranks each do about ``1 / CP`` of its work).

``--link-ratio R`` puts every transfer on an emulated link as well (``domino.runtime.network_emulator``'s
``LinkEmulator``: one link per rank, each transfer done no earlier than its launch, or the link's previous
transfer's end, plus ``latency + bytes / B``, slept where the ring waits for it), with ``B`` chosen per sequence
length so that a step's modelled transfers take ``R`` times its measured compute-only time: the ring's design
point, where the link is slower than loopback gloo on 2 cores (whose transfers share the cores with compute and
cannot hide). On H100 with NVLink (989 TFLOP/s bf16, 450 GB/s) a key/value block of ``s`` local tokens costs
``(G / H) x 2 F / (3 B s)`` of its block's forward + backward: 0.18 at 4,096 local tokens, 0.09 at 8,192.

    python benchmarks/ring_attention.py [--cp 2] [--seq 2048 4096 8192] [--heads 8] [--groups 8] [--head-dim 64]
                                        [--repeats 5] [--link-ratio 0.5] [--json]

On a 2-core machine run it alone: figures taken beside other work are not figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from domino.parallel import ring_attention as R  # noqa: E402
from domino.parallel.all_to_all_attention import all_to_all_attention  # noqa: E402
from domino.parallel.context_split import local_token_indices  # noqa: E402
from domino.runtime.mesh import ParallelMesh  # noqa: E402
from domino.runtime.network_emulator import LinkEmulator, LinkSpec  # noqa: E402

_overlapped_shift = R._shift


def _synchronous_shift(tensor, cp, tag):
    received, requests = _overlapped_shift(tensor, cp, tag)
    for request in requests:  # wait: at once, nothing computed meanwhile
        request.wait()
    return received, []


def _no_shift(tensor, cp, tag):
    return tensor, []


class _OnTheLink:
    """A transfer's requests, done once gloo's are and the emulated link has carried its bytes."""

    def __init__(self, requests, link: LinkEmulator, due: float) -> None:
        self.requests, self.link, self.due = requests, link, due

    def wait(self) -> None:
        for request in self.requests:
            request.wait()
        self.link.wait_until(self.due)


def _emulated(shift, link: LinkEmulator, at_once: bool):
    """``shift`` (overlapped or synchronous) whose transfers also ride ``link``."""
    def emulated_shift(tensor, cp, tag):
        received, requests = _overlapped_shift(tensor, cp, tag)
        done = _OnTheLink(requests, link, link.launch(tensor.numel() * tensor.element_size()))
        if at_once:
            done.wait()  # wait: at once, nothing computed meanwhile
            return received, []
        return received, [done]
    return emulated_shift


def _step_wire_bytes(local) -> int:
    """Bytes one rank sends per forward + backward: CP - 1 key/value blocks each way, CP gradient blocks (fp32)."""
    _, k, v = local
    cp = dist.get_world_size()
    block = 2 * k.numel()
    return (cp - 1) * block * k.element_size() * 2 + cp * block * 4


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rank(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cp = ParallelMesh.build(1, context_parallel_size=world).cp
    rows = []
    for seq in args.seq:
        g = torch.Generator().manual_seed(seq)
        q = torch.randn(1, args.heads, seq, args.head_dim, generator=g)
        k, v = (torch.randn(1, args.groups, seq, args.head_dim, generator=g) for _ in range(2))
        index = local_token_indices(seq, cp)
        local = [t.index_select(2, index).requires_grad_(True) for t in (q, k, v)]

        def step():
            out = R.ring_attention(*local, cp)
            torch.autograd.grad(out, local, torch.ones_like(out))

        row = {"seq": seq}
        R._shift = _no_shift
        row["compute_only"] = _time(step, args.repeats)
        shifts = {"overlapped": _overlapped_shift, "synchronous": _synchronous_shift}
        if args.link_ratio:
            # The same link on every rank: the slowest rank's compute sets it (ranks agree on the max).
            slowest = torch.tensor([row["compute_only"]], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            gbps = _step_wire_bytes(local) / (args.link_ratio * float(slowest)) / 1e9
            link = LinkEmulator(LinkSpec(latency_us=20.0, gbps=gbps))
            shifts = {name: _emulated(_overlapped_shift, link, at_once=name == "synchronous") for name in shifts}
            row["link_gbps"] = gbps
        for name, shift in shifts.items():
            R._shift = shift
            row[name] = _time(step, args.repeats)
        R._shift = _overlapped_shift
        # The head exchange's all-to-alls ride the group's link (domino.runtime.comm_timing.launch): the same one.
        a2a_group = dataclasses.replace(cp, link=LinkEmulator(link.spec)) if args.link_ratio else cp

        def a2a_step():
            out = all_to_all_attention(*local, a2a_group)
            torch.autograd.grad(out, local, torch.ones_like(out))

        row["a2a"] = _time(a2a_step, args.repeats)
        rows.append(row)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _unsplit(args):
    torch.set_num_threads(1)
    out = {}
    for seq in args.seq:
        q = torch.randn(1, args.heads, seq, args.head_dim, requires_grad=True)
        k, v = (torch.randn(1, args.groups, seq, args.head_dim, requires_grad=True) for _ in range(2))

        def step():
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=args.groups != args.heads)
            torch.autograd.grad(o, (q, k, v), torch.ones_like(o))

        step()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        out[seq] = statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--link-ratio", type=float, default=0.0,
                        help="also put the transfers on an emulated link this many times a step's compute (0: off)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with socket.socket() as probe:  # a free loopback port for the ranks' rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.spawn(_rank, args=(args.cp, port, args, out), nprocs=args.cp)
        rows = json.loads(Path(out).read_text())
    unsplit = _unsplit(args)
    for row in rows:
        row["unsplit_one_process"] = unsplit[row["seq"]]
        transfer = row["synchronous"] - row["compute_only"]
        row["exposed"] = row["overlapped"] - row["compute_only"]
        row["hidden"] = 1 - row["exposed"] / transfer if transfer > 0 else None
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    link = f", emulated link at {args.link_ratio} x compute" if args.link_ratio else ""
    print(f"CP {args.cp}, heads {args.heads}, key/value groups {args.groups}, head dim {args.head_dim}, fp32, "
          f"forward + backward, median of {args.repeats} (ms){link}")
    print("| tokens | overlapped | synchronous | compute only | exposed | hidden | a2a | unsplit, 1 process |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        hidden = f"{100 * r['hidden']:.0f}%" if r["hidden"] is not None else "n/a"
        print(f"| {r['seq']} | {1e3 * r['overlapped']:.1f} | {1e3 * r['synchronous']:.1f} | "
              f"{1e3 * r['compute_only']:.1f} | {1e3 * r['exposed']:.1f} | {hidden} | {1e3 * r['a2a']:.1f} | "
              f"{1e3 * r['unsplit_one_process']:.1f} |")


if __name__ == "__main__":
    main()
