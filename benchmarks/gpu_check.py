"""GPU readiness check: bf16 training steps of a GPT preset on one device, reported as one JSON object.

What it measures, on the real training path (``GPTModel`` in a DeepSpeed engine built by
``domino.train.engine.build_engine``: bf16 weights, fp32 gradient accumulation and master weights, ZeRO 1,
torch AdamW), on a fixed synthetic batch:

* ``micro_batch``: the largest power-of-two micro-batch (up to ``--max-micro-batch``) whose training step fits
  in memory, found by doubling until ``torch.cuda.OutOfMemoryError``;
* ``tokens_per_s`` at that micro-batch with ``--domino-chunks 1`` and 2 (TP=1: the cost of chunking alone),
  ``mfu`` and ``tflops_per_device`` (``domino.train.throughput``'s FLOP count and device peak) and
  ``peak_memory_gb`` of the chunks-1 steps;
* ``syncs_per_iteration``: warnings raised by ``torch.cuda.set_sync_debug_mode("warn")`` per training step (it
  warns on "synchronizing operations"; torch 2.13 ``torch/cuda/__init__.py`` notes that collectives are not
  covered), with the source lines that raised them;
* ``loss_curve``: 20 steps from initialisation on the fixed batch, which a working step must memorise: the
  script exits 1 when the loss does not fall;
* ``llama``: the same loss curve, tokens/s and MFU at micro-batch 1 for a LLaMA-architecture preset (rotary
  positions, RMSNorm, SwiGLU, grouped-query attention, untied output layer), ``--llama-preset`` (default
  ``llama2-7b``) cut to ``--llama-layers`` layers (default 4, about 1.1B parameters, the cost of gpt3-1.3b); the
  script also exits 1 when its loss does not fall.

``--dry-run`` runs the same code on CPU with the ``tiny`` and ``tiny-llama`` presets and a 256-token vocabulary in seconds and
checks the JSON's shape (``check_result``); CI runs it through ``gpu_check.sh --dry-run``
(``tests/test_gpu_check.py``). On CPU ``syncs_per_iteration`` and ``mfu`` are null (no CUDA, no known peak).

    bash benchmarks/gpu_check.sh [--preset gpt3-1.3b] [--max-micro-batch 64] [--dry-run]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from domino.config import padded_vocab_size, parse_config  # noqa: E402
from domino.model import GPTModel  # noqa: E402
from domino.overlap.schedule import apply_domino  # noqa: E402
from domino.train import engine as engine_setup  # noqa: E402
from domino.train.throughput import detect_peak_tflops, training_flops_per_token  # noqa: E402

LOSS_STEPS = 20


def _config(args, micro_batch: int, chunks: int, llama: bool = False):
    layers = ["--num-layers", str(args.llama_layers)] if llama and args.llama_layers > 0 else []
    flags = ["--preset", args.llama_preset if llama else args.preset, *layers, "--bf16", "--micro-batch-size", str(micro_batch), "--global-batch-size",
             str(micro_batch), "--domino-chunks", str(chunks), "--mock-data", "--vocab-size", str(args.vocab_size),
             "--train-iters", str(LOSS_STEPS), "--zero-stage", "1"]
    return parse_config(flags)


class _Run:
    """One engine at one chunk count, stepping on a fixed batch of ``micro_batch`` samples."""

    def __init__(self, args, micro_batch: int, chunks: int, device: torch.device, llama: bool = False) -> None:
        self.args, self.device = args, device
        self.config = _config(args, micro_batch, chunks, llama)
        self.vocab = padded_vocab_size(args.vocab_size, self.config)
        torch.manual_seed(args.seed)
        model = apply_domino(GPTModel(self.config.model, self.vocab), chunks)
        self.engine = engine_setup.build_engine(model, self.config)
        self.set_batch(micro_batch)

    def set_batch(self, micro_batch: int) -> None:
        """Steps on ``micro_batch`` samples from now on (the engine's config does not limit the tensor's size)."""
        self.tokens = self.labels = None
        g = torch.Generator().manual_seed(self.args.seed)
        seq = self.config.model.seq_length
        sample = torch.randint(0, self.args.vocab_size, (micro_batch, seq + 1), generator=g).to(self.device)
        self.tokens, self.labels = sample[:, :-1].contiguous(), sample[:, 1:].contiguous()
        self.tokens_per_step = micro_batch * seq

    def step(self) -> torch.Tensor:
        loss = self.engine(self.tokens, labels=self.labels).float().mean()
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()

    def close(self) -> None:
        if hasattr(self.engine, "destroy"):
            self.engine.destroy()
        self.engine = self.tokens = self.labels = None
        _release_memory()


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(step: Callable[[], Any], steps: int) -> float:
    """Seconds per step over ``steps`` steps (the device queue drained before and after)."""
    _sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _sync()
    return (time.perf_counter() - start) / steps


def _steps_fit(run: _Run) -> bool:
    """Whether two training steps at the run's batch fit in device memory."""
    try:
        run.step()
        run.step()
        _sync()
        return True
    except torch.cuda.OutOfMemoryError:
        pass  # leave the except block first: its traceback holds the failed step's tensors
    run.engine.zero_grad()
    _release_memory()
    return False


