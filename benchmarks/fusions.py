"""Same-run CPU A/B of the fusions against their references: the chunked loss, the norms and GeLU.

* **Loss** (output layer + cross entropy, forward and backward, fp32, TP=1, ``[tokens, h] x [V, h]``, at two
  widths ``h``: at 128 the passes over the logits cost about what the GEMMs cost, at 1024 the GEMMs dominate): the plain
  path (a linear, then the vocab-parallel loss: ``DOMINO_KERNELS=plain``), the CPU choice's one-buffer fused loss,
  the chunked loss as committed at ``--before`` (a pass per step of the formula) and the chunked loss of this tree
  (one pass per chunk each way; :mod:`domino.parallel.chunked_cross_entropy`), both in chunks of ``--chunk-mib``
  of fp32 logits. Time: the median over rounds of each way's time over the plain path's, the ways run back to
  back in each round (the machine is shared: the ratio of neighbours cancels slow load drift). Peak memory: each
  way once more in a fresh process, its peak resident memory (``VmHWM``) above what it held once the inputs
  existed.
* **Norms and GeLU** (forward and backward, fp32, ``[tokens, h]``; GeLU on ``[tokens, 4h]``): torch's op (the CPU
  and CUDA choices; :mod:`domino.parallel.norms`) over the textbook formula (the plain choice), same rounds.

CPU only: nothing here says what the fusions do on a GPU. Usage::

    python benchmarks/fusions.py [--tokens 2048] [--loss-hidden 128 1024] [--hidden 1024] [--vocab 32768] \
        [--chunk-mib 32] [--rounds 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types

import torch
import torch.nn.functional as F

from domino.parallel import norms
from domino.parallel.chunked_cross_entropy import chunked_linear_cross_entropy
from domino.parallel.cross_entropy import (LogitsBuffer, vocab_parallel_cross_entropy,
                                           vocab_parallel_linear_cross_entropy)
from domino.parallel.kernels import CPU_KERNELS, PLAIN_KERNELS

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEFORE = "74e1b42"  # the last commit with the multi-pass chunked loss
LOSSES = ("plain", "one buffer", "chunked, before", "chunked, one pass")


def _before_chunked(commit: str):
    """``chunked_linear_cross_entropy`` as committed at ``commit`` (its module's source, from git)."""
    source = subprocess.run(["git", "-C", HERE, "show", f"{commit}:domino/parallel/chunked_cross_entropy.py"],
                            check=True, capture_output=True, text=True).stdout
    module = types.ModuleType("chunked_before")
    exec(compile(source, f"{commit}:chunked_cross_entropy.py", "exec"), module.__dict__)
    return module.chunked_linear_cross_entropy


def _loss_ways(args):
    rows = max(1, args.chunk_mib * 2**20 // (4 * args.vocab))
    before = _before_chunked(args.before)

    buffer = LogitsBuffer()  # kept across calls, as the model keeps its own

    def plain(h, w, t):
        return vocab_parallel_cross_entropy(F.linear(h, w), t, kernels=PLAIN_KERNELS)

    def one_buffer(h, w, t):
        return vocab_parallel_linear_cross_entropy(h, w, t, kernels=CPU_KERNELS, buffer=buffer)

    return dict(zip(LOSSES, (plain, one_buffer, lambda h, w, t: before(h, w, t, rows),
                             lambda h, w, t: chunked_linear_cross_entropy(h, w, t, rows)))), rows


def _loss_inputs(args):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=g).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * args.hidden ** -0.5).requires_grad_()
    return hidden, weight, torch.randint(0, args.vocab, (args.tokens,), generator=g)


def _timed(fn, *inputs) -> float:
    start = time.perf_counter()
    out = fn(*inputs)
    out.sum().backward()
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.grad is not None:
            x.grad = None
    return time.perf_counter() - start


def _rounds(ways: dict, inputs, rounds: int, reference: str):
    """``{way: (median seconds, median ratio to the reference)}``; one warm-up round first."""
    for fn in ways.values():
        _timed(fn, *inputs)
    times = {name: [] for name in ways}
    for _ in range(rounds):
        for name, fn in ways.items():
            times[name].append(_timed(fn, *inputs))
    return {name: (statistics.median(ts), statistics.median(t / r for t, r in zip(ts, times[reference])))
            for name, ts in times.items()}


