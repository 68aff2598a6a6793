"""How much tensor-parallel communication Domino hides, on emulated links (``DOMINO_SIMULATED_NETWORK``).

Runs ``domino pretrain`` end to end with TP=2 (2 processes x 1 thread), synchronous and with Domino at 2 and
4 chunks, once with real gloo communication only and then on emulated links whose speed gives a chosen ratio
of modelled communication time to the synchronous step's compute time. Per run it reports the median step
time, the time blocked in TP collectives (the ``comm-wait`` timer), the modelled link time (``comm-modelled``)
and the hidden fraction ``1 - blocked / modelled``; and it checks the losses: equal with and without the
emulator (bit for bit) and equal between synchronous and Domino (within fp32 rounding).

Real ratios, per transformer layer and token (fwd + bwd = 3x the forward FLOPs; 4 all-reduces of ``h`` bf16
values, each sending ``2 (n-1)/n`` times its bytes from every rank of the ring)::

    compute = 3 (24 h^2 + 4 s h) / n / F        comm = 4 x 2 (n-1)/n x 2 h / B
    comm / compute = 16 (n-1) F / (3 B (24 h + 4 s))

with the GPT 6.7B shape of the Domino paper (h 4096, s 2048), F = 989 TFLOP/s (H100/H200 SXM dense bf16), and
B = 450 GB/s per direction (NVLink 4, TP=8 in one node) or 50 GB/s (one 400 Gb/s InfiniBand NIC per GPU, a
TP=8 ring that crosses nodes). Peak FLOP/s make these upper bounds: a real step reaches about half of it.

    python benchmarks/overlap.py [--iters 10] [--settings ...] [--real-domino] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

LAYERS, HIDDEN, HEADS, SEQ, MICRO_BATCH, VOCAB = 4, 256, 4, 128, 8, 2048
MODEL = ["--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
         "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size", str(MICRO_BATCH),
         "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "3e-4", "--lr-warmup-iters", "2",
         "--eval-interval", "0", "--eval-iters", "0", "--timing-log-level", "1", "--num-workers", "1",
         "--log-interval", "1", "--tensor-model-parallel-size", "2"]
LAYOUTS = {"sync": 1, "Domino 2": 2, "Domino 4": 4}
WARMUP = 2  # iterations left out of the medians
LATENCY_US = 20.0  # per collective; small next to the ms-long transfers of every setting below
H100_BF16_FLOPS, NVLINK_BYTES_S, IB400_BYTES_S = 989e12, 450e9, 50e9
REAL_H, REAL_S, REAL_TP = 4096, 2048, 8


def real_ratio(link_bytes_s: float) -> float:
    """Communication / compute time of a TP layer of the real model on the real link (see the docstring)."""
    n = REAL_TP
    return 16 * (n - 1) * H100_BF16_FLOPS / (3 * link_bytes_s * (24 * REAL_H + 4 * REAL_S))


SETTINGS = {  # name -> modelled communication / synchronous compute
    "fast link": 0.25,
    "NVLink, TP=8": real_ratio(NVLINK_BYTES_S),
    "IB 400G, TP=8": real_ratio(IB400_BYTES_S),
}


def wire_bytes_per_step() -> int:
    """Bytes each rank sends per step of TP=2 (fp32): see tests/model/test_model_network_emulator.py."""
    b, s, h = MICRO_BATCH, SEQ, HIDDEN
    return 4 * ((2 + 4 * LAYERS) * b * s * h + 3 * b * s)  # 2 (n-1)/n = 1 for n = 2


def prepare_data(work: Path) -> tuple:
    """A BPE tokenizer of ``VOCAB`` tokens and the Shakespeare corpus preprocessed with it."""
    domino, tok = [sys.executable, "-m", "domino"], work / "tok"
    subprocess.run([*domino, "train-tokenizer", "--builtin-corpus", "shakespeare", "--vocab-size", str(VOCAB),
                    "--output", str(tok)], check=True, capture_output=True)
    subprocess.run([*domino, "preprocess", "--builtin-corpus", "shakespeare", "--tokenizer", str(tok),
                    "--output-prefix", str(work / "shk"), "--append-eod"], check=True, capture_output=True)
    return str(tok), str(work / "shk_text_document")


def run(chunks: int, network: str, data: tuple, iters: int, work: Path) -> dict:
    """One ``domino pretrain`` on 2 processes; medians over the iterations after warm-up."""
    metrics = work / f"metrics-{chunks}-{network or 'real'}.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "domino", "pretrain",
           *MODEL, "--domino-chunks", str(chunks), "--tokenizer", data[0], "--data-path", data[1],
           "--train-iters", str(iters), "--metrics-file", str(metrics)]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env.pop("DOMINO_SIMULATED_NETWORK", None)
    if network:
        env["DOMINO_SIMULATED_NETWORK"] = network
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    records = [r for r in records if "eval" not in r]
    steady = records[WARMUP:]
    timer = lambda r, name: r.get("timers_ms_per_iter", {}).get(name, 0.0)  # noqa: E731
    step = statistics.median(1000 * r["iteration_time_s"] for r in steady)
    blocked = statistics.median(timer(r, "comm-wait") for r in steady)
    modelled = statistics.median(timer(r, "comm-modelled") for r in steady)
    return {"step_ms": step, "blocked_ms": blocked, "modelled_ms": modelled,
            "blocked_share": blocked / step, "hidden_fraction": 1 - blocked / modelled if modelled else None,
            "losses": [r["lm_loss"] for r in records]}


def iterations(ratio: float, iters: int) -> int:
    """Slow links get fewer iterations (their steps are mostly modelled sleep, so they vary little)."""
    return iters if ratio <= 1 else max(WARMUP + 3, round(iters / ratio))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10, help="iterations per run (the first 2 are warm-up)")
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS),
                        help="emulated links to run (default: all)")
    parser.add_argument("--real-domino", action="store_true",
                        help="also run Domino with real gloo communication only (the calibration runs sync only)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = parser.parse_args()
    out = {"model": {"layers": LAYERS, "hidden": HIDDEN, "seq": SEQ, "micro_batch": MICRO_BATCH, "vocab": VOCAB,
                     "tp": 2}, "wire_bytes_per_step": wire_bytes_per_step(), "settings": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = prepare_data(work)
        layouts = LAYOUTS if args.real_domino else {"sync": 1}
        real = {name: run(chunks, "", data, args.iters, work) for name, chunks in layouts.items()}
        out["settings"]["real gloo only"] = {"ratio": None, "network": "", "runs": real}
        compute_ms = real["sync"]["step_ms"] - real["sync"]["blocked_ms"]  # synchronous step without comm
        out["sync_compute_ms"] = compute_ms
        for setting in args.settings:
            ratio = SETTINGS[setting]
            transfer_s = ratio * compute_ms / 1000 - (2 + 4 * LAYERS + 3) * LATENCY_US * 1e-6
            gbps = wire_bytes_per_step() / transfer_s / 1e9
            network = f"latency_us={LATENCY_US:g},gbps={gbps:.4f}"
            runs = {name: run(chunks, network, data, iterations(ratio, args.iters), work)
                    for name, chunks in LAYOUTS.items()}
            out["settings"][setting] = {"ratio": ratio, "network": network, "runs": runs}
    check_losses(out)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print_tables(out)


def check_losses(out: dict) -> None:
    """Every layout's losses are the same bit for bit on every link; Domino's equal sync's within fp32 rounding."""
    first = {}  # layout -> losses of its first run
    worst = 0.0
    for setting in out["settings"].values():
        for name, r in setting["runs"].items():
            reference = first.setdefault(name, r["losses"])
            n = min(len(reference), len(r["losses"]))
            if r["losses"][:n] != reference[:n]:
                raise SystemExit(f"losses of {name} on link {setting['network']!r} differ from its other runs")
            sync = out["settings"]["real gloo only"]["runs"]["sync"]["losses"]
            worst = max([worst] + [abs(a - b) / abs(b) for a, b in zip(r["losses"], sync)])
    out["losses"] = {"same_on_every_link_bitwise": True, "domino_vs_sync_max_rel_diff": worst}


