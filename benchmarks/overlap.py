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

    python benchmarks/overlap.py [--iters 10] [--settings ...] [--real-domino] [--transfer launch|wait]
                                 [--hidden-size 512] [--mode pretrain|steps] [--repeats N] [--breakdown]
                                 [--sequence-parallel] [--context-parallel-size N] [--seq-length S] [--json]

``--breakdown`` also prints, per link and layout, the blocked time by call site (the labels of
``domino.runtime.comm_timing.comm_site``: forward waits per layer position and chunk, backward input-gradient
guards, embedding, output layer, cross-entropy), means over the measured steps.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from domino.config import ModelConfig  # noqa: E402
from domino.model import GPTModel  # noqa: E402
from domino.overlap.schedule import apply_domino  # noqa: E402
from domino.runtime import comm_timing  # noqa: E402
from domino.runtime import state  # noqa: E402
from domino.runtime.network_emulator import LinkEmulator, parse_spec  # noqa: E402

LAYERS, SEQ, MICRO_BATCH, VOCAB, HEAD_DIM = 4, 128, 8, 2048, 64
HIDDEN = 512  # --hidden-size; heads = HIDDEN / HEAD_DIM. Why 512, not 256: see set_shape()
HEADS = HIDDEN // HEAD_DIM
CP = 1  # --context-parallel-size: TP=2 x CP ranks, 2 x CP processes (pretrain mode)
MODEL: list = []


def set_shape(hidden: int, sequence_parallel: bool = False, cp: int = 1, seq: int = SEQ) -> None:
    """Sets the benchmark model's hidden size (and heads, and the ``domino pretrain`` flags).

    The default is 512 because at 256 the CPU's fixed costs weigh more against the schedule: per-op dispatch
    and gloo's own CPU time per collective (about 0.4 ms for 0.5 MiB, on the cores that compute) grow with the
    number of ops and collectives, not with the FLOPs, and Domino has twice the ops and collectives. Measured
    on this machine (steps mode, NVLink ratio, ``benchmarks/RESULTS.md``): Domino 2's computation (step -
    blocked) was 1.21x synchronous TP's at hidden 256 and 1.08x at 512 (Domino 4: 1.51x and 1.33x); a GPU's
    GEMMs at the real shape are far from that regime.
    """
    global HIDDEN, HEADS, MODEL, CP, SEQ
    if hidden % HEAD_DIM or hidden % 2:
        raise SystemExit(f"--hidden-size must be a multiple of {HEAD_DIM}, got {hidden}")
    HIDDEN, HEADS, CP, SEQ = hidden, hidden // HEAD_DIM, cp, seq
    MODEL = ["--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
             "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size",
             str(MICRO_BATCH), "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "3e-4",
             "--lr-warmup-iters", "2", "--eval-interval", "0", "--eval-iters", "0", "--timing-log-level", "1",
             "--num-workers", "1", "--log-interval", "1", "--tensor-model-parallel-size", "2"]
    MODEL += ["--sequence-parallel"] if sequence_parallel else []
    MODEL += ["--context-parallel-size", str(cp)] if cp > 1 else []


set_shape(HIDDEN)
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
    """Bytes each rank sends per step of TP=2 (fp32): see tests/model/test_model_network_emulator.py. Under CP a
    rank's TP collectives cover its ``SEQ / CP`` tokens (the ring's key/value blocks are real gloo, not emulated)."""
    b, s, h = MICRO_BATCH, SEQ // CP, HIDDEN
    return 4 * ((2 + 4 * LAYERS) * b * s * h + 3 * b * s)  # 2 (n-1)/n = 1 for n = 2


def prepare_data(work: Path) -> tuple:
    """A BPE tokenizer of ``VOCAB`` tokens and the Shakespeare corpus preprocessed with it."""
    domino, tok = [sys.executable, "-m", "domino"], work / "tok"
    subprocess.run([*domino, "train-tokenizer", "--builtin-corpus", "shakespeare", "--vocab-size", str(VOCAB),
                    "--output", str(tok)], check=True, capture_output=True)
    subprocess.run([*domino, "preprocess", "--builtin-corpus", "shakespeare", "--tokenizer", str(tok),
                    "--output-prefix", str(work / "shk"), "--append-eod"], check=True, capture_output=True)
    return str(tok), str(work / "shk_text_document")


