"""Throughput of ``domino preprocess`` (GPT-2 BPE) on real text: 1 and 2 workers, compressed and Parquet
inputs, and of ``domino merge-datasets``.

The input is the two built-in corpora (Shakespeare and the King James Bible) written as ``.jsonl`` files
and repeated until ``--megabytes`` MB (default 25; the last copy cut at a line), and the same files as ``.jsonl.gz`` (gzip
level 6), ``.jsonl.zst`` (zstd level 3) and ``.parquet`` (pyarrow defaults: snappy). Each configuration
runs the real command line, ``python -m domino preprocess ...``, in a fresh process, and the wall-clock
time includes Python start-up, imports, tokenizer loading, reading (decompressing), tokenising and the
atomic, fsynced output.

Reference measured in the same run: ``per-doc-encode``, the Megatron ``preprocess_data.py`` way of
tokenising (one ``encode`` call per document in a single process, same Rust tokenizer, same writer),
also as a fresh process. The ``ratio`` column is tokens/s over the reference's; ``vs jsonl`` is tokens/s
over plain ``.jsonl`` with the same 2 workers.

The merge concatenates ``--merge-copies`` copies of the 2-worker output with ``domino merge-datasets``'s
function in a fresh process and reports MB/s of output, and the process's peak RSS for that merge and for
one of an eighth the size (flat memory: the two are the same).

The machine may be shared: every configuration runs ``--repeats`` times, interleaved, and the table
shows the median and the best wall-clock time.

Usage::

    python benchmarks/preprocess.py [--megabytes 25] [--repeats 1] [--merge-copies 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from domino.data.builtin_corpora import builtin_documents  # noqa: E402

REFERENCE = r"""
import sys, json, numpy as np
from domino.data.tokenizer import build_tokenizer
from domino.data.indexed_dataset import IndexedDatasetWriter, token_dtype
import glob
tok = build_tokenizer("gpt2")
tokens = documents = 0
with IndexedDatasetWriter(sys.argv[2], token_dtype(tok.vocab_size)) as writer:
    for path in sorted(glob.glob(sys.argv[1])):
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                ids = tok.encode(json.loads(line)["text"])
                if ids:
                    ids.append(tok.eod)
                    writer.add_document(np.asarray(ids))
                    tokens += len(ids)
                    documents += 1