def largest_micro_batch(args, device: torch.device, deadline: float) -> Dict[str, Any]:
    """Doubles the micro-batch from 1 while two training steps fit (and time is left), on one engine.

    The search's engine has taken steps (and maybe a failed one): the measurements use fresh engines.
    """
    tried: Dict[str, bool] = {}
    best, mb = None, 1
    run = _Run(args, 1, 1, device)
    try:
        while mb <= args.max_micro_batch and time.perf_counter() < deadline:
            run.set_batch(mb)
            tried[str(mb)] = _steps_fit(run)
            if not tried[str(mb)]:
                break
            best, mb = mb, mb * 2
    finally:
        run.close()
    if best is None:
        raise SystemExit(f"gpu_check: --preset {args.preset} does not fit even at micro-batch 1")
    return {"largest_that_fits": best, "tried": tried}


def count_syncs(run: _Run, steps: int) -> Dict[str, Any]:
    """Host synchronisations per step, from ``torch.cuda.set_sync_debug_mode("warn")``'s warnings."""
    if not torch.cuda.is_available():
        return {"per_iteration": None, "where": {}, "note": "no CUDA: torch's sync debug mode needs a GPU"}
    where: collections.Counter = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                run.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message).lower():
            where[f"{os.path.relpath(w.filename)}:{w.lineno}"] += 1
    return {"per_iteration": sum(where.values()) / steps,
            "where": {k: v / steps for k, v in where.most_common(12)}}


def _loss_falls(losses: List[float]) -> bool:
    return sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 and losses[-1] < losses[0]


def measure_llama(args, device: torch.device) -> Dict[str, Any]:
    """Loss curve, tokens/s and MFU of the LLaMA-architecture preset at micro-batch 1 (TP=1, one chunk)."""
    run = _Run(args, 1, 1, device, llama=True)
    try:
        losses = [float(run.step()) for _ in range(LOSS_STEPS)]  # also the warm-up of the timing below
        tokens_per_s = run.tokens_per_step / _timed(run.step, args.steps)
        tflops = training_flops_per_token(run.config.model, run.vocab) * tokens_per_s / 1e12
    finally:
        run.close()
    peak = detect_peak_tflops()
    return {"preset": args.llama_preset, "num_layers": run.config.model.num_layers, "micro_batch": 1,
            "tokens_per_s": tokens_per_s, "tflops_per_device": tflops, "mfu": tflops / peak if peak else None,
            "loss_curve": losses, "loss_falls": _loss_falls(losses)}


def measure(args) -> Dict[str, Any]:
    started = time.perf_counter()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    deadline = started + args.budget_s / 3  # the micro-batch search may use a third of the budget
    search = largest_micro_batch(args, device, deadline)
    mb = search["largest_that_fits"]

    run = _Run(args, mb, 1, device)
    losses = [float(run.step()) for _ in range(LOSS_STEPS)]  # also the warm-up of the timing below
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    seconds = {1: _timed(run.step, args.steps)}
    peak_gb = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    syncs = count_syncs(run, args.sync_steps)
    flops_per_token = training_flops_per_token(run.config.model, run.vocab)
    tokens_per_step = run.tokens_per_step
    run.close()

    if mb % 2 == 0:
        run = _Run(args, mb, 2, device)
        _timed(run.step, args.warmup)
        seconds[2] = _timed(run.step, args.steps)
        run.close()
    tokens_per_s = {f"chunks_{c}": tokens_per_step / s for c, s in seconds.items()}
    peak = detect_peak_tflops()
    tflops = flops_per_token * tokens_per_s["chunks_1"] / 1e12
    llama = measure_llama(args, device)
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "dry_run": args.dry_run, "preset": args.preset, "precision": "bf16",
        "seq_length": run.config.model.seq_length, "padded_vocab_size": run.vocab,
        "micro_batch": search, "tokens_per_s": tokens_per_s,
        "chunks_2_over_chunks_1": (tokens_per_s["chunks_2"] / tokens_per_s["chunks_1"]
                                   if "chunks_2" in tokens_per_s else None),
        "tflops_per_device": tflops, "peak_tflops": peak, "mfu": tflops / peak if peak else None,
        "peak_memory_gb": peak_gb, "syncs_per_iteration": syncs["per_iteration"], "syncs": syncs,
        "loss_curve": losses, "loss_falls": _loss_falls(losses), "llama": llama,
        "torch": torch.__version__, "seconds": time.perf_counter() - started,
    }


