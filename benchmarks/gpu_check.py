"""GPU readiness check: bf16 training steps of a GPT preset on one device, reported as one JSON object.

What it measures, on the real training path (``GPTModel`` in a DeepSpeed engine built by
``domino.optim.deepspeed_optimizer.build_deepspeed_optimizer``: bf16 weights, fp32 gradient accumulation and master weights, ZeRO 1 with
the device-decided step of ``domino.optim.bf16_step``, torch AdamW), at TP=1 on a fixed synthetic batch:

* ``micro_batch``: the largest power-of-two micro-batch (up to ``--max-micro-batch``) whose training step fits
  in memory, found by doubling until ``torch.cuda.OutOfMemoryError``;
* ``tokens_per_s`` at that micro-batch with ``--domino-chunks 1`` and 2 (TP=1: the cost of chunking alone),
  ``mfu`` and ``tflops_per_device`` (``domino.train.throughput``'s FLOP count and device peak),
  ``peak_memory_gb`` (``max_memory_allocated``) and ``peak_reserved_gb`` (``max_memory_reserved``: what the
  caching allocator took from the device) of the chunks-1 steps;
* ``syncs_per_iteration``: on CUDA the warnings of ``torch.cuda.set_sync_debug_mode("warn")`` (syncs inside
  ops) plus explicit ``torch.cuda.synchronize()`` / DeepSpeed ``accelerator.synchronize()`` calls, which that
  mode does not see (``domino.train.host_syncs.explicit_synchronizes``); on CPU the host-read probe of
  ``domino.train.host_syncs``; with the source lines, and ``device_copies_per_iteration``: device tensors
  made from Python numbers (host-to-device copies the host waits for);
* ``loss_curve``: 20 steps from initialisation on the fixed batch, which a working step must memorise: the
  script exits 1 when the loss does not fall;
* ``cp_2``: ring attention at CP 2 over 32k tokens through the device's fused blocks against unsplit SDPA
  (``gpu_check_cp``: both ranks as threads on the one device);
* ``compiled`` (opt-in: ``--stages ...,compiled``; not in ``device_run.sh``'s default): tokens/s and the first
  step's seconds (the compile) with ``DOMINO_KERNELS=compiled``, at one chunk (each block compiled whole) and at
  Domino 2 (each layer's segments between collectives, ``domino.model.segments``), beside the eager ``main`` and
  ``chunks_2`` rates (``over_eager`` where the micro-batches match);
* ``llama``: the same loss curve, tokens/s and MFU at micro-batch 1 for a LLaMA-architecture preset (rotary
  positions, RMSNorm, SwiGLU, grouped-query attention, untied output layer), ``--llama-preset`` (default
  ``llama2-7b``, its own 32,000-token vocabulary) cut to ``--llama-layers`` layers (default 4, about 1.1B
  parameters), at TP=1 whatever the preset says (the vocabulary padded for TP=1).

The check runs in stages (``STAGE_BOXES``: ``smoke``, ``search``, ``main``, ``chunks_2``, ``llama``, ``cp_2``;
``--stages`` picks some): each in a time box (its share of ``--budget-s``), each writing ``$OUT/<stage>.json``
the moment it ends and catching its own error in one line (``errors`` in the JSON; ``gpu_check_stages.run_stage``), so a
late NCCL, compile or cuBLAS error keeps the stages that finished. The ``smoke`` stage (versions, one-rank
NCCL, GEMM and SDPA ceilings, one compile: ``gpu_check_stages.smoke``) runs first. Every stage that builds an
engine halves its micro-batch and retries on out-of-memory (``oom_retries``); a stage that cannot fit at
micro-batch 1 is reported in ``skipped``. ``PYTORCH_CUDA_ALLOC_CONF`` defaults to ``expandable_segments:True``
and is recorded (``alloc_conf``). ``benchmarks/device_run.sh`` runs the smoke stage and the rest in two
time-boxed processes within 8 minutes (``benchmarks/README.md``).
``compile_backend`` says whether the compiled islands ran (inductor needs a C compiler: ``c_compiler``).

``--dry-run`` runs the same code on CPU with the ``tiny`` and ``tiny-llama`` presets and a 256-token vocabulary
in seconds and checks the JSON's shape (``check_result``); CI runs it through ``gpu_check.sh --dry-run``
(``tests/test_gpu_check.py``), also with ``--simulate-oom STAGE`` (the first step of that stage raises
``torch.cuda.OutOfMemoryError``) and ``--simulate-error STAGE`` (that stage raises; the others' results stay). On CPU ``mfu`` and the memory figures are null (no known peak, no CUDA).

    bash benchmarks/gpu_check.sh [--preset gpt3-1.3b] [--max-micro-batch 64] [--budget-s 420] [--dry-run]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional

# The micro-batch search runs at the memory edge: expandable segments keep fragmentation from failing it
# early (torch's CUDA caching allocator reads this at its first allocation; recorded in the result).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from domino.config import padded_vocab_size, parse_config  # noqa: E402
from domino.model import GPTModel  # noqa: E402
from domino.overlap.schedule import apply_domino  # noqa: E402
from domino.runtime import state  # noqa: E402  (the mesh initialize_runtime built: one process)
from domino.parallel.kernels import COMPILED, apply_kernels, c_compiler, for_device, kernels_for  # noqa: E402
from domino.optim.deepspeed_optimizer import build_deepspeed_optimizer  # noqa: E402
from domino.train import runtime_start  # noqa: E402
from domino.train.host_syncs import syncs_per_step  # noqa: E402
from domino.train.throughput import detect_peak_tflops, training_flops_per_token  # noqa: E402
from gpu_check_cp import cp_2_stage  # noqa: E402
from gpu_check_stages import (  # noqa: E402,F401
    LOSS_STEPS, OPT_IN_BOXES, STAGE_BOXES, check_result, run_stage, smoke, write_json,
)

OutOfMemory = torch.cuda.OutOfMemoryError


def _config(args, micro_batch: int, chunks: int, llama: bool = False):
    layers = ["--num-layers", str(args.llama_layers)] if llama and args.llama_layers > 0 else []
    preset = args.llama_preset if llama else args.preset
    vocab = args.llama_vocab_size if llama else args.vocab_size
    flags = ["--preset", preset, *layers, "--bf16", "--micro-batch-size", str(micro_batch), "--global-batch-size",
             str(micro_batch), "--domino-chunks", str(chunks), "--mock-data", "--vocab-size", str(vocab),
             "--train-iters", str(LOSS_STEPS), "--zero-stage", "1",
             "--tensor-model-parallel-size", "1"]  # one device: the presets' TP=8 would pad the vocabulary for 8
    return parse_config(flags)


class _Run:
    """One engine at one chunk count, stepping on a fixed batch of ``micro_batch`` samples."""

    def __init__(self, args, micro_batch: int, chunks: int, device: torch.device, llama: bool = False,
                 stage: str = "", kernels=None) -> None:
        self.args, self.device, self.stage = args, device, stage
        self.config = _config(args, micro_batch, chunks, llama)
        self.vocab = padded_vocab_size(self.config.model.vocab_size, self.config)
        torch.manual_seed(args.seed)
        model = apply_kernels(apply_domino(GPTModel(self.config.model, self.vocab), chunks), kernels)
        self.engine = build_deepspeed_optimizer(model, self.config, state.current_mesh()).engine
        self.set_batch(micro_batch)

    def set_batch(self, micro_batch: int) -> None:
        """Steps on ``micro_batch`` samples from now on (the engine's config does not limit the tensor's size)."""
        self.tokens = self.labels = None
        g = torch.Generator().manual_seed(self.args.seed)
        seq = self.config.model.seq_length
        sample = torch.randint(0, self.config.model.vocab_size, (micro_batch, seq + 1), generator=g).to(self.device)
        self.tokens, self.labels = sample[:, :-1].contiguous(), sample[:, 1:].contiguous()
        self.tokens_per_step = micro_batch * seq

    def step(self) -> torch.Tensor:
        if self.args.simulate_oom == self.stage and self.stage not in _SIMULATED:
            _SIMULATED.add(self.stage)  # once: the retry at half the micro-batch then runs
            raise OutOfMemory(f"simulated out-of-memory in stage {self.stage} (--simulate-oom)")
        loss = self.engine(self.tokens, labels=self.labels).float().mean()
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()

    def close(self) -> None:
        if hasattr(self.engine, "destroy"):
            self.engine.destroy()
        self.engine = self.tokens = self.labels = None
        _release_memory()


_SIMULATED: set = set()


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
    except OutOfMemory:
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
    try:
        run = _Run(args, 1, 1, device, stage="search")
    except OutOfMemory:
        raise SystemExit(f"gpu_check: --preset {args.preset}'s weights and optimizer do not fit on this device")
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


def with_halving(stage: str, micro_batch: int, body: Callable[[int], Any], report: Dict[str, Any],
                 minimum: int = 1, even: bool = False) -> Any:
    """``body(micro_batch)``, halving the micro-batch on out-of-memory (to an even one with ``even``) down to
    ``minimum``; None (and the stage in ``report["skipped"]``) when even that does not fit. Each retry is listed
    in ``report["oom_retries"]``."""
    while micro_batch >= minimum:
        try:
            return body(micro_batch)
        except OutOfMemory as error:
            message = str(error).splitlines()[0][:160] if str(error) else "out of memory"
        _release_memory()  # outside the except block, whose traceback held the failed step's tensors
        report["oom_retries"].append({"stage": stage, "micro_batch": micro_batch, "error": message})
        micro_batch //= 2
        micro_batch -= micro_batch % 2 if even else 0
    report["skipped"][stage] = f"out of memory down to micro-batch {minimum}"
    return None


def _loss_falls(losses: List[float]) -> bool:
    return sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 and losses[-1] < losses[0]


def _memory_gb() -> Dict[str, Optional[float]]:
    if not torch.cuda.is_available():
        return {"allocated": None, "reserved": None}
    return {"allocated": torch.cuda.max_memory_allocated() / 2**30, "reserved": torch.cuda.max_memory_reserved() / 2**30}


def _main_stage(args, device: torch.device, mb: int) -> Dict[str, Any]:
    run = _Run(args, mb, 1, device, stage="main")
    try:
        losses = [float(run.step()) for _ in range(LOSS_STEPS)]  # also the warm-up of the timing below
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        seconds = _timed(run.step, args.steps)
        memory = _memory_gb()
        syncs = syncs_per_step(run.step, args.sync_steps)
        return {"micro_batch": mb, "losses": losses, "seconds": seconds, "memory": memory, "syncs": syncs,
                "flops_per_token": training_flops_per_token(run.config.model, run.vocab),
                "tokens_per_step": run.tokens_per_step, "seq_length": run.config.model.seq_length,
                "vocab": run.vocab}
    finally:
        run.close()


def _chunks_2_stage(args, device: torch.device, mb: int) -> float:
    run = _Run(args, mb, 2, device, stage="chunks_2")
    try:
        _timed(run.step, args.warmup)
        return run.tokens_per_step / _timed(run.step, args.steps)
    finally:
        run.close()


def _compiled_stage(args, device: torch.device, mb: int) -> Dict[str, Any]:
    """``DOMINO_KERNELS=compiled`` at ``mb``: tokens/s and first-step seconds at one chunk and at Domino 2."""
    kernels = for_device(COMPILED, device)  # without a C compiler: the eager choice, said by compile_blocks
    result: Dict[str, Any] = {"micro_batch": mb, "compile_blocks": kernels.compile_blocks, "tokens_per_s": {},
                              "first_step_s": {}}
    for chunks in (1, 2):
        run = _Run(args, mb, chunks, device, stage="compiled", kernels=kernels)
        try:
            result["first_step_s"][f"chunks_{chunks}"] = _timed(run.step, 1)  # traces and compiles
            _timed(run.step, args.warmup)
            result["tokens_per_s"][f"chunks_{chunks}"] = run.tokens_per_step / _timed(run.step, args.steps)
        finally:
            run.close()
    return result


def _llama_stage(args, device: torch.device, mb: int) -> Dict[str, Any]:
    """Loss curve, tokens/s and MFU of the LLaMA-architecture preset at TP=1, one chunk."""
    run = _Run(args, mb, 1, device, llama=True, stage="llama")
    try:
        losses = [float(run.step()) for _ in range(LOSS_STEPS)]  # also the warm-up of the timing below
        tokens_per_s = run.tokens_per_step / _timed(run.step, args.steps)
        tflops = training_flops_per_token(run.config.model, run.vocab) * tokens_per_s / 1e12
    finally:
        run.close()
    peak = detect_peak_tflops()
    return {"preset": args.llama_preset, "num_layers": run.config.model.num_layers, "micro_batch": mb,
            "padded_vocab_size": run.vocab, "tokens_per_s": tokens_per_s, "tflops_per_device": tflops,
            "mfu": tflops / peak if peak else None, "loss_curve": losses, "loss_falls": _loss_falls(losses)}


def _box(args, stage: str) -> float:
    """The stage's time box: its share of ``--budget-s`` (420 s: ``STAGE_BOXES`` as they are; an opt-in stage on
    the same scale)."""
    return {**STAGE_BOXES, **OPT_IN_BOXES}[stage] * args.budget_s / sum(STAGE_BOXES.values())


def _stage(args, name: str, body: Callable[[], Any], report: Dict[str, Any]) -> Any:
    """``body()`` as the check's stage ``name`` (``run_stage``: time box, ``$OUT/<name>.json``, one-line error in
    ``report["errors"]``); None when it failed or is not among ``--stages``."""
    if name not in args.stages:
        if name != "smoke" and name not in OPT_IN_BOXES:  # device_run.sh runs the smoke stage in its own process
            report["skipped"][name] = "not in --stages"
        return None

    def simulated():
        if args.simulate_error == name:
            raise RuntimeError(f"simulated error in stage {name} (--simulate-error)")
        return body()

    ok, value = run_stage(name, simulated, os.environ.get("OUT"), _box(args, name))
    if not ok:
        report["errors"][name] = value
    return value if ok else None


def measure(args, report: Dict[str, Any]) -> Dict[str, Any]:
    """The training stages after the smoke stage: each kept in ``$OUT`` as it ends, whatever fails later."""
    started = time.perf_counter()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    print(f"gpu_check: time budget {args.budget_s:.0f} s; time box per stage: "
          + ", ".join(f"{stage} {_box(args, stage):.0f} s" for stage in STAGE_BOXES), file=sys.stderr)
    search = _stage(args, "search", lambda: largest_micro_batch(
        args, device, time.perf_counter() + 0.8 * _box(args, "search")), report)
    mb = search["largest_that_fits"] if search else 1  # without the search, the smallest micro-batch
    main = _stage(args, "main", lambda: with_halving("main", mb, lambda m: _main_stage(args, device, m), report),
                  report)
    if main is None:
        return {"errors": report["errors"], "skipped": report["skipped"], "oom_retries": report["oom_retries"],
                "micro_batch": search, "seconds": time.perf_counter() - started}
    tokens_per_s = {"chunks_1": main["tokens_per_step"] / main["seconds"]}
    if main["micro_batch"] >= 2:
        even = main["micro_batch"] - main["micro_batch"] % 2
        rate = _stage(args, "chunks_2", lambda: with_halving(
            "chunks_2", even, lambda m: _chunks_2_stage(args, device, m), report, minimum=2, even=True), report)
        if rate is not None:
            tokens_per_s["chunks_2"] = rate
    else:
        report["skipped"]["chunks_2"] = "micro-batch 1 cannot be split into 2 chunks"
    llama = _stage(args, "llama", lambda: with_halving("llama", 1, lambda m: _llama_stage(args, device, m), report),
                   report)
    if llama is None:
        llama = {"error": report["errors"]["llama"]} if "llama" in report["errors"] else {
            "skipped": report["skipped"].get("llama", "?")}
    cp_2 = _stage(args, "cp_2", lambda: cp_2_stage(device, args.dry_run), report)  # the ring's fused blocks
    if cp_2 is None:
        cp_2 = {"error": report["errors"]["cp_2"]} if "cp_2" in report["errors"] else {
            "skipped": report["skipped"].get("cp_2", "?")}
    extra: Dict[str, Any] = {}
    if "compiled" in args.stages:
        compiled = _stage(args, "compiled", lambda: with_halving(
            "compiled", max(2, main["micro_batch"] - main["micro_batch"] % 2),
            lambda m: _compiled_stage(args, device, m), report, minimum=2, even=True), report)
        if compiled is None:
            compiled = {"error": report["errors"]["compiled"]} if "compiled" in report["errors"] else {
                "skipped": report["skipped"].get("compiled", "?")}
        elif compiled["micro_batch"] == main["micro_batch"]:  # chunks_2 ran at main's micro-batch when it was even
            compiled["over_eager"] = {k: v / tokens_per_s[k] for k, v in compiled["tokens_per_s"].items()
                                      if k in tokens_per_s}
        extra["compiled"] = compiled
    peak = detect_peak_tflops()
    tflops = main["flops_per_token"] * tokens_per_s["chunks_1"] / 1e12
    return {**extra,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "dry_run": args.dry_run, "preset": args.preset, "precision": "bf16", "tensor_model_parallel_size": 1,
        "seq_length": main["seq_length"], "padded_vocab_size": main["vocab"],
        "micro_batch": {**(search or {"largest_that_fits": 1, "tried": {}}), "measured": main["micro_batch"]},
        "tokens_per_s": tokens_per_s,
        "chunks_2_over_chunks_1": (tokens_per_s["chunks_2"] / tokens_per_s["chunks_1"]
                                   if "chunks_2" in tokens_per_s else None),
        "tflops_per_device": tflops, "peak_tflops": peak, "mfu": tflops / peak if peak else None,
        "peak_memory_gb": main["memory"]["allocated"], "peak_reserved_gb": main["memory"]["reserved"],
        "syncs_per_iteration": main["syncs"]["per_iteration"], "syncs": main["syncs"],
        "loss_curve": main["losses"], "loss_falls": _loss_falls(main["losses"]), "llama": llama, "cp_2": cp_2,
        "compile_backend": kernels_for(device).compile_backend, "c_compiler": c_compiler(),
        "cudnn_version": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "oom_retries": report["oom_retries"], "skipped": report["skipped"], "errors": report["errors"],
        "budget_s": args.budget_s, "torch": torch.__version__, "seconds": time.perf_counter() - started,
    }


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--preset", default="gpt3-1.3b", help="model preset (default gpt3-1.3b)")
    parser.add_argument("--llama-preset", default="llama2-7b", help="LLaMA-architecture preset (default llama2-7b)")
    parser.add_argument("--llama-layers", type=int, default=4,
                        help="layers of the LLaMA preset to train (default 4; 0: all of the preset's)")
    parser.add_argument("--vocab-size", type=int, default=50257, help="vocabulary before padding (GPT-2's)")
    parser.add_argument("--llama-vocab-size", type=int, default=32000, help="the LLaMA model's vocabulary (LLaMA 2's)")
    parser.add_argument("--max-micro-batch", type=int, default=64, help="largest micro-batch to try")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per chunk count")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before timing chunks 2")
    parser.add_argument("--sync-steps", type=int, default=3, help="steps counted under the sync debug mode")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="time budget of all stages (default 420: the check with install and start-up "
                             "within 8 minutes); each stage's time box is printed")
    parser.add_argument("--simulate-oom", choices=["main", "chunks_2", "llama"],
                        help="with --dry-run: the first step of this stage raises out-of-memory (tests the retry)")
    parser.add_argument("--stages", default=",".join(STAGE_BOXES),
                        help=f"comma-separated stages to run (default: {','.join(STAGE_BOXES)}; also "
                             f"{','.join(OPT_IN_BOXES)} when named)")
    parser.add_argument("--simulate-error", choices=[*STAGE_BOXES, *OPT_IN_BOXES],
                        help="with --dry-run: this stage raises an error (tests that the others' results stay)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, tiny preset, 256-token vocabulary, few steps: checks the script and its JSON")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.preset, args.vocab_size, args.llama_vocab_size, args.max_micro_batch = "tiny", 256, 256, 4
        args.llama_preset, args.llama_layers = "tiny-llama", 0
        args.steps, args.warmup, args.sync_steps = 2, 1, 1
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    elif args.simulate_oom or args.simulate_error:
        parser.error("--simulate-oom and --simulate-error are for --dry-run")
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; use --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    args.stages = [stage.strip() for stage in args.stages.split(",") if stage.strip()]
    unknown = sorted(set(args.stages) - set(STAGE_BOXES) - set(OPT_IN_BOXES))
    if unknown:
        parser.error(f"--stages: unknown stage(s) {', '.join(unknown)}; known: "
                     f"{', '.join([*STAGE_BOXES, *OPT_IN_BOXES])}")
    report: Dict[str, Any] = {"oom_retries": [], "skipped": {}, "errors": {}}
    # DeepSpeed prints its set-up to stdout: keep stdout for the one JSON object.
    with contextlib.redirect_stdout(sys.stderr):
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        checked = _stage(args, "smoke", lambda: smoke(device, args.dry_run), report)
        if not set(args.stages) - {"smoke"}:
            print(json.dumps({"smoke": checked, "errors": report["errors"]}))
            return 4 if report["errors"] else 0
        runtime_start.initialize_runtime(_config(args, 1, 1))
        result = measure(args, report)
        result["smoke"] = checked
    write_json(os.environ.get("OUT"), "gpu_check", result)  # the device tool's folder: it comes back with the run
    print(json.dumps(result))
    if "loss_curve" not in result:
        print(f"gpu_check: the main stage failed: {result['errors']}", file=sys.stderr)
        return 4
    check_result(result)
    for name, part in ((args.preset, result), (args.llama_preset, result["llama"])):
        if "loss_falls" in part and not part["loss_falls"]:
            print(f"gpu_check: the loss of {name} did not fall over {LOSS_STEPS} steps: {part['loss_curve']}",
                  file=sys.stderr)
            return 1
    if result["errors"]:
        print(f"gpu_check: stages failed: {result['errors']}", file=sys.stderr)
        return 4
    if result["skipped"]:
        print(f"gpu_check: stages skipped: {result['skipped']}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