def run(chunks: int, network: str, data: tuple, iters: int, work: Path, breakdown: bool = False) -> dict:
    """One ``domino pretrain`` on 2 processes; medians over the iterations after warm-up."""
    metrics = work / f"metrics-{chunks}-{network or 'real'}.jsonl"
    metrics.unlink(missing_ok=True)
    # Timing level 2 adds the comm-wait breakdown by call site (and forward/backward timers: host clocks only).
    model = [a if a != "1" or MODEL[i - 1] != "--timing-log-level" else ("2" if breakdown else "1")
             for i, a in enumerate(MODEL)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(2 * CP), "-m", "domino", "pretrain",
           *model, "--domino-chunks", str(chunks), "--tokenizer", data[0], "--data-path", data[1],
           "--train-iters", str(iters), "--metrics-file", str(metrics)]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env.pop("DOMINO_SIMULATED_NETWORK", None)
    if network:
        env["DOMINO_SIMULATED_NETWORK"] = network
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    print(f"done: {chunks} chunks, link {network or 'real gloo only'}", file=sys.stderr, flush=True)
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    records = [r for r in records if "eval" not in r]
    steady = records[WARMUP:]
    timer = lambda r, name: r.get("timers_ms_per_iter", {}).get(name, 0.0)  # noqa: E731
    sites = [{k[len(SITE):]: v for k, v in r.get("timers_ms_per_iter", {}).items() if k.startswith(SITE)}
             for r in steady]
    return summary([1000 * r["iteration_time_s"] for r in steady], [timer(r, "comm-wait") for r in steady],
                   [timer(r, "comm-modelled") for r in steady], [r["lm_loss"] for r in records], sites)


SITE = "comm-wait: "  # prefix of the breakdown's timers in the metrics file (domino/train/trainer.py)


def network_for(ratio: float, compute_ms: float, transfer: str = "launch", wire_bytes: Optional[float] = None,
                collectives: Optional[int] = None) -> str:
    """The ``DOMINO_SIMULATED_NETWORK`` value whose link time is ``ratio`` x ``compute_ms`` per sync step that sends
    ``wire_bytes`` in ``collectives`` (default: this script's TP=2 step, :func:`wire_bytes_per_step`)."""
    wire_bytes = wire_bytes_per_step() if wire_bytes is None else wire_bytes
    collectives = 2 + 4 * LAYERS + 3 if collectives is None else collectives
    transfer_s = ratio * compute_ms / 1000 - collectives * LATENCY_US * 1e-6
    return f"latency_us={LATENCY_US:g},gbps={wire_bytes / transfer_s / 1e9:.4f},transfer={transfer}"


def summary(step_ms: list, blocked_ms: list, modelled_ms: list, losses: list, sites: list = ()) -> dict:
    """Medians of one layout's steps, its hidden fraction, its compute (step - blocked) and, when ``sites`` (one
    ``{site: ms}`` per step) is given, the mean blocked ms per call site (means, so that they add up)."""
    step, blocked, modelled = (statistics.median(v) for v in (step_ms, blocked_ms, modelled_ms))
    compute = statistics.median(a - b for a, b in zip(step_ms, blocked_ms))
    by_site = {}
    for per_step in sites:
        for site, ms in per_step.items():
            by_site[site] = by_site.get(site, 0.0) + ms / len(sites)
    return {"step_ms": step, "blocked_ms": blocked, "modelled_ms": modelled, "blocked_share": blocked / step,
            "hidden_fraction": 1 - blocked / modelled if modelled else None, "losses": losses,
            "step_ms_all": step_ms, "compute_ms": compute, "blocked_by_site_ms": by_site}


