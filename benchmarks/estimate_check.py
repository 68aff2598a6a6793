"""How close ``domino estimate`` is to measured tensor memory, on small GPT configs on CPU (fp32, TP=1).

For each config, a fresh ``GPTModel`` trains two steps with AdamW under
:class:`~domino.train.memory_probe.LiveTensorBytes` (a dispatch mode counting live tensor storages). Two numbers
are compared with :func:`domino.config.estimate.estimate_layout` (``device="cpu"``):

* **forward**: bytes the first forward adds (activations + logits + the QKV weight copies) vs the estimate's
  ``activations + logits + buffers``;
* **peak**: the most bytes alive over the two steps (weights, AdamW state, activations, gradients) vs ``total``.

A second table does the same for each activation-recompute setting of one config (dropout on): the forward
keeps less, and the peak moves into backward, where one recomputed group is alive at a time. A third measures
that config per TP rank at TP=2 (two gloo processes): plain TP, Domino, sequence parallelism, recompute. A fourth
measures the peak of each stage of 1F1B at PP=2 (the same two processes, ``StageSchedule``, no dropout) against
the estimate's per-stage totals. A fifth measures context parallelism at CP 2 and CP 4 (as many gloo processes,
each training on its ``seq / CP`` tokens): the ring (p2p) and the all-to-all (a2a), with and without attention
dropout, MHA and GQA, where the peak holds one layer's attention at work (its key/value and gradient buffers,
one block's scores, the exchange buffers: ``attention_transient_bytes``).

Memory is deterministic, so one run suffices. Usage::

    python benchmarks/estimate_check.py [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from domino.config import DominoConfig, ModelConfig
from domino.config.estimate import Layout, estimate_layout
from domino.model.recompute import RecomputePlan
from domino.runtime import state
from domino.runtime.mesh import ParallelMesh
from domino.train.memory_probe import measure_pipeline_training_memory, measure_training_memory

CONFIGS = [
    # (layers, hidden, heads, seq, micro-batch, vocab, hidden dropout, attention dropout)
    (2, 128, 4, 256, 4, 1024, 0.1, 0.1),
    (2, 128, 4, 256, 4, 1024, 0.0, 0.0),
    (2, 128, 4, 256, 4, 1024, 0.1, 0.0),
    (4, 256, 8, 128, 2, 4096, 0.1, 0.0),
    (2, 64, 4, 64, 4, 512, 0.0, 0.0),
    (6, 192, 6, 512, 1, 2048, 0.1, 0.1),
    (3, 384, 6, 128, 8, 8192, 0.0, 0.0),
]


RECOMPUTE_CONFIG = (4, 128, 4, 256, 4, 1024, 0.1, 0.1)
RECOMPUTE = {"none": None, "selective": RecomputePlan("selective"),
             "full uniform 1": RecomputePlan("full", "uniform", 1),
             "full uniform 2": RecomputePlan("full", "uniform", 2),
             "full block 2": RecomputePlan("full", "block", 2)}


def check(layers, hidden, heads, seq, batch, vocab, hidden_dropout, attention_dropout, plan=None, tp=1, chunks=1,
          sp=False, mesh=ParallelMesh.single()) -> dict:
    config = DominoConfig(model=ModelConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=seq, vocab_size=vocab,
        hidden_dropout=hidden_dropout, attention_dropout=attention_dropout, make_vocab_size_divisible_by=1))
    forward, peak = measure_training_memory(config.model, vocab, batch, recompute=plan, domino_chunks=chunks,
                                            sequence_parallel=sp, mesh=mesh)
    layout = Layout(tensor_model_parallel_size=tp, micro_batch_size=batch, zero_stage=0, sequence_parallel=sp,
                    domino_chunks=chunks)
    if plan is not None:
        layout.recompute = plan.granularity
        layout.recompute_method, layout.recompute_num_layers = plan.method or "uniform", plan.num_layers or 1
    est = estimate_layout(config, layout, device="cpu")
    est_forward = est.activations + est.logits + est.buffers
    name = f"L{layers} h{hidden} a{heads} s{seq} b{batch} V{vocab} drop {hidden_dropout}/{attention_dropout}"
    return {"config": name,
            "forward_mib": forward / 2**20, "forward_est_mib": est_forward / 2**20,
            "forward_error": est_forward / forward - 1, "peak_mib": peak / 2**20,
            "peak_est_mib": est.total / 2**20, "peak_error": est.total / peak - 1}


TP_SETTINGS = {  # name: (domino chunks, sequence parallel, recompute plan)
    "TP2": (1, False, None), "TP2 Domino 2": (2, False, None), "TP2 Domino 2 SP": (2, True, None),
    "TP2 Domino 2 SP selective": (2, True, RecomputePlan("selective")),
    "TP2 Domino 2 full uniform 1": (2, False, RecomputePlan("full", "uniform", 1)),
}


def _tp2_worker(rank, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = state.initialize_model_parallel(2)
    rows = []
    for name, (chunks, sp, plan) in TP_SETTINGS.items():
        row = check(*RECOMPUTE_CONFIG, plan=plan, tp=2, chunks=chunks, sp=sp, mesh=mesh)
        rows.append(dict(row, config=name))
    mesh = state.initialize_model_parallel(1, pipeline_model_parallel_size=2)
    stages = [measure_pipeline_training_memory(ModelConfig(**PIPELINE_MODEL), PIPELINE_MODEL["vocab_size"], micro,
                                               count, mesh=mesh) for micro, count in PIPELINE_RUNS]
    torch.save((rows, stages), os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


#: The pipeline runs: 4 layers without dropout, (micro-batch, micro-batches per step).
PIPELINE_MODEL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=128, vocab_size=512,
                      make_vocab_size_divisible_by=1, hidden_dropout=0.0, attention_dropout=0.0)
PIPELINE_RUNS = [(2, 4), (4, 2), (1, 8)]


def pipeline_rows(measured) -> list:
    """Per PP run and stage: the measured peak against the estimate's stage total."""
    rows = []
    for run, (micro, count) in enumerate(PIPELINE_RUNS):
        config = DominoConfig(model=ModelConfig(**PIPELINE_MODEL)).replace(micro_batch_size=micro,
                                                                           global_batch_size=micro * count)
        est = estimate_layout(config, Layout(micro_batch_size=micro, zero_stage=0, pipeline_model_parallel_size=2),
                              device="cpu")
        for stage in range(2):
            peak = measured[stage][run]
            rows.append({"config": f"PP2 stage {stage}, b{micro} x {count} micro-batches", "forward_mib": None,
                         "peak_mib": peak / 2**20, "peak_est_mib": est.stage_totals[stage] / 2**20,
                         "peak_error": est.stage_totals[stage] / peak - 1})
    return rows