def _peak_of(args, way: str) -> float:
    """MiB of peak resident memory ``way``'s loss adds, in a fresh process."""
    argv = [sys.executable, os.path.abspath(__file__), "--memory-of", way] + [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("memory_of", "loss_hidden")]
    out = subprocess.run(argv, check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": HERE})
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]


def _status_kib(field: str) -> int:
    """``field`` (``VmRSS``, ``VmHWM``) of ``/proc/self/status``, in KiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _memory_of(args) -> None:
    """Prints the MiB ``args.memory_of``'s loss adds at its peak to what this process held with its inputs.

    The peak is the kernel's high-water mark of this process's resident memory (``VmHWM``), reset once the inputs
    exist (``clear_refs`` 5, Linux >= 4.0); not ``ru_maxrss``, which a child inherits from its parent."""
    ways, _ = _loss_ways(args)
    inputs = _loss_inputs(args)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    _timed(ways[args.memory_of], *inputs)
    print(json.dumps(dict(peak_mib=(_status_kib("VmHWM") - before) / 1024)))


def _norm_ways(args):
    h = args.hidden
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.tokens, h, generator=g).requires_grad_()
    inner = torch.randn(args.tokens, 4 * h, generator=g).requires_grad_()
    w, b = torch.rand(h, generator=g).add_(0.5).requires_grad_(), torch.zeros(h).requires_grad_()
    return {
        "LayerNorm": ({"textbook": lambda x: norms.textbook_layer_norm(x, w, b, 1e-5),
                       "torch": lambda x: F.layer_norm(x, (h,), w, b, 1e-5)}, x),
        "RMSNorm": ({"textbook": lambda x: norms.textbook_rms_norm(x, w, 1e-5),
                     "torch": lambda x: F.rms_norm(x, (h,), w, 1e-5)}, x),
        "GeLU (erf)": ({"textbook": norms.textbook_gelu, "torch": F.gelu}, inner),
        "GeLU (tanh)": ({"textbook": lambda x: norms.textbook_gelu(x, "tanh"),
                         "torch": lambda x: F.gelu(x, approximate="tanh")}, inner),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=1024, help="the norms' width")
    parser.add_argument("--loss-hidden", type=int, nargs="+", default=[128, 1024],
                        help="the output layer's input widths: at 128 the passes over the logits weigh as much as "
                             "the GEMMs, at 1024 the GEMMs dominate")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--chunk-mib", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--before", default=BEFORE)
    parser.add_argument("--memory-of", choices=LOSSES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_of:
        return _memory_of(args)
    print(f"load average {os.getloadavg()[0]:.2f} (shared machine), {args.threads} threads, torch {torch.__version__}")
    ways, rows = _loss_ways(args)
    logits_mib = args.tokens * args.vocab * 4 / 2**20
    print(f"\nloss: {args.tokens} tokens x vocab {args.vocab}, fp32 ({logits_mib:.0f} MiB of logits); chunks of "
          f"{rows} rows\n")
    print("| hidden | way | forward + backward (s) | time / plain | peak memory (MiB) |")
    print("|---|---|---|---|---|")
    for hidden in args.loss_hidden:
        shape = argparse.Namespace(**{**vars(args), "hidden": hidden})
        timings = _rounds(ways, _loss_inputs(shape), args.rounds, "plain")
        for name, (seconds, ratio) in timings.items():
            print(f"| {hidden} | {name} | {seconds:.3f} | {ratio:.2f}x | {_peak_of(shape, name):.0f} |", flush=True)
    print(f"\nnorms and GeLU: [{args.tokens}, {args.hidden}] (GeLU [{args.tokens}, {4 * args.hidden}]), fp32\n")
    print("| op | textbook (ms) | torch's op (ms) | torch / textbook |")
    print("|---|---|---|---|")
    for op, (pair, x) in _norm_ways(args).items():
        result = _rounds(pair, (x,), args.rounds, "textbook")
        print(f"| {op} | {result['textbook'][0] * 1e3:.1f} | {result['torch'][0] * 1e3:.1f} | "
              f"{result['torch'][1]:.2f}x |", flush=True)
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