def _steps_worker(rank: int, port: int, settings: list, repeats: int, out_dir: str, transfer: str,
                  hidden: int) -> None:
    """One rank of ``--mode steps``: the three layouts in one process pair, alternating step by step."""
    set_shape(hidden)  # a spawned process starts from the module's defaults
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = state.initialize_model_parallel(2)
    config = ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=SEQ,
                         hidden_dropout=0.0, attention_dropout=0.0)
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g) for _ in range(2))
    runs, link = {}, None

    def build(tp) -> None:
        """The layouts' models over ``tp`` (the same weights each time: a setting's link is the group's)."""
        for name, chunks in LAYOUTS.items():
            torch.manual_seed(0)
            model = apply_domino(GPTModel(config, VOCAB, tp=tp), chunks)
            runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True))

    def step(name: str) -> tuple:
        model, opt = runs[name]
        dist.barrier()
        model.tp.timer.pop_seconds(), comm_timing.pop_modelled_comm_seconds(link)
        model.tp.timer.pop_by_site()
        started = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(tokens, labels=labels).mean()
        loss.backward()
        opt.step()
        elapsed = time.perf_counter() - started
        return (1000 * elapsed, 1000 * model.tp.timer.pop_seconds(),
                1000 * comm_timing.pop_modelled_comm_seconds(link), loss.item(),
                {k: 1000 * v for k, v in model.tp.timer.pop_by_site().items()})

    out = {"settings": {}}
    for setting in ["real gloo only", *settings]:
        ratio = SETTINGS.get(setting)
        if ratio is None:
            network = ""
        else:  # rank 0's calibration decides, so both ranks emulate the same link
            compute = torch.tensor([out["sync_compute_ms"]], dtype=torch.float64)
            dist.broadcast(compute, 0)
            network = network_for(ratio, compute.item(), transfer)
        link = LinkEmulator(parse_spec(network)) if network else None
        build(mesh.with_tp_link(link).tp)
        reps = repeats if ratio is None or ratio <= 1 else max(3, round(repeats / ratio))
        for name in LAYOUTS:  # warm-up
            step(name)
        records = {name: [] for name in LAYOUTS}
        for _ in range(reps):
            for name in LAYOUTS:  # alternating: every layout sees the same background load
                records[name].append(step(name))
        runs_out = {name: summary(*map(list, zip(*r))) for name, r in records.items()}
        sync = records["sync"]
        for name, r in records.items():  # the speed-up as the median of back-to-back pairs cancels load drift
            runs_out[name]["paired_speedup"] = statistics.median(a[0] / b[0] for a, b in zip(sync, r))
        out["settings"][setting] = {"ratio": ratio, "network": network, "runs": runs_out}
        if rank == 0:  # progress, so that a run stopped early still shows what it measured
            print(json.dumps({setting: out["settings"][setting]}), file=sys.stderr, flush=True)
        if ratio is None:
            out["sync_compute_ms"] = runs_out["sync"]["step_ms"] - runs_out["sync"]["blocked_ms"]
    if rank == 0:
        torch.save(out, os.path.join(out_dir, "steps.pt"))
    dist.destroy_process_group()


