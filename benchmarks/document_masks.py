"""Peak memory of one layer's per-document attention: the dense ``[b, 1, s, s]`` mask against the document starts.

One attention layer's forward and backward (fp32, micro-batch 1, 8 heads of 64, hidden 512) over packed documents
of random lengths (mean ``--mean-document`` tokens), at each sequence length, two ways:

* ``dense``: Megatron's mask built from the starts (``domino.data.batch.dense_document_mask``) and the
  ``DOMINO_KERNELS=plain`` path (SDPA under the mask), as ``--reset-attention-mask`` ran before issue 54;
* ``segmented``: the batch's ``[b, s]`` document starts and the CPU choice (each document through causal SDPA,
  :mod:`domino.parallel.document_attention`).

Each (way, length) runs in a fresh process, which reports its peak resident memory (``ru_maxrss``) above the
resident memory it had once the inputs existed: what the attention and its mask add. The ratio is dense over
segmented in the same run. CPU only.

Usage::

    flock /work/bench.lock python benchmarks/document_masks.py [--lengths 4096 8192 16384] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

HEADS, HEAD_DIM = 8, 64


def _resident_kib() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _starts(s: int, mean: int, seed: int = 0) -> torch.Tensor:
    """``[1, s]`` document starts of documents with exponential lengths of mean ``mean``."""
    from domino.data.batch import get_ltor_masks_and_position_ids

    g = torch.Generator().manual_seed(seed)
    tokens = 1 + torch.randint(0, 100, (1, s), generator=g)
    tokens[torch.rand(1, s, generator=g) < 1.0 / mean] = 0
    return get_ltor_masks_and_position_ids(tokens, 0, False, True, False)[0]


def one(way: str, s: int, mean: int, threads: int) -> dict:
    """Runs one way at one length in this process; its peak memory above the inputs, its time and documents."""
    from domino.data.batch import dense_document_mask
    from domino.parallel.document_attention import document_attention, document_lengths
    from domino.parallel.kernels import CPU_KERNELS, PLAIN_KERNELS

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, HEADS, s, HEAD_DIM, generator=g).requires_grad_(True) for _ in range(3))
    dout = torch.randn(1, HEADS, s, HEAD_DIM, generator=g)
    starts = _starts(s, mean)
    documents = len(document_lengths(starts[0]))
    before = _resident_kib()
    start = time.perf_counter()
    if way == "dense":  # the batch's dense mask, then the plain path under it
        mask = ~dense_document_mask(starts)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    else:
        out = document_attention(q, k, v, starts, kernels=CPU_KERNELS if way == "segmented" else PLAIN_KERNELS)
    out.backward(dout)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return dict(way=way, s=s, documents=documents, peak_mib=(peak - before) / 1024, seconds=seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--mean-document", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--one", nargs=2, metavar=("WAY", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), args.mean_document, args.threads)))
        return
    print("| tokens | documents | dense peak (MiB) | segmented peak (MiB) | dense / segmented | dense s | "
          "segmented s |\n|---|---|---|---|---|---|---|")
    for s in args.lengths:
        runs = {}
        for way in ("dense", "segmented"):
            out = subprocess.run([sys.executable, __file__, "--one", way, str(s), "--mean-document",
                                  str(args.mean_document), "--threads", str(args.threads)],
                                 check=True, capture_output=True, text=True)
            runs[way] = json.loads(out.stdout.splitlines()[-1])
        d, g = runs["dense"], runs["segmented"]
        print(f"| {s} | {d['documents']} | {d['peak_mib']:.0f} | {g['peak_mib']:.0f} | "
              f"{d['peak_mib'] / max(g['peak_mib'], 1e-9):.1f}x | {d['seconds']:.2f} | {g['seconds']:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
