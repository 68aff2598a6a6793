"""Training throughput of the domino GPT against a plain PyTorch GPT, and Domino against synchronous TP=2.

Measures tokens/s of full training steps (forward, backward, AdamW step; fp32) for a GPT of 4 layers,
hidden 256, 4 heads, sequence 256, micro-batch 8, vocabulary 8192:

* ``domino`` - our ``GPTModel`` on one process (TP=1), ``torch.optim.AdamW(fused=True)``.
* ``plain`` - the strongest simple PyTorch GPT of the same shape and the same maths we could write (one fused
  QKV ``nn.Linear``, ``F.scaled_dot_product_attention(is_causal=True)``, tied output layer, ``F.cross_entropy``
  on the logits, ``torch.optim.AdamW(fused=True)``), no dropout on either side, measured in the same run,
  alternating with ``domino``.
* ``tp2_sync`` / ``tp2_domino`` - 2 gloo processes, TP=2, synchronous vs Domino with 2 chunks.

It also reports the peak tensor memory of one (first) training step of each single-process model, from the
profiler's allocation record.

Where our single-process speed comes from (all of it is ordinary engineering, none of it changes the maths;
a one-thread profile puts ~80% of either step in GEMMs, which both models run with the same shapes):

* the output layer fused with the cross-entropy: the logits buffer becomes the softmax and then the gradient
  in place (plain allocates log-softmax, its gradient and the one-hot difference), it is kept from one step to
  the next instead of being mapped (and zero-filled) afresh by the OS, the upstream per-token gradient
  scales the ``[tokens, h]`` operands of the backward GEMMs instead of the ``[tokens, V]`` gradient, and at TP=1
  the loss is read from the softmax (``-log p_target``) with no extra pass over the logits;
* q, k and v computed from the fused QKV parameter as three dense products, so attention reads and returns
  dense tensors and autograd does not re-interleave their gradients (and three ``h``-wide GEMMs run faster
  than one ``3h``-wide one on CPU);
* GeLU fused into fc2's autograd node, whose backward reuses the saved activation's buffer for both gradients
  (no ``[tokens, 4h]`` allocations in the MLP's backward), and at TP=1 the row-parallel biases added by the GEMM;

The machine may be shared: configurations alternate step by step after warm-up steps; tokens/s are medians
(and bests) over repeats, and ratios are medians of back-to-back pairs, which cancels slow load drift.

Usage::

    python benchmarks/model_step.py [--repeats 8] [--steps 1] [--threads N] [--tp-threads N] [--json]
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

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from domino.config import ModelConfig  # noqa: E402
from domino.model import GPTModel  # noqa: E402
from domino.overlap.schedule import apply_domino  # noqa: E402
from domino.runtime import state  # noqa: E402

LAYERS, HIDDEN, HEADS, SEQ, BATCH, VOCAB = 4, 256, 4, 256, 8, 8192


def model_config() -> ModelConfig:
    return ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=SEQ,
                       hidden_dropout=0.0, attention_dropout=0.0)


class PlainBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)  # one fused GEMM, output columns [q | k | v]
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.fc1, self.fc2 = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, HEADS, -1).permute(2, 0, 3, 1, 4)  # 3 x [b, heads, s, d]
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, HIDDEN)
        x = x + self.proj(ctx)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class PlainGPT(nn.Module):
    """The reference: how one writes this GPT in plain PyTorch."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(SEQ, HIDDEN)
        self.blocks = nn.ModuleList(PlainBlock() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(HIDDEN)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _ours_step(model, opt, tokens, labels):
    opt.zero_grad(set_to_none=True)
    model(tokens, labels=labels).mean().backward()
    opt.step()


def _plain_step(model, opt, tokens, labels):
    opt.zero_grad(set_to_none=True)
    model(tokens, labels).backward()
    opt.step()


def _time_steps(step, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def first_step_peak_mib(step) -> float:
    """Peak tensor memory (MiB) allocated during ``step``, from the profiler's allocation record.

    Run on a fresh model and optimizer, so it counts everything training adds on top of the parameters:
    activations, gradients, temporaries, the optimizer state created on the first step and, for domino, the
    logits buffer it keeps for the next step.
    """
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage  # bytes allocated minus freed inside this op
        peak = max(peak, live)
    return peak / 2**20


def _fresh_single_process_steps() -> dict:
    """``{"domino": step, "plain": step}``: fresh models and optimizers, same seed and batch, one step per call."""
    tokens, labels = _batch()
    torch.manual_seed(0)
    ours = GPTModel(model_config(), VOCAB)
    ours_opt = torch.optim.AdamW(ours.parameters(), lr=1e-4, fused=True)
    torch.manual_seed(0)
    plain = PlainGPT()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, fused=True)
    return {"domino": lambda: _ours_step(ours, ours_opt, tokens, labels),
            "plain": lambda: _plain_step(plain, plain_opt, tokens, labels)}


def peak_memory() -> dict:
    """First-step peak memory (MiB) of fresh domino and plain models."""
    return {name: first_step_peak_mib(step) for name, step in _fresh_single_process_steps().items()}


def single_process(repeats: int, steps: int, warmup: int) -> dict:
    """Alternates ours and plain so both see the same background load; returns seconds per step lists."""
    runs = _fresh_single_process_steps()
    for step in runs.values():
        _time_steps(step, warmup)
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, step in runs.items():
            times[name].append(_time_steps(step, steps))
    return times


def _tp_worker(rank, world, port, threads, chunks_list, repeats, steps, warmup, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = state.initialize_model_parallel(world)
    tokens, labels = _batch()
    runs = {}
    for chunks in chunks_list:
        torch.manual_seed(0)
        model = apply_domino(GPTModel(model_config(), VOCAB, tp=mesh.tp), chunks)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        runs[chunks] = (lambda m=model, o=opt: _ours_step(m, o, tokens, labels))
    for step in runs.values():
        _time_steps(step, warmup)
    times = {chunks: [] for chunks in runs}
    for _ in range(repeats):
        for chunks, step in runs.items():
            dist.barrier()
            times[chunks].append(_time_steps(step, steps))
    if rank == 0:
        torch.save(times, os.path.join(out_dir, "times.pt"))
    dist.destroy_process_group()


def tensor_parallel(threads: int, repeats: int, steps: int, warmup: int) -> dict:
    """TP=2 synchronous (chunks 1) vs Domino (chunks 2), alternating, on 2 processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_tp_worker, args=(2, port, threads, [1, 2], repeats, steps, warmup, out_dir),
                           nprocs=2, join=True, start_method="spawn")
        times = torch.load(os.path.join(out_dir, "times.pt"))
    return {"tp2_sync": times[1], "tp2_domino": times[2]}


def _paired_ratio(reference: list, candidate: list) -> float:
    """Median over repeats of reference_time / candidate_time, each pair measured back to back.

    On a shared machine the background load drifts between repeats; comparing neighbours cancels most of it.
    """
    return statistics.median(r / c for r, c in zip(reference, candidate))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--repeats", type=int, default=8, help="timed repeats per configuration (median taken)")
    parser.add_argument("--steps", type=int, default=1, help="training steps per timed repeat")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before measuring")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the single-process runs (same for ours and plain)")
    parser.add_argument("--tp-threads", type=int, default=1, help="torch threads per process at TP=2")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    memory = peak_memory()
    times = single_process(args.repeats, args.steps, args.warmup)
    times.update(tensor_parallel(args.tp_threads, args.repeats, args.steps, args.warmup))
    tokens = BATCH * SEQ
    tps = {name: tokens / statistics.median(t) for name, t in times.items()}
    best_tps = {name: tokens / min(t) for name, t in times.items()}
    ratios = {"domino_over_plain": _paired_ratio(times["plain"], times["domino"]),
              "tp2_domino_over_tp2_sync": _paired_ratio(times["tp2_sync"], times["tp2_domino"])}
    result = {"tokens_per_s": tps, "ratios": ratios, "best_tokens_per_s": best_tps, "peak_step_memory_mib": memory,
              "ratios_of_medians": {"domino_over_plain": tps["domino"] / tps["plain"],
                                    "tp2_domino_over_tp2_sync": tps["tp2_domino"] / tps["tp2_sync"]},
              "seconds_per_step": times,
              "shape": dict(layers=LAYERS, hidden=HIDDEN, heads=HEADS, seq=SEQ, micro_batch=BATCH, vocab=VOCAB),
              "threads": {"single_process": args.threads, "per_tp_rank": args.tp_threads},
              "repeats": args.repeats, "steps_per_repeat": args.steps, "torch": torch.__version__}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"GPT {LAYERS}L/{HIDDEN}h/{HEADS}heads, seq {SEQ}, micro-batch {BATCH}, vocab {VOCAB}; fp32 training "
          f"steps (fwd+bwd+AdamW); median of {args.repeats} x {args.steps} steps")
    rows = [("plain", f"plain PyTorch (fused QKV nn.Linear, SDPA causal, F.cross_entropy, fused AdamW), "
                      f"{args.threads} thr"),
            ("domino", f"domino GPTModel TP=1 (split QKV GEMMs, in-place output+CE, fused GeLU+fc2, "
                       f"fused AdamW), {args.threads} thr"),
            ("tp2_sync", f"domino TP=2 synchronous, 2 procs x {args.tp_threads} thr"),
            ("tp2_domino", f"domino TP=2 Domino 2 chunks, 2 procs x {args.tp_threads} thr")]
    print(f"{'config':<12} {'tokens/s':>10} {'best':>8}  description")
    for name, text in rows:
        print(f"{name:<12} {tps[name]:>10.0f} {best_tps[name]:>8.0f}  {text}")
    print("ratios (median of back-to-back pairs):")
    print(f"  domino / plain            {ratios['domino_over_plain']:.3f}")
    print(f"  tp2_domino / tp2_sync     {ratios['tp2_domino_over_tp2_sync']:.3f}")
    print(f"peak memory of a first training step (activations, gradients, temporaries, optimizer state): "
          f"plain {memory['plain']:.0f} MiB, domino {memory['domino']:.0f} MiB "
          f"({memory['domino'] / memory['plain']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