print(json.dumps({"tokens": tokens, "documents": documents}))
"""


MERGE = r"""
import json, resource, sys
from domino.data.merge import merge_datasets
result = merge_datasets(sys.argv[2:], sys.argv[1])
print(json.dumps({"bytes": result.bytes, "seconds": result.seconds,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def write_formats(directory: str) -> dict:
    """The corpus's .jsonl files also as .jsonl.gz, .jsonl.zst and .parquet, one folder each; returns sizes."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    sizes = {}
    for kind in ("gz", "zst", "parquet"):
        os.makedirs(os.path.join(directory, kind))
        sizes[kind] = 0
    for name in sorted(n for n in os.listdir(directory) if n.endswith(".jsonl")):
        data = open(os.path.join(directory, name), "rb").read()
        outputs = {"gz": gzip.compress(data, compresslevel=6), "zst": zstandard.ZstdCompressor(level=3).compress(data)}
        for kind, blob in outputs.items():
            path = os.path.join(directory, kind, f"{name}.{kind}")
            with open(path, "wb") as handle:
                handle.write(blob)
            sizes[kind] += len(blob)
        texts = [json.loads(line)["text"] for line in data.decode("utf-8").splitlines()]
        path = os.path.join(directory, "parquet", name.replace(".jsonl", ".parquet"))
        pq.write_table(pa.table({"text": texts}), path)
        sizes["parquet"] += os.path.getsize(path)
    return sizes


def write_corpus(directory: str, megabytes: float) -> dict:
    """Shakespeare + KJV as jsonl, repeated to at least ``megabytes`` MB; returns sizes."""
    texts = [d.texts[0] for name in ("shakespeare", "kjv") for d in builtin_documents(name)]
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode("utf-8")
    text_bytes = sum(len(t.encode("utf-8")) for t in texts)
    copies, written, text_written, documents = 0, 0, 0, 0
    while written < megabytes * 1e6:
        part = lines[:lines.index(b"\n", min(int(megabytes * 1e6) - written, len(lines) - 1)) + 1]  # whole lines
        with open(os.path.join(directory, f"corpus-{copies:02d}.jsonl"), "wb") as handle:
            handle.write(part)
        count = part.count(b"\n")
        copies, written, documents = copies + 1, written + len(part), documents + count
        text_written += text_bytes if count == len(texts) else sum(len(t.encode("utf-8")) for t in texts[:count])
    return {"files": copies, "jsonl_bytes": written, "text_bytes": text_written, "documents": documents}


def run(command: list, env: dict) -> tuple:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return seconds, json.loads(done.stdout)


def _preprocess(pattern: str, prefix: str, workers: int) -> list:
    return [sys.executable, "-m", "domino", "preprocess", "--input", pattern, "--output-prefix", prefix,
            "--workers", str(workers), "--no-progress", "--json"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--megabytes", type=float, default=25.0, help="input size in MB (default 25)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per configuration (default 1)")
    parser.add_argument("--merge-copies", type=int, default=8, help="datasets merged (default 8)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": ROOT}
    with tempfile.TemporaryDirectory() as work:
        corpus = write_corpus(work, args.megabytes)
        corpus["compressed_bytes"] = write_formats(work)
        pattern = os.path.join(work, "corpus-*.jsonl")
        configs = {
            "workers=1": _preprocess(pattern, os.path.join(work, "w1"), 1),
            "workers=2": _preprocess(pattern, os.path.join(work, "w2"), 2),
            "jsonl.gz w=2": _preprocess(os.path.join(work, "gz"), os.path.join(work, "gz"), 2),
            "jsonl.zst w=2": _preprocess(os.path.join(work, "zst"), os.path.join(work, "zst"), 2),
            "parquet w=2": _preprocess(os.path.join(work, "parquet"), os.path.join(work, "pq"), 2),
            "per-doc-encode": [sys.executable, "-c", REFERENCE, pattern, os.path.join(work, "ref_text_document")],
        }
        times = {name: [] for name in configs}
        tokens = {}
        for _ in range(args.repeats):
            for name, command in configs.items():
                seconds, out = run(command, env)
                times[name].append(seconds)
                tokens[name] = out["tokens"]
        reference = open(os.path.join(work, "ref_text_document.bin"), "rb").read()
        identical = all(open(os.path.join(work, f"{p}_text_document.bin"), "rb").read() == reference
                        for p in ("w1", "w2", "gz", "zst", "pq"))
        w2 = os.path.join(work, "w2_text_document")
        merges = {}
        for copies in sorted({max(1, args.merge_copies // 8), args.merge_copies}):
            _, merges[copies] = run([sys.executable, "-c", MERGE, os.path.join(work, f"merged{copies}"),
                                     *[w2] * copies], env)
            os.remove(os.path.join(work, f"merged{copies}.bin"))
        merge = {**merges[args.merge_copies], "peak_rss_mb_by_copies": {c: m["peak_rss_mb"] for c, m in merges.items()}}
    reference_rate = tokens["per-doc-encode"] / statistics.median(times["per-doc-encode"])
    jsonl_rate = tokens["workers=2"] / statistics.median(times["workers=2"])
    rows = []
    for name in configs:
        median = statistics.median(times[name])
        rate = tokens[name] / median
        rows.append({"config": name, "median_s": median, "best_s": min(times[name]), "tokens": tokens[name],
                     "tokens_per_s": rate, "best_tokens_per_s": tokens[name] / min(times[name]),
                     "text_mb_per_s": corpus["text_bytes"] / 1e6 / median, "ratio_vs_reference": rate / reference_rate,
                     "ratio_vs_jsonl_w2": rate / jsonl_rate})
    merge["mb_per_s"] = merge["bytes"] / 1e6 / merge["seconds"]
    result = {"corpus": corpus, "cpu_count": os.cpu_count(), "load_average": os.getloadavg(),
              "outputs_identical": identical, "rows": rows, "merge": merge}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    sizes = corpus["compressed_bytes"]
    print(f"input: {corpus['files']} jsonl files, {corpus['jsonl_bytes'] / 1e6:.1f} MB "
          f"({corpus['text_bytes'] / 1e6:.1f} MB of text, {corpus['documents']} documents; gz {sizes['gz'] / 1e6:.1f} MB, "
          f"zst {sizes['zst'] / 1e6:.1f} MB, parquet {sizes['parquet'] / 1e6:.1f} MB); "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    print(f"{'config':16s} {'median s':>9s} {'best s':>8s} {'tokens':>10s} {'tokens/s':>11s} {'best tok/s':>11s} "
          f"{'text MB/s':>10s} {'ratio':>6s} {'vs jsonl':>8s}")
    for r in rows:
        print(f"{r['config']:16s} {r['median_s']:9.2f} {r['best_s']:8.2f} {r['tokens']:10d} {r['tokens_per_s']:11,.0f} "
              f"{r['best_tokens_per_s']:11,.0f} {r['text_mb_per_s']:10.2f} {r['ratio_vs_reference']:6.2f} "
              f"{r['ratio_vs_jsonl_w2']:8.2f}")
    print(f"outputs byte-identical across configurations and formats: {identical}")
    rss = ", ".join(f"{rss:.0f} MB merging {c}" for c, rss in merge["peak_rss_mb_by_copies"].items())
    print(f"merge-datasets: {args.merge_copies} x the workers=2 dataset -> {merge['bytes'] / 1e6:.1f} MB in "
          f"{merge['seconds']:.2f} s ({merge['mb_per_s']:,.0f} MB/s); peak RSS {rss}")


if __name__ == "__main__":
    main()
