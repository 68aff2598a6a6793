"""GPTDataset index build time at scale, and the memory of a process reading a 1 GB dataset.

1. ``index``: document, sample and shuffle indices for ``--tokens`` tokens (default 100M) of synthetic
   documents (log-normal lengths, mean about 700 tokens) at ``--seq-length`` 1024, for one epoch and for
   three. Reference measured in the same run: Megatron's ``build_sample_idx`` loop from ``helpers.cpp``,
   transcribed to C and compiled with the system ``cc -O3`` (loaded through ctypes), on the same
   document index; the ``ratio`` column is our vectorised numpy sample-index time over the C loop's.
   Both results are compared element by element.
2. ``reader``: a fresh process memory-maps a ``--reader-gb`` GB ``.bin`` (default 1) through
   ``IndexedDataset`` and reads every token, once with ``get_document`` in a loop (random-access use,
   as training does) and once with ``iter_documents`` (which drops the pages it has read every 64 MB).
   Reported: peak RSS (``VmHWM``), which counts the file's pages while they are mapped and resident
   (page cache the kernel can reclaim, shared by all readers), the peak of the process's private
   (anonymous) memory ``RssAnon`` sampled while reading, and the file pages still mapped at the end.

Usage::

    python benchmarks/data_index.py [--tokens 100000000] [--seq-length 1024] [--reader-gb 1] [--json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from domino.data.indexed_dataset import IndexedDatasetWriter  # noqa: E402
from domino.data.sample_index import (build_document_index, build_indices, build_sample_index,  # noqa: E402
                                      num_epochs)

MEGATRON_LOOP_C = r"""
#include <stdint.h>
/* Megatron-LM helpers.cpp build_sample_idx, same loop, plain C. */
void build_sample_idx(const int32_t* sizes, const int32_t* doc_idx, int32_t seq_length, int64_t num_samples,
                      int32_t* sample_idx) {
  int64_t sample_index = 0, doc_idx_index = 0;
  int32_t doc_offset = 0;
  sample_idx[0] = 0; sample_idx[1] = 0; ++sample_index;
  while (sample_index <= num_samples) {
    int32_t remaining_seq_length = seq_length + 1;
    while (remaining_seq_length != 0) {
      int32_t doc_id = doc_idx[doc_idx_index];
      int32_t doc_length = sizes[doc_id] - doc_offset;
      remaining_seq_length -= doc_length;
      if (remaining_seq_length <= 0) { doc_offset += (remaining_seq_length + doc_length - 1); remaining_seq_length = 0; }
      else { ++doc_idx_index; doc_offset = 0; }
    }
    sample_idx[2 * sample_index] = (int32_t)doc_idx_index;
    sample_idx[2 * sample_index + 1] = doc_offset;
    ++sample_index;
  }
}
"""

READER = r"""
import sys, time
from domino.data.indexed_dataset import IndexedDataset

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0

ds = IndexedDataset(sys.argv[1])
start = time.perf_counter()
total, anon_peak = 0, status("RssAnon")
documents = ds.iter_documents() if sys.argv[2] == "iter_documents" else (
    ds.get_document(d) for d in range(ds.num_documents))
for d, tokens in enumerate(documents):
    total += int(tokens.sum(dtype="int64"))  # touches every token
    if d % 2000 == 0:
        anon_peak = max(anon_peak, status("RssAnon"))
seconds = time.perf_counter() - start
anon_peak = max(anon_peak, status("RssAnon"))
print({"documents": ds.num_documents, "tokens": int(ds.num_tokens), "seconds": seconds, "vm_hwm": status("VmHWM"),
       "rss_anon_peak": anon_peak, "rss_file_end": status("RssFile")})