def print_tables(out: dict) -> None:
    print(f"TP=2, {LAYERS} layers / hidden {HIDDEN} / seq {SEQ} / micro-batch {MICRO_BATCH}, fp32, 2 processes x "
          f"1 thread; {out['wire_bytes_per_step'] / 2**20:.2f} MiB sent per rank per step; synchronous compute "
          f"{out['sync_compute_ms']:.0f} ms/step")
    print(f"real ratios: 16 (n-1) F / (3 B (24 h + 4 s)), n={REAL_TP}, h={REAL_H}, s={REAL_S}, "
          f"F={H100_BF16_FLOPS / 1e12:.0f} TFLOP/s: NVLink B={NVLINK_BYTES_S / 1e9:.0f} GB/s -> "
          f"{real_ratio(NVLINK_BYTES_S):.2f}; IB B={IB400_BYTES_S / 1e9:.0f} GB/s -> {real_ratio(IB400_BYTES_S):.2f}")
    print(f"{'setting':<16} {'ratio':>5} {'layout':<9} {'step ms':>8} {'speed-up':>8} {'blocked ms':>10} "
          f"{'blocked %':>9} {'modelled ms':>11} {'hidden':>7}")
    for setting, s in out["settings"].items():
        sync = s["runs"]["sync"]["step_ms"]
        for name, r in s["runs"].items():
            ratio = f"{s['ratio']:.2f}" if s["ratio"] is not None else "-"
            hidden = f"{100 * r['hidden_fraction']:.0f}%" if r["hidden_fraction"] is not None else "-"
            print(f"{setting:<16} {ratio:>5} {name:<9} {r['step_ms']:>8.0f} {sync / r['step_ms']:>7.2f}x "
                  f"{r['blocked_ms']:>10.1f} {100 * r['blocked_share']:>8.1f}% {r['modelled_ms']:>11.1f} {hidden:>7}")
    print(f"losses: each layout's are bit for bit the same on every link; Domino vs sync max relative difference "
          f"{out['losses']['domino_vs_sync_max_rel_diff']:.1e}")


if __name__ == "__main__":
    main()