def two_process_rows() -> tuple:
    """The TP=2 settings, measured on rank 0 of two gloo processes, and the PP=2 runs' rows."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_tp2_worker, args=(port, out_dir), nprocs=2, join=True, start_method="spawn")
        ranks = [torch.load(os.path.join(out_dir, f"rank{rank}.pt")) for rank in range(2)]
    return ranks[0][0], pipeline_rows([stages for _, stages in ranks])


#: The context-parallel runs: a 2-layer model at 1024 tokens, micro-batch 2, no hidden dropout;
#: (CP size, comm type, attention dropout, key/value heads of 4).
CP_MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=1024, vocab_size=512,
                make_vocab_size_divisible_by=1, hidden_dropout=0.0)
CP_RUNS = [(cp, comm, drop, groups) for cp in (2, 4) for comm, drop, groups in (
    ("p2p", 0.0, 4), ("a2a", 0.0, 4), ("p2p", 0.1, 4), ("a2a", 0.1, 4), ("p2p", 0.0, 2))]


def _cp_worker(rank, port, out_dir, cp):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(cp))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    mesh = state.initialize_model_parallel(1, context_parallel_size=cp)
    rows = []
    for size, comm, drop, groups in CP_RUNS:
        if size != cp:
            continue
        model = ModelConfig(**CP_MODEL, attention_dropout=drop, group_query_attention=groups < 4,
                            num_query_groups=groups)
        forward, peak = measure_training_memory(model, model.vocab_size, 2, mesh=mesh, cp_comm_type=comm)
        config = DominoConfig(model=model).replace(cp_comm_type=comm)
        est = estimate_layout(config, Layout(micro_batch_size=2, zero_stage=0, context_parallel_size=cp),
                              device="cpu")
        rows.append({"config": f"CP{cp} {comm}, attention dropout {drop}, {groups} KV heads",
                     "forward_mib": forward / 2**20, "peak_mib": peak / 2**20, "peak_est_mib": est.total / 2**20,
                     "attention_est_mib": est.attention / 2**20, "peak_error": est.total / peak - 1})
    if rank == 0:
        torch.save(rows, os.path.join(out_dir, f"cp{cp}.pt"))
    dist.destroy_process_group()


def context_parallel_rows() -> list:
    """The CP runs, measured on rank 0 of CP gloo processes."""
    rows = []
    for cp in (2, 4):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.TemporaryDirectory() as out_dir:
            mp.start_processes(_cp_worker, args=(port, out_dir, cp), nprocs=cp, join=True, start_method="spawn")
            rows += torch.load(os.path.join(out_dir, f"cp{cp}.pt"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [check(*c) for c in CONFIGS]
    recompute = [dict(check(*RECOMPUTE_CONFIG, plan=plan), config=name) for name, plan in RECOMPUTE.items()]
    tp2, pp2 = two_process_rows()
    cp = context_parallel_rows()
    if args.json:
        print(json.dumps({"configs": rows, "recompute": recompute, "tp2_rank0": tp2, "pp2_stages": pp2,
                          "context_parallel_rank0": cp}, indent=2))
        return
    _table(rows)
    layers, hidden, heads, seq = RECOMPUTE_CONFIG[:4]
    print(f"\nactivation recompute (peak only: the estimate counts the block recomputed in backward), L{layers} "
          f"h{hidden} a{heads} s{seq} b{RECOMPUTE_CONFIG[4]} V{RECOMPUTE_CONFIG[5]}, dropout 0.1/0.1:")
    _table(recompute, peak_only=True)
    print("\nsame config at TP=2, rank 0 of 2 gloo processes (peak only):")
    _table(tp2, peak_only=True)
    print("\n1F1B at PP=2, each stage of 2 gloo processes, L4 h64 a4 s128 V512, no dropout (peak only):")
    _table(pp2, peak_only=True)
    print("\ncontext parallelism, rank 0 of CP gloo processes, L2 h64 a4 s1024 b2 V512, no hidden dropout (peak "
          "only; kept after forward in the fwd column):")
    _table(cp, peak_only=True)


def _table(rows, peak_only: bool = False) -> None:
    print(f"{'config':44s} {'fwd MiB':>8s} {'est':>8s} {'err':>7s} {'peak MiB':>9s} {'est':>8s} {'err':>7s}")
    for r in rows:
        forward = ("" if peak_only else f"{r['forward_est_mib']:8.2f} {r['forward_error']:+7.1%}").rjust(16)
        measured = "-" if r["forward_mib"] is None else f"{r['forward_mib']:.2f}"
        print(f"{r['config']:44s} {measured:>8s} {forward} "
              f"{r['peak_mib']:9.2f} {r['peak_est_mib']:8.2f} {r['peak_error']:+7.1%}")
    worst = max(max(0 if peak_only else abs(r["forward_error"]), abs(r["peak_error"])) for r in rows)
    print(f"largest error: {worst:.1%}")


if __name__ == "__main__":
    main()
