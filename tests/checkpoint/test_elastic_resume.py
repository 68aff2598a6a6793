"""Resume on another layout with the exact optimizer state (issue 26, item 2), with real gloo processes.

Each reference run trains 8 iterations on one layout and saves at 4 and 8; a second run resumes its checkpoint 4
on another layout and trains 5-8. Its losses must equal the reference's own iterations 5-8 within fp32
reassociation (1e-4 relative; fp32, no dropout, the same global batch), and the optimizer state it resumed,
gathered to whole tensors on the new layout, must equal the checkpoint's. A control resumed without the
optimizer state (``--no-load-optim``) shows the loss comparison can fail.

Layouts: GPT TP=2 with Domino 2 chunks (ZeRO 0) -> TP=1 x DP=2 ZeRO-1 (the tensor-parallel slices merge, ZeRO
partitions them, the micro-batch count halves, no chunks); GPT DP=2 ZeRO-1 -> ZeRO-2, and -> DP=1; LLaMA TP=2
ZeRO-1 (the state written as each rank's fragments) -> TP=1 x DP=2. A changed global batch is refused in one
line before training; another --make-vocab-size-divisible-by keeps the checkpoint's padding rows.

Without the optimizer state stored by name (format 1), every resume here on another layout was refused.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distributed_helpers import free_port
from train.train_helpers import child_env, run_pretrain, train_losses

from domino.checkpoint import fragment_io
from domino.checkpoint.on_disk import Checkpoint

BASE = ["--mock-data", "--vocab-size", "256", "--log-interval", "1", "--num-workers", "0", "--seed", "7",
        "--train-iters", "8", "--eval-iters", "0", "--eval-interval", "0", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--global-batch-size", "8"]
GPT, LLAMA = ["--preset", "tiny", *BASE], ["--preset", "tiny-llama", *BASE]
TP2 = ["--tensor-model-parallel-size", "2", "--domino-chunks", "2"]
PROBE = Path(__file__).with_name("optimizer_probe.py")


def _reference(tmp: Path, name: str, flags, nproc: int = 2) -> Path:
    """Trains 8 iterations (checkpoints at 4 and 8); returns the save root."""
    save = tmp / name
    run_pretrain([*flags, "--save", str(save), "--save-interval", "4", "--metrics-file", str(tmp / f"{name}.jsonl")],
                 nproc=nproc, timeout=600)
    return save


def _resume(tmp: Path, name: str, reference: Path, flags, nproc: int = 2) -> dict:
    """Resumes ``reference``'s checkpoint 4 with ``flags``; returns the losses of iterations 5-8."""
    run_pretrain([*flags, "--load", str(reference / "iter_0000004"), "--save", str(tmp / name),
                  "--metrics-file", str(tmp / f"{name}.jsonl")], nproc=nproc, timeout=600)
    losses = train_losses(tmp / f"{name}.jsonl")
    assert sorted(losses) == [5, 6, 7, 8], losses  # resumed at iteration 4, not from scratch
    return losses


def _within(resumed: dict, reference: dict, rtol: float = 1e-4) -> bool:
    return all(abs(resumed[i] - reference[i]) <= rtol * abs(reference[i]) for i in resumed)


def _probe(tmp: Path, reference: Path, flags, nproc: int, tag: str = "iter_0000004") -> dict:
    """The optimizer state a run with ``flags`` holds right after resuming ``reference``'s checkpoint ``tag``."""
    out = tmp / "probe.safetensors"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
               "127.0.0.1", "--master-port", str(free_port()), str(PROBE), str(out), *flags,
               "--load", str(reference / tag)]
    proc = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return load_file(str(out))