def steps_mode(settings: list, repeats: int, transfer: str, hidden: int) -> dict:
    """``--mode steps``: training steps of the three layouts in one pair of gloo processes, alternating."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_steps_worker, args=(port, settings, repeats, out_dir, transfer, hidden), nprocs=2, join=True,
                           start_method="spawn")
        return torch.load(os.path.join(out_dir, "steps.pt"))


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
    parser.add_argument("--mode", choices=("pretrain", "steps"), default="pretrain",
                        help="pretrain: one `domino pretrain` per layout and link (end to end); steps: the "
                             "layouts' training steps alternating in one process pair (for a loaded machine)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="pretrain mode: rounds of the three layouts per link (medians and paired speed-up)")
    parser.add_argument("--transfer", choices=("launch", "wait"), default="launch",
                        help="when gloo moves an async collective's data on the emulated link: launch (competing "
                             "with the computation for the 2 cores) or wait (see domino/runtime/network_emulator.py)")
    parser.add_argument("--breakdown", action="store_true",
                        help="also print the blocked time by call site, and compute time vs sync's")
    parser.add_argument("--hidden-size", type=int, default=HIDDEN,
                        help=f"the benchmark model's hidden size (heads = hidden / {HEAD_DIM}); see set_shape()")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="pretrain mode: run every layout with --sequence-parallel (its backward also all-gathers "
                             "each kept norm-output slice again, so it sends more than wire_bytes_per_step says)")
    parser.add_argument("--context-parallel-size", type=int, default=1,
                        help="pretrain mode: TP=2 x this many CP ranks (2 x CP processes on the same cores)")
    parser.add_argument("--seq-length", type=int, default=SEQ, help="the benchmark model's sequence length")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = parser.parse_args()
    if (args.sequence_parallel or args.context_parallel_size > 1 or args.seq_length != SEQ) and args.mode == "steps":
        raise SystemExit("--sequence-parallel, --context-parallel-size and --seq-length are for --mode pretrain")
    set_shape(args.hidden_size, args.sequence_parallel, args.context_parallel_size, args.seq_length)
    if args.mode == "steps":
        out = steps_mode(args.settings, args.iters, args.transfer, HIDDEN)
    else:
        out = pretrain_mode(args)
    out.update(mode=args.mode, wire_bytes_per_step=wire_bytes_per_step(),
               model={"layers": LAYERS, "hidden": HIDDEN, "seq": SEQ, "micro_batch": MICRO_BATCH, "vocab": VOCAB,
                      "tp": 2, "cp": CP, "sequence_parallel": args.sequence_parallel})
    check_losses(out)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print_tables(out)
        if args.breakdown:
            print_breakdown(out)


def pretrain_mode(args) -> dict:
    """One ``domino pretrain`` per layout and link; the sync run with real gloo only calibrates the links."""
    out = {"settings": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = prepare_data(work)
        layouts = LAYOUTS if args.real_domino else {"sync": 1}
        real = {name: run(chunks, "", data, args.iters, work, args.breakdown) for name, chunks in layouts.items()}
        out["settings"]["real gloo only"] = {"ratio": None, "network": "", "runs": real}
        compute_ms = real["sync"]["step_ms"] - real["sync"]["blocked_ms"]  # synchronous step without comm
        out["sync_compute_ms"] = compute_ms
        for setting in args.settings:
            ratio = SETTINGS[setting]
            network = network_for(ratio, compute_ms, args.transfer)
            rounds = [{name: run(chunks, network, data, iterations(ratio, args.iters), work, args.breakdown)
                       for name, chunks in LAYOUTS.items()} for _ in range(args.repeats)]
            out["settings"][setting] = {"ratio": ratio, "network": network, "runs": median_round(rounds)}
    return out


def median_round(rounds: list) -> dict:
    """Per layout, the run with the median step time over ``--repeats`` rounds (each round runs every layout
    once, in turn, so a load drift hits them alike), plus the paired speed-up: the median over rounds of sync's
    step / the layout's step in the same round."""
    runs = {}
    for name in rounds[0]:
        ordered = sorted(rounds, key=lambda r: r[name]["step_ms"])
        runs[name] = dict(ordered[len(ordered) // 2][name])
        if len(rounds) > 1:
            runs[name]["paired_speedup"] = statistics.median(r["sync"]["step_ms"] / r[name]["step_ms"]
                                                             for r in rounds)
            runs[name]["step_ms_rounds"] = [r[name]["step_ms"] for r in rounds]
    return runs


def check_losses(out: dict) -> None:
    """Domino's losses equal sync's within fp32 rounding; end to end, each layout's are the same bit for bit on
    every link (in ``steps`` mode the models keep training from one link to the next, so only the former)."""
    first, worst = {}, 0.0
    for setting in out["settings"].values():
        sync = setting["runs"]["sync"]["losses"]
        for name, r in setting["runs"].items():
            worst = max([worst] + [abs(a - b) / abs(b) for a, b in zip(r["losses"], sync)])
            # Runs of another length had another --train-iters, hence another learning-rate schedule (slow
            # links run fewer iterations): compare each with the runs of its own length only.
            reference = first.setdefault((name, len(r["losses"])), r["losses"])
            if out["mode"] == "pretrain" and r["losses"] != reference:
                raise SystemExit(f"losses of {name} on link {setting['network']!r} differ from its other runs")
    out["losses"] = {"same_on_every_link_bitwise": out["mode"] == "pretrain", "domino_vs_sync_max_rel_diff": worst}


def print_tables(out: dict) -> None:
    print(f"TP=2 x CP={CP}, {LAYERS} layers / hidden {HIDDEN} / seq {SEQ} / micro-batch {MICRO_BATCH}, fp32, "
          f"{2 * CP} processes x "
          f"1 thread; {out['wire_bytes_per_step'] / 2**20:.2f} MiB sent per rank per step; synchronous compute "
          f"{out['sync_compute_ms']:.0f} ms/step")
    print(f"real ratios: 16 (n-1) F / (3 B (24 h + 4 s)), n={REAL_TP}, h={REAL_H}, s={REAL_S}, "
          f"F={H100_BF16_FLOPS / 1e12:.0f} TFLOP/s: NVLink B={NVLINK_BYTES_S / 1e9:.0f} GB/s -> "
          f"{real_ratio(NVLINK_BYTES_S):.2f}; IB B={IB400_BYTES_S / 1e9:.0f} GB/s -> {real_ratio(IB400_BYTES_S):.2f}")
    print(f"mode {out['mode']}; speed-up = sync median step / this median step (paired: median of back-to-back "
          f"step pairs, steps mode)")
    print(f"{'setting':<16} {'ratio':>5} {'layout':<9} {'step ms':>8} {'speed-up':>8} {'paired':>7} {'blocked ms':>10} "
          f"{'blocked %':>9} {'modelled ms':>11} {'hidden':>7}")
    for setting, s in out["settings"].items():
        sync = s["runs"]["sync"]["step_ms"]
        for name, r in s["runs"].items():
            ratio = f"{s['ratio']:.2f}" if s["ratio"] is not None else "-"
            hidden = f"{100 * r['hidden_fraction']:.0f}%" if r["hidden_fraction"] is not None else "-"
            paired = f"{r['paired_speedup']:.2f}x" if "paired_speedup" in r else "-"
            print(f"{setting:<16} {ratio:>5} {name:<9} {r['step_ms']:>8.0f} {sync / r['step_ms']:>7.2f}x {paired:>7} "
                  f"{r['blocked_ms']:>10.1f} {100 * r['blocked_share']:>8.1f}% {r['modelled_ms']:>11.1f} {hidden:>7}")
    same = "each layout's are bit for bit the same on every link; " if out["losses"]["same_on_every_link_bitwise"] else ""
    print(f"losses: {same}Domino vs sync max relative difference {out['losses']['domino_vs_sync_max_rel_diff']:.1e}")


def print_breakdown(out: dict) -> None:
    """Per link and layout: compute (step - blocked) vs sync's, then blocked ms per kind of call site (the label
    up to its first comma, e.g. ``fwd mlp``), per layer position and chunk, and the largest single sites."""
    for setting, s in out["settings"].items():
        sync_compute = s["runs"]["sync"]["compute_ms"]
        for name, r in s["runs"].items():
            sites = r["blocked_by_site_ms"]
            print(f"\n{setting} / {name}: compute {r['compute_ms']:.1f} ms ({r['compute_ms'] / sync_compute:.2f}x "
                  f"sync's), blocked {r['blocked_ms']:.1f} ms (median; mean of the sites below "
                  f"{sum(sites.values()):.1f})")
            for title, key in (("kind", lambda site: site.split(",")[0]),
                               ("layer, chunk", lambda site: ",".join(site.split(",")[1:]).strip() or "-")):
                groups = {}
                for site, ms in sites.items():
                    groups[key(site)] = groups.get(key(site), 0.0) + ms
                print(f"  by {title}: " + "; ".join(f"{k} {v:.1f}" for k, v in
                                                    sorted(groups.items(), key=lambda kv: -kv[1])))
            top = sorted(sites.items(), key=lambda kv: -kv[1])[:6]
            print("  largest: " + "; ".join(f"{k} {v:.1f}" for k, v in top))

if __name__ == "__main__":
    main()
