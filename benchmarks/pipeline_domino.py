"""Domino under pipeline parallelism: TP 2 x PP 2 on 4 processes, synchronous TP against Domino 2 chunks, on the
emulated links of ``benchmarks/overlap.py``.

One group of 4 gloo processes (one thread each; Megatron's rank order, ranks 0-1 the first stage's TP pair,
2-3 the last's) builds the same GPT as ``benchmarks/overlap.py`` (4 layers, 2 per stage; hidden 512, seq 128,
vocabulary 2048, fp32, no dropout) once per layout: synchronous TP and Domino 2 chunks, and both again with
sequence parallelism (``--no-sequence-parallel`` leaves those out). Each layout is this rank's stage cut by
:func:`domino.pipeline.stages.split_model` with sequence parallelism and Domino applied after, as
``domino pretrain`` builds it, on domino's 1F1B :class:`domino.pipeline.schedule.StageSchedule` with the same
micro-batches per step (``--micro-batches``, default 4, of ``--micro-batch-size`` 4), then the tied embeddings'
gradient sum and AdamW. The layouts' training steps alternate, so that every layout sees the same background
load, first on real gloo only, then on each emulated link (``--settings``, the names of ``overlap.SETTINGS``).

The link is :class:`domino.runtime.network_emulator.LinkEmulator` on the TP collectives only (the pipeline's
point-to-point transfers and the tied-embedding sum are not emulated), calibrated as ``overlap.py`` calibrates it
(:func:`overlap.network_for`): its time per synchronous step is ``r`` x the synchronous stages' computation on
real gloo (time in the stages' forward and backward minus the time blocked in TP collectives), both summed over
the 4 ranks, with the bytes and collectives each rank sends counted in the first (untimed) synchronous step, on a
link that sleeps nothing. One link for every layout: sequence parallelism sends more over it (its backward
all-gathers again), Domino the same bytes in more collectives.

Per link and layout it prints: the step (median over steps of the slowest rank's, barrier to barrier), the
speed-up against synchronous TP (medians, and paired: the median of back-to-back steps' ratios), and per stage
(the mean of its two TP ranks): the time blocked in TP collectives (``comm-wait``), the modelled link time, the
hidden fraction ``1 - blocked / modelled``, and the pipeline's idle share ``1 - busy / schedule`` where busy is
the time in torch's ``forward_one_chunk`` and ``backward_one_chunk`` (TP waits included: they are inside) and
schedule the wall time of the 1F1B step (as ``benchmarks/pipeline_bubble.py`` measures it), against the formula
``(p - 1) / (m + p - 1)``; then the losses, Domino and sequence parallelism against synchronous TP.

Four processes share 2 cores on the development machine: a rank waiting on the emulated link (which sleeps)
or in the bubble leaves its core to another stage's rank, and synchronous TP waits more, so it may gain more
from that. Run it on a machine with a core per process for figures to quote.

    python benchmarks/pipeline_domino.py [--quick] [--steps 6] [--micro-batches 4] [--micro-batch-size 4]
                                         [--settings "NVLink, TP=8" ...] [--no-sequence-parallel]
                                         [--transfer launch|wait] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
import overlap  # noqa: E402
from pipeline_bubble import time_stage_compute  # noqa: E402

from domino.config import ModelConfig  # noqa: E402
from domino.config.pipeline_schedule import bubble_fraction  # noqa: E402
from domino.model import GPTModel  # noqa: E402
from domino.overlap.schedule import apply_domino  # noqa: E402
from domino.overlap.sequence_parallel import apply_sequence_parallel  # noqa: E402
from domino.pipeline.gradients import sync_tied_embeddings  # noqa: E402
from domino.pipeline.schedule import StageSchedule  # noqa: E402
from domino.pipeline.stages import split_model  # noqa: E402
from domino.runtime import comm_timing, state  # noqa: E402
from domino.runtime.network_emulator import LinkEmulator, LinkSpec, parse_spec  # noqa: E402

TP, PP = 2, 2
WORLD = TP * PP
#: name -> (Domino chunks, sequence parallelism)
LAYOUTS = {"sync": (1, False), "Domino 2": (2, False), "sync + SP": (1, True), "Domino 2 + SP": (2, True)}


@dataclass(frozen=True)
class Shape:
    """The benchmark's model (``benchmarks/overlap.py``'s) and step: 4 micro-batches of 4, twice the samples of
    overlap.py's one micro-batch of 8, so that a Domino chunk (2 samples, 256 tokens) is half of overlap.py's."""

    layers: int = overlap.LAYERS
    hidden: int = overlap.HIDDEN
    seq: int = overlap.SEQ
    vocab: int = overlap.VOCAB
    micro_batch_size: int = 4
    micro_batches: int = 4
    steps: int = 6
    warmup: int = 1

    @property
    def heads(self) -> int:
        return self.hidden // overlap.HEAD_DIM


#: ``--quick``: a tiny run that goes through every part (not a measurement; 20-60 s, mostly 5 processes starting).
QUICK = Shape(hidden=128, seq=32, vocab=256, micro_batch_size=2, micro_batches=2, steps=2, warmup=1)


class CountingLink(LinkEmulator):
    """A link that sleeps nothing and counts what the TP collectives launched on it send (the calibration)."""

    def __init__(self) -> None:
        super().__init__(LinkSpec(latency_us=0.0, gbps=1.0), sleep=lambda seconds: None)
        self.wire_bytes, self.collectives = 0.0, 0

    def launch(self, wire_bytes: float) -> float:
        self.wire_bytes += wire_bytes
        self.collectives += 1
        return super().launch(wire_bytes)


class Layout:
    """One layout's stage on this rank: the model, its 1F1B schedule, its optimizer and its timer."""

    def __init__(self, shape: Shape, chunks: int, sequence_parallel: bool, mesh) -> None:
        torch.manual_seed(0)  # every layout starts from the same weights
        config = ModelConfig(num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
                             seq_length=shape.seq, hidden_dropout=0.0, attention_dropout=0.0)
        self.mesh = mesh  # its TP group's link (a setting's) and comm timer are this layout's
        model = split_model(GPTModel(config, shape.vocab, tp=mesh.tp), mesh.pp.rank, PP)
        if sequence_parallel:
            apply_sequence_parallel(model)
        self.model = apply_domino(model, chunks)
        self.pipeline = StageSchedule(self.model, mesh.pp, num_microbatches=shape.micro_batches,
                                      micro_batch_size=shape.micro_batch_size, seq_length=shape.seq,
                                      hidden_size=shape.hidden, sequence_parallel=sequence_parallel)
        self.busy = time_stage_compute(self.pipeline.stages)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4, fused=True)

    def step(self, batch) -> Dict[str, float]:
        """One training step between barriers: its times on this rank (ms) and the step's loss."""
        dist.barrier()
        self.mesh.tp.timer.pop_seconds(), comm_timing.pop_modelled_comm_seconds(self.mesh.tp.link)
        self.busy[0] = 0.0
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.pipeline.train_step(*batch)
        scheduled = time.perf_counter()
        sync_tied_embeddings(self.model, self.mesh)
        self.optimizer.step()
        dist.barrier()  # the step ends with the slowest rank's
        ended = time.perf_counter()
        return {"step_ms": 1000 * (ended - started), "schedule_ms": 1000 * (scheduled - started),
                "busy_ms": 1000 * self.busy[0], "blocked_ms": 1000 * self.mesh.tp.timer.pop_seconds(),
                "modelled_ms": 1000 * comm_timing.pop_modelled_comm_seconds(self.mesh.tp.link), "loss": loss.item()}


