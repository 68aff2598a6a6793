"""Throughput of ``domino preprocess`` (GPT-2 BPE) on real text, with 1 and 2 workers.

The input is the two built-in corpora (Shakespeare and the King James Bible) written as ``.jsonl`` files
and repeated until at least ``--megabytes`` MB (default 25). Each configuration runs the real command
line, ``python -m domino preprocess ...``, in a fresh process, and the wall-clock time includes Python
start-up, imports, tokenizer loading, reading, tokenising and the atomic, fsynced output.

Reference measured in the same run: ``per-doc-encode``, the Megatron ``preprocess_data.py`` way of
tokenising (one ``encode`` call per document in a single process, same Rust tokenizer, same writer),
also as a fresh process. The ``ratio`` column is tokens/s over the reference's.

The machine may be shared: every configuration runs ``--repeats`` times, interleaved, and the table
shows the median and the best wall-clock time.

Usage::

    python benchmarks/preprocess.py [--megabytes 25] [--repeats 1] [--json]
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


def write_corpus(directory: str, megabytes: float) -> dict:
    """Shakespeare + KJV as jsonl, repeated to at least ``megabytes`` MB; returns sizes."""
    texts = [d.texts[0] for name in ("shakespeare", "kjv") for d in builtin_documents(name)]
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode("utf-8")
    text_bytes = sum(len(t.encode("utf-8")) for t in texts)
    copies = 0
    while copies * len(lines) < megabytes * 1e6:
        with open(os.path.join(directory, f"corpus-{copies:02d}.jsonl"), "wb") as handle:
            handle.write(lines)
        copies += 1
    return {"files": copies, "jsonl_bytes": copies * len(lines), "text_bytes": copies * text_bytes,
            "documents": copies * len(texts)}


def run(command: list, env: dict) -> tuple:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return seconds, json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--megabytes", type=float, default=25.0, help="input size in MB (default 25)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per configuration (default 1)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": ROOT}
    with tempfile.TemporaryDirectory() as work:
        corpus = write_corpus(work, args.megabytes)
        pattern = os.path.join(work, "corpus-*.jsonl")
        configs = {
            "workers=1": [sys.executable, "-m", "domino", "preprocess", "--input", pattern, "--output-prefix",
                          os.path.join(work, "w1"), "--workers", "1", "--no-progress", "--json"],
            "workers=2": [sys.executable, "-m", "domino", "preprocess", "--input", pattern, "--output-prefix",
                          os.path.join(work, "w2"), "--workers", "2", "--no-progress", "--json"],
            "per-doc-encode": [sys.executable, "-c", REFERENCE, pattern, os.path.join(work, "ref_text_document")],
        }
        times = {name: [] for name in configs}
        tokens = {}
        for _ in range(args.repeats):
            for name, command in configs.items():
                seconds, out = run(command, env)
                times[name].append(seconds)
                tokens[name] = out["tokens"]
        identical = all(open(os.path.join(work, f"{p}_text_document.bin"), "rb").read()
                        == open(os.path.join(work, "ref_text_document.bin"), "rb").read() for p in ("w1", "w2"))
    reference_rate = tokens["per-doc-encode"] / statistics.median(times["per-doc-encode"])
    rows = []
    for name in configs:
        median = statistics.median(times[name])
        rate = tokens[name] / median
        rows.append({"config": name, "median_s": median, "best_s": min(times[name]), "tokens": tokens[name],
                     "tokens_per_s": rate, "best_tokens_per_s": tokens[name] / min(times[name]),
                     "text_mb_per_s": corpus["text_bytes"] / 1e6 / median, "ratio_vs_reference": rate / reference_rate})
    result = {"corpus": corpus, "cpu_count": os.cpu_count(), "load_average": os.getloadavg(),
              "outputs_identical": identical, "rows": rows}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"input: {corpus['files']} jsonl files, {corpus['jsonl_bytes'] / 1e6:.1f} MB "
          f"({corpus['text_bytes'] / 1e6:.1f} MB of text, {corpus['documents']} documents); "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    print(f"{'config':16s} {'median s':>9s} {'best s':>8s} {'tokens':>10s} {'tokens/s':>11s} {'best tok/s':>11s} "
          f"{'text MB/s':>10s} {'ratio':>6s}")
    for r in rows:
        print(f"{r['config']:16s} {r['median_s']:9.2f} {r['best_s']:8.2f} {r['tokens']:10d} {r['tokens_per_s']:11,.0f} "
              f"{r['best_tokens_per_s']:11,.0f} {r['text_mb_per_s']:10.2f} {r['ratio_vs_reference']:6.2f}")
    print(f"outputs byte-identical across configurations: {identical}")


if __name__ == "__main__":
    main()