#: Keys of the result and the types their values may have.
RESULT_SHAPE = {
    "device": (str,), "dry_run": (bool,), "preset": (str,), "precision": (str,), "seq_length": (int,),
    "padded_vocab_size": (int,), "micro_batch": (dict,), "tokens_per_s": (dict,),
    "chunks_2_over_chunks_1": (float, type(None)), "tflops_per_device": (float,), "peak_tflops": (float, type(None)),
    "mfu": (float, type(None)), "peak_memory_gb": (float, type(None)), "syncs_per_iteration": (float, type(None)),
    "syncs": (dict,), "loss_curve": (list,), "loss_falls": (bool,), "llama": (dict,), "torch": (str,),
    "seconds": (float,),
}


def check_result(result: Dict[str, Any]) -> None:
    """Raises ValueError naming the first key whose presence, type or value is wrong."""
    for key, types in RESULT_SHAPE.items():
        if key not in result:
            raise ValueError(f"gpu_check result: '{key}' is missing")
        if not isinstance(result[key], types):
            raise ValueError(f"gpu_check result: '{key}' is {type(result[key]).__name__}, expected "
                             f"{' or '.join(t.__name__ for t in types)}")
    if len(result["loss_curve"]) != LOSS_STEPS or not all(isinstance(x, float) for x in result["loss_curve"]):
        raise ValueError(f"gpu_check result: 'loss_curve' must hold {LOSS_STEPS} floats")
    if result["micro_batch"].get("largest_that_fits", 0) < 1 or "chunks_1" not in result["tokens_per_s"]:
        raise ValueError("gpu_check result: no micro-batch fitted or no chunks_1 throughput")
    llama = result["llama"]
    if len(llama.get("loss_curve", [])) != LOSS_STEPS or not isinstance(llama.get("loss_falls"), bool):
        raise ValueError(f"gpu_check result: 'llama' must hold a {LOSS_STEPS}-step 'loss_curve' and 'loss_falls'")
    if not llama.get("tokens_per_s", 0) > 0:
        raise ValueError(f"gpu_check result: 'llama' tokens_per_s must be positive, got {llama.get('tokens_per_s')}")
    if any(not (v > 0) for v in result["tokens_per_s"].values()):
        raise ValueError(f"gpu_check result: 'tokens_per_s' must be positive, got {result['tokens_per_s']}")
    if torch.cuda.is_available() and result["syncs_per_iteration"] is None:
        raise ValueError("gpu_check result: 'syncs_per_iteration' must be measured on CUDA")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--preset", default="gpt3-1.3b", help="model preset (default gpt3-1.3b)")
    parser.add_argument("--llama-preset", default="llama2-7b", help="LLaMA-architecture preset (default llama2-7b)")
    parser.add_argument("--llama-layers", type=int, default=4,
                        help="layers of the LLaMA preset to train (default 4; 0: all of the preset's)")
    parser.add_argument("--vocab-size", type=int, default=50257, help="vocabulary before padding (GPT-2's)")
    parser.add_argument("--max-micro-batch", type=int, default=64, help="largest micro-batch to try")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per chunk count")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before timing chunks 2")
    parser.add_argument("--sync-steps", type=int, default=3, help="steps counted under the sync debug mode")
    parser.add_argument("--budget-s", type=float, default=420.0, help="time budget; the search uses a third")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, tiny preset, 256-token vocabulary, few steps: checks the script and its JSON")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.preset, args.vocab_size, args.max_micro_batch = "tiny", 256, 2
        args.llama_preset, args.llama_layers = "tiny-llama", 0
        args.steps, args.warmup, args.sync_steps = 2, 1, 1
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; use --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    # DeepSpeed prints its set-up to stdout: keep stdout for the one JSON object.
    with contextlib.redirect_stdout(sys.stderr):
        engine_setup.initialize_runtime(_config(args, 1, 1))
        result = measure(args)
    check_result(result)
    print(json.dumps(result))
    for name, part in ((args.preset, result), (args.llama_preset, result["llama"])):
        if not part["loss_falls"]:
            print(f"gpu_check: the loss of {name} did not fall over {LOSS_STEPS} steps: {part['loss_curve']}",
                  file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