"""


def compile_reference(directory: str):
    source, library = os.path.join(directory, "megatron_loop.c"), os.path.join(directory, "megatron_loop.so")
    with open(source, "w") as handle:
        handle.write(MEGATRON_LOOP_C)
    try:
        subprocess.run(["cc", "-O3", "-shared", "-fPIC", "-o", library, source], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as error:
        print(f"(no C reference: {error})", file=sys.stderr)
        return None
    function = ctypes.CDLL(library).build_sample_idx
    function.restype = None
    return function


def synthetic_sizes(tokens: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    sizes = np.clip(rng.lognormal(mean=6.2, sigma=0.9, size=int(tokens / 600) + 1000), 1, 60000).astype(np.int32)
    cut = int(np.searchsorted(np.cumsum(sizes, dtype=np.int64), tokens)) + 1
    return sizes[:cut]


def bench_index(tokens: int, seq_length: int, epochs_wanted: int, reference) -> dict:
    sizes = synthetic_sizes(tokens)
    documents = np.arange(len(sizes), dtype=np.int32)
    tokens_per_epoch = int(sizes.sum(dtype=np.int64))
    num_samples = (epochs_wanted * tokens_per_epoch - 1) // seq_length - 1
    start = time.perf_counter()
    indices = build_indices(sizes, documents, seq_length, num_samples, seed=1234)
    total_seconds = time.perf_counter() - start
    epochs = num_epochs(tokens_per_epoch, seq_length, num_samples)
    doc_index = build_document_index(documents, epochs, np.random.RandomState(1), False)
    start = time.perf_counter()
    ours = build_sample_index(sizes, doc_index, seq_length, epochs, tokens_per_epoch)
    sample_seconds = time.perf_counter() - start
    row = {"tokens_per_epoch": tokens_per_epoch, "documents": len(sizes), "epochs": epochs,
           "samples": int(len(indices.shuffle_index)), "seq_length": seq_length, "total_build_s": total_seconds,
           "sample_index_s": sample_seconds}
    if reference is not None:
        count = (epochs * tokens_per_epoch - 1) // seq_length
        theirs = np.zeros((count + 1, 2), dtype=np.int32)
        start = time.perf_counter()
        reference(sizes.ctypes.data_as(ctypes.c_void_p), doc_index.ctypes.data_as(ctypes.c_void_p),
                  ctypes.c_int32(seq_length), ctypes.c_int64(count), theirs.ctypes.data_as(ctypes.c_void_p))
        row["c_loop_s"] = time.perf_counter() - start
        row["ratio_numpy_over_c"] = sample_seconds / row["c_loop_s"]
        row["identical_to_c"] = bool(np.array_equal(ours, theirs))
    return row


def bench_reader(directory: str, gigabytes: float) -> dict:
    prefix = os.path.join(directory, "big_text_document")
    tokens_total = int(gigabytes * (1 << 30)) // 2
    rng = np.random.default_rng(0)
    written = 0
    start = time.perf_counter()
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        while written < tokens_total:
            lengths = np.clip(rng.lognormal(6.2, 0.9, size=20000), 1, 60000).astype(np.int64)
            lengths = lengths[np.cumsum(lengths) <= tokens_total - written] if lengths.sum() > tokens_total - written \
                else lengths
            if len(lengths) == 0:
                lengths = np.array([tokens_total - written])
            writer.add_documents(rng.integers(0, 50257, size=int(lengths.sum()), dtype=np.uint16), lengths)
            written += int(lengths.sum())
    write_seconds = time.perf_counter() - start
    results = {}
    for mode in ("get_document", "iter_documents"):
        done = subprocess.run([sys.executable, "-c", READER, prefix, mode], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": ROOT}, check=True)
        results[mode] = eval(done.stdout.strip(), {})  # the reader prints a dict literal of numbers
        results[mode].update(bin_bytes=os.path.getsize(prefix + ".bin"), write_seconds=write_seconds)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--tokens", type=int, default=100_000_000, help="tokens per epoch (default 100M)")
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--reader-gb", type=float, default=1.0, help="size of the dataset the reader reads")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        reference = compile_reference(directory)
        rows = [bench_index(args.tokens, args.seq_length, epochs, reference) for epochs in (1, 3)]
        reader = bench_reader(directory, args.reader_gb) if args.reader_gb > 0 else None
    result = {"index": rows, "reader": reader, "load_average": os.getloadavg()}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"sample indices, seq {args.seq_length} (load average {os.getloadavg()[0]:.2f}):")
    print(f"{'tokens/epoch':>13s} {'docs':>8s} {'epochs':>6s} {'samples':>9s} {'all 3 s':>8s} {'sample s':>9s} "
          f"{'C loop s':>9s} {'ratio':>6s} {'same':>5s}")
    for r in rows:
        print(f"{r['tokens_per_epoch']:13,d} {r['documents']:8d} {r['epochs']:6d} {r['samples']:9d} "
              f"{r['total_build_s']:8.3f} {r['sample_index_s']:9.3f} {r.get('c_loop_s', float('nan')):9.3f} "
              f"{r.get('ratio_numpy_over_c', float('nan')):6.2f} {str(r.get('identical_to_c', '-')):>5s}")
    if reader:
        mb = 1 << 20
        first = reader["get_document"]
        print(f"reader of a {first['bin_bytes'] / mb:.0f} MB .bin ({first['documents']} documents, every token read):")
        print(f"{'access':16s} {'seconds':>8s} {'peak RSS MB':>12s} {'peak private MB':>16s} {'file pages MB at end':>21s}")
        for mode, r in reader.items():
            print(f"{mode:16s} {r['seconds']:8.1f} {r['vm_hwm'] / mb:12.0f} {r['rss_anon_peak'] / mb:16.0f} "
                  f"{r['rss_file_end'] / mb:21.0f}")


if __name__ == "__main__":
    main()