@pytest.mark.timeout(1500)  # eight torchrun jobs of two processes on a loaded 2-core machine
def test_resume_on_other_layouts_continues_the_losses_and_keeps_the_optimizer_state(tmp_path):
    gpt_tp2 = _reference(tmp_path, "gpt-tp2", [*GPT, *TP2])
    reference = train_losses(tmp_path / "gpt-tp2.jsonl")

    # TP=2 (Domino 2 chunks, ZeRO 0) -> TP=1 x DP=2 ZeRO-1: the optimizer state is the checkpoint's, exactly.
    held = _probe(tmp_path, gpt_tp2, [*GPT, "--zero-stage", "1"], nproc=2)
    saved = fragment_io.read_state(Checkpoint.read(gpt_tp2 / "iter_0000004"))
    assert sorted(held) == sorted(saved) and any(k.startswith("exp_avg_sq.") for k in held)
    for name, tensor in saved.items():
        assert torch.equal(held[name], tensor), name
    resumed = _resume(tmp_path, "gpt-dp2", gpt_tp2, [*GPT, "--zero-stage", "1"])
    assert _within(resumed, reference), (resumed, reference)

    # The control: the same resume with a fresh optimizer leaves the reference's losses.
    control = _resume(tmp_path, "gpt-dp2-fresh-optimizer", gpt_tp2, [*GPT, "--zero-stage", "1", "--no-load-optim"])
    assert not _within(control, reference), (control, reference)

    # DP=2 ZeRO-1 -> ZeRO-2 (gradients partitioned too).
    gpt_zero1 = _reference(tmp_path, "gpt-zero1", [*GPT, "--zero-stage", "1"])
    reference = train_losses(tmp_path / "gpt-zero1.jsonl")
    assert _within(_resume(tmp_path, "gpt-zero2", gpt_zero1, [*GPT, "--zero-stage", "2"]), reference)

    # LLaMA (rotary, SwiGLU, grouped-query attention, untied output) TP=2 ZeRO-1 -> TP=1 x DP=2 ZeRO-1: each TP
    # rank wrote its own fragments (one row per TP rank); the resume joins the rows, row- and column-split alike.
    llama_tp2 = _reference(tmp_path, "llama-tp2", [*LLAMA, *TP2, "--zero-stage", "1"])
    assert Checkpoint.read(llama_tp2 / "iter_0000004").meta["optimizer"]["storage"] == "fragments"
    held = _probe(tmp_path, llama_tp2, [*LLAMA, "--zero-stage", "1"], nproc=2)
    saved = fragment_io.read_state(Checkpoint.read(llama_tp2 / "iter_0000004"))
    assert sorted(held) == sorted(saved) and "exp_avg.layers.0.mlp.dense_4h_to_h.weight" in saved
    for name, tensor in saved.items():
        assert torch.equal(held[name], tensor), name
    reference = train_losses(tmp_path / "llama-tp2.jsonl")
    assert _within(_resume(tmp_path, "llama-dp2", llama_tp2, [*LLAMA, "--zero-stage", "1"]), reference)

    # DP=2 ZeRO-1 -> one process (ZeRO-1 over a data-parallel group of one).
    reference = train_losses(tmp_path / "gpt-zero1.jsonl")
    assert _within(_resume(tmp_path, "gpt-dp1", gpt_zero1, GPT, nproc=1), reference)

    # Another global batch would change what the data position and the schedule count: refused in one line.
    refused = run_pretrain([*GPT[:-1], "16", "--load", str(gpt_zero1 / "iter_0000004")], check=False, timeout=300)
    assert refused.returncode != 0
    assert ("saved with a global batch of 8 samples, this run's is 16 (--global-batch-size)" in refused.stderr
            and "iteration " not in refused.stderr), refused.stderr[-3000:]
    # Other padding rows would change the softmax: the resume keeps the checkpoint's whatever the flag says.
    kept = run_pretrain([*GPT, "--make-vocab-size-divisible-by", "512", "--load", str(gpt_zero1 / "iter_0000004")],
                        timeout=300)
    assert ("padded vocabulary: keeping the checkpoint's 256 rows at TP=1 (--make-vocab-size-divisible-by 256; "
            "this run's padding alone gives 512)" in kept.stdout + kept.stderr), kept.stderr[-3000:]