def _worker(rank: int, port: int, shape: Shape, layouts: List[str], settings: List[str], transfer: str,
            out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    mesh = state.initialize_model_parallel(TP, pipeline_model_parallel_size=PP)
    g = torch.Generator().manual_seed(0)
    samples = shape.micro_batches * shape.micro_batch_size
    tokens, labels = (torch.randint(0, shape.vocab, (samples, shape.seq), generator=g) for _ in range(2))
    batch = (tokens, labels, torch.ones(samples, shape.seq))
    out = {"rank": rank, "stage": mesh.pp.rank, "settings": {}}
    # The calibration's TP bytes and collectives: one step of the synchronous layout on a counting link.
    counting = Layout(shape, *LAYOUTS["sync"], mesh.with_tp_link(CountingLink()))
    counting.step(batch)
    out["counted"] = counting.mesh.tp.link
    del counting
    for setting in ["real gloo only", *settings]:
        network = "" if setting == "real gloo only" else overlap.network_for(
            overlap.SETTINGS[setting], out["sync_compute_ms"], transfer, out["wire_bytes"], out["collectives"])
        link = LinkEmulator(parse_spec(network)) if network else None
        # Each setting's layouts are built over the mesh with its link (the same weights every time).
        runs = {name: Layout(shape, *LAYOUTS[name], mesh.with_tp_link(link)) for name in layouts}
        if rank == 0:
            print(f"built {len(runs)} layouts", file=sys.stderr, flush=True)
        for n in range(shape.warmup):
            for name in layouts:
                runs[name].step(batch)
        records = {name: [] for name in layouts}
        for _ in range(shape.steps):
            for name in layouts:  # alternating: every layout sees the same background load
                records[name].append(runs[name].step(batch))
        out["settings"][setting] = {"network": network, "records": records}
        if not network:
            out.update(_calibration(out.pop("counted"), records["sync"]))
        if rank == 0:  # progress, so that a run stopped early still shows where it was
            print(f"done: {setting} ({network or 'no emulated link'})", file=sys.stderr, flush=True)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _calibration(link: CountingLink, records: List[Dict[str, float]]) -> Dict[str, float]:
    """What calibrates the links, the same on every rank: the synchronous layout's computation on real gloo
    (busy - blocked, median) and what ``link`` counted of its first warm-up step (TP bytes and collectives), each
    summed over the ranks."""
    compute = statistics.median(r["busy_ms"] - r["blocked_ms"] for r in records)
    totals = torch.tensor([compute, link.wire_bytes, link.collectives], dtype=torch.float64)
    dist.all_reduce(totals)
    return {"sync_compute_ms": totals[0].item(), "wire_bytes": totals[1].item(),
            "collectives": round(totals[2].item())}


def run(shape: Shape, layouts: List[str], settings: List[str], transfer: str) -> Dict:
    """Runs the 4 processes; returns every rank's records."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(port, shape, layouts, settings, transfer, out_dir), nprocs=WORLD,
                           join=True, start_method="spawn")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(WORLD)]


def summarize(ranks: List[Dict], shape: Shape) -> Dict:
    """Per link and layout: the step, speed-ups, and per stage the blocked, modelled, hidden and idle figures."""
    out = {"shape": asdict(shape), "tp": TP, "pp": PP, "cores": os.cpu_count(), "load_average": os.getloadavg(),
           "bubble_formula": bubble_fraction(PP, shape.micro_batches), "settings": {}}
    out.update({k: ranks[0][k] for k in ("sync_compute_ms", "wire_bytes", "collectives")})
    for setting, first in ranks[0]["settings"].items():
        per_rank = [r["settings"][setting]["records"] for r in ranks]
        step = {name: [max(r[name][i]["step_ms"] for r in per_rank) for i in range(shape.steps)]
                for name in first["records"]}
        rows = {}
        for name, steps in step.items():
            stages = []
            for s in range(PP):
                mine = [records[name] for r, records in zip(ranks, per_rank) if r["stage"] == s]
                blocked, modelled, idle = (_stage_median(mine, value) for value in (
                    lambda x: x["blocked_ms"], lambda x: x["modelled_ms"],
                    lambda x: 1 - x["busy_ms"] / x["schedule_ms"]))
                stages.append({"blocked_ms": blocked, "modelled_ms": modelled, "pipeline_idle": idle,
                               "hidden_fraction": 1 - blocked / modelled if modelled else None})
            rows[name] = {"step_ms": statistics.median(steps), "stages": stages,
                          "speedup": statistics.median(step["sync"]) / statistics.median(steps),
                          "paired_speedup": statistics.median(a / b for a, b in zip(step["sync"], steps)),
                          "losses": [x["loss"] for x in per_rank[0][name]]}
        out["settings"][setting] = {"network": first["network"], "ratio": overlap.SETTINGS.get(setting),
                                    "runs": rows}
    out["losses_max_rel_diff_vs_sync"] = _loss_differences(out)
    return out


def _stage_median(ranks: List[List[Dict[str, float]]], value) -> float:
    """The mean over a stage's TP ranks of the median over steps of ``value(step record)``."""
    return statistics.mean(statistics.median(value(x) for x in steps) for steps in ranks)


def _loss_differences(out: Dict) -> Dict[str, float]:
    """Each layout's largest relative loss difference from synchronous TP's over the same steps (the models train
    on from one link to the next, each layout through the same steps)."""
    worst: Dict[str, float] = {}
    for setting in out["settings"].values():
        sync = setting["runs"]["sync"]["losses"]
        for name, r in setting["runs"].items():
            diffs = [abs(a - b) / abs(b) for a, b in zip(r["losses"], sync)]
            worst[name] = max([worst.get(name, 0.0)] + diffs)
    return worst


def print_table(out: Dict) -> None:
    """The figures as the markdown table of ``benchmarks/RESULTS.md``."""
    sh = out["shape"]
    print(f"TP {TP} x PP {PP} ({WORLD} processes x 1 thread, {out['cores']} cores, load average "
          f"{out['load_average'][0]:.1f} at the end), GPT {sh['layers']} layers ({sh['layers'] // PP} per stage) / "
          f"hidden {sh['hidden']} / seq {sh['seq']} / vocab {sh['vocab']}, fp32, {sh['micro_batches']} micro-batches "
          f"of {sh['micro_batch_size']} per step (1F1B); {sh['steps']} timed steps per layout after {sh['warmup']} "
          f"warm-up; synchronous TP sends {out['wire_bytes'] / WORLD / 2**20:.2f} MiB per rank per step in "
          f"{out['collectives'] / WORLD:.0f} collectives (means over the ranks); its stages compute {out['sync_compute_ms'] / WORLD:.0f} ms "
          f"per rank and step")
    print()
    print(f"| link (r) | layout | step | speed-up (medians / paired) | blocked in TP collectives, stage 0 / 1 | "
          f"modelled, stage 0 / 1 | hidden, stage 0 / 1 | pipeline idle, stage 0 / 1 "
          f"(formula {out['bubble_formula']:.3f}) |")
    print("|---|---|---|---|---|---|---|---|")
    for setting, s in out["settings"].items():
        link = setting if s["ratio"] is None else (
            f"{setting} ({s['ratio']:.2f}), {parse_spec(s['network']).gbps:.3g} GB/s")
        for name, r in s["runs"].items():
            st = r["stages"]
            hidden = " / ".join("-" if x["hidden_fraction"] is None else f"{100 * x['hidden_fraction']:.0f}%"
                                for x in st)
            print(f"| {link} | {name} | {r['step_ms']:,.0f} ms | {r['speedup']:.2f}x / {r['paired_speedup']:.2f}x | "
                  + " / ".join(f"{x['blocked_ms']:,.0f}" for x in st) + " ms | "
                  + " / ".join(f"{x['modelled_ms']:,.0f}" for x in st) + f" ms | {hidden} | "
                  + " / ".join(f"{x['pipeline_idle']:.3f}" for x in st) + " |")
    print()
    print("losses, max relative difference from synchronous TP's: " + "; ".join(
        f"{name} {diff:.1e}" for name, diff in out["losses_max_rel_diff_vs_sync"].items() if name != "sync"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model and 2 steps: checks that every part runs (no figures)")
    parser.add_argument("--steps", type=int, help=f"timed steps per layout and link (default {Shape.steps})")
    parser.add_argument("--micro-batches", type=int, help=f"micro-batches per step (default {Shape.micro_batches})")
    parser.add_argument("--micro-batch-size", type=int,
                        help=f"samples per micro-batch (default {Shape.micro_batch_size})")
    parser.add_argument("--settings", nargs="*", default=["NVLink, TP=8"], choices=list(overlap.SETTINGS),
                        help="emulated links, after real gloo (default: the NVLink one)")
    parser.add_argument("--no-sequence-parallel", action="store_true", help="leave out the sequence-parallel layouts")
    parser.add_argument("--transfer", choices=("launch", "wait"), default="launch",
                        help="when gloo moves an asynchronous collective's data on the link (overlap.py --transfer)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    shape = QUICK if args.quick else Shape()
    given = {"steps": args.steps, "micro_batches": args.micro_batches, "micro_batch_size": args.micro_batch_size}
    shape = replace(shape, **{k: v for k, v in given.items() if v is not None})
    if shape.micro_batches < PP or shape.steps < 1 or shape.micro_batch_size % 2:
        raise SystemExit(f"--micro-batches must be >= {PP} (1F1B), --steps >= 1, --micro-batch-size even (2 chunks)")
    layouts = [name for name, (_, sp) in LAYOUTS.items() if not (sp and args.no_sequence_parallel)]
    out = summarize(run(shape, layouts, args.settings, args.transfer), shape)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print_table(out)


if __name__ == "__main__":
    main()
