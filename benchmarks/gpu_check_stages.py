"""The device check's stages: each in a time box, its JSON written to ``$OUT`` as soon as it ends, its error
caught in one line, and the 60 s smoke stage that runs first.

A device may be lent for a few minutes only, and a late NCCL, compile or cuBLAS error must not discard what
earlier stages measured: :func:`run_stage` runs one stage, writes ``$OUT/<stage>.json`` (``{"stage", "ok",
"seconds", "result"}`` or ``{"stage", "ok": false, "seconds", "error": "<one line>"}``) before the next stage
starts, and returns instead of raising. Its time box is a ``SIGALRM`` timer: it interrupts Python between
kernels, not a kernel or a collective that hangs; ``benchmarks/device_run.sh`` wraps every stage's process in
``timeout`` for those.

:func:`smoke` checks what every later stage needs, cheaply: the versions (torch, CUDA, cuDNN, NCCL,
DeepSpeed, Python; the device's name and compute capability; ``PYTORCH_CUDA_ALLOC_CONF``), a one-rank NCCL
all-reduce (gloo on CPU), the bf16 GEMM and SDPA ceilings (TFLOP/s of one large matmul and of causal
attention forward + backward) and one ``torch.compile`` (inductor where a C compiler exists).
:func:`check_result` checks the combined result's shape (``RESULT_SHAPE``).
"""

from __future__ import annotations

import json
import os
import platform
import signal
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Optional, Tuple

import torch

#: Training steps of each loss curve (a working step must make the loss fall over them).
LOSS_STEPS = 20
#: Each stage's time box in seconds (``device_run.sh``'s ``timeout`` adds the process start to these).
STAGE_BOXES = {"smoke": 60, "search": 60, "main": 150, "chunks_2": 60, "llama": 90, "cp_2": 30}
#: Stages that run only when ``--stages`` names them (not in ``device_run.sh``'s default), boxed on the same scale:
#: ``compiled``, ``DOMINO_KERNELS=compiled`` (whole blocks at one chunk, the segments between collectives at two).
OPT_IN_BOXES = {"compiled": 90}


class StageTimeout(Exception):
    """A stage ran past its time box."""


def one_line(error: BaseException) -> str:
    """``Type: first line of the message`` (at most 300 characters): what a failed stage reports."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def write_json(out: Optional[str], name: str, payload: Dict[str, Any]) -> None:
    """Writes ``payload`` to ``out/name.json`` (atomically: a stage killed while writing leaves no half file)."""
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{name}.")
    with os.fdopen(fd, "w") as handle:
        json.dump(payload, handle, indent=1, default=str)
    os.replace(tmp, os.path.join(out, f"{name}.json"))


def run_stage(name: str, body: Callable[[], Any], out: Optional[str], box_s: float) -> Tuple[bool, Any]:
    """Runs ``body()`` within ``box_s`` seconds; writes ``out/<name>.json`` when it ends; returns ``(ok, result
    or the one-line error)``. Catches everything a stage can raise (``SystemExit`` too), not ``KeyboardInterrupt``."""
    def expire(signum, frame):
        raise StageTimeout(f"stage {name} ran past its {box_s:g} s time box")

    started = time.perf_counter()
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, box_s)
    try:
        result, ok = body(), True
    except (Exception, SystemExit) as error:  # a stage's failure is reported, the next stage still runs
        result, ok = one_line(error), False
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    seconds = time.perf_counter() - started
    write_json(out, name, {"stage": name, "ok": ok, "seconds": seconds, ("result" if ok else "error"): result})
    print(f"gpu_check: stage {name} {'done' if ok else 'failed'} in {seconds:.1f} s"
          + ("" if ok else f": {result}"), file=sys.stderr)
    return ok, result


def _versions(device: torch.device) -> Dict[str, Any]:
    import deepspeed

    cuda = device.type == "cuda"
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if cuda else None,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
            "deepspeed": deepspeed.__version__,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}


def _one_rank_all_reduce(device: torch.device) -> Dict[str, Any]:
    """A one-rank process group (NCCL on CUDA, gloo on CPU) all-reducing a tensor: the backend initialises."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    started = time.perf_counter()
    own = not dist.is_initialized()
    if own:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    group = dist.group.WORLD if own else dist.new_group([0], backend=backend)
    try:
        tensor = torch.full((1024,), 2.0, device=device)
        dist.all_reduce(tensor, group=group)
        correct = bool((tensor == 2.0).all())  # one rank: the sum is the tensor itself
    finally:
        if own:
            dist.destroy_process_group()  # the training stages initialise their own
    return {"backend": backend, "correct": correct, "seconds": time.perf_counter() - started}


def _timed(fn: Callable[[], Any], repeat: int, device: torch.device) -> float:
    fn()  # warm-up: kernel selection, lazy initialisation
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeat


def _gemm_tflops(device: torch.device, n: int) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n**3 / _timed(lambda: a @ b, 10, device) / 1e12


def _sdpa_tflops(device: torch.device, batch: int, heads: int, seq: int, dim: int) -> float:
    """Causal attention forward + backward (4 GEMM-equivalents forward halved by the mask, twice in backward)."""
    q, k, v = (torch.randn(batch, heads, seq, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))

    def step():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(torch.ones_like(out))

    flops = 3.5 * 4 * batch * heads * seq * seq * dim / 2  # fwd 2 GEMMs + bwd 5, half the scores under the mask
    return flops / _timed(step, 5, device) / 1e12


def _one_compile(device: torch.device) -> Dict[str, Any]:
    from domino.parallel.kernels import c_compiler

    if c_compiler() is None:
        return {"backend": None, "skipped": "no C compiler: inductor cannot build its kernels"}
    started = time.perf_counter()
    fn = torch.compile(lambda x: torch.nn.functional.gelu(x) * 2.0 + 1.0, backend="inductor", fullgraph=True)
    x = torch.randn(256, 256, device=device)
    ok = torch.allclose(fn(x), torch.nn.functional.gelu(x) * 2.0 + 1.0, atol=1e-5)
    return {"backend": "inductor", "correct": bool(ok), "seconds": time.perf_counter() - started}


def smoke(device: torch.device, dry_run: bool) -> Dict[str, Any]:
    """Versions, a one-rank all-reduce, the GEMM and SDPA ceilings and one compile (module docstring)."""
    result: Dict[str, Any] = {"versions": _versions(device)}
    result["all_reduce"] = _one_rank_all_reduce(device)
    if not result["all_reduce"]["correct"]:
        raise RuntimeError(f"one-rank {result['all_reduce']['backend']} all-reduce returned a wrong sum")
    n, shape = (256, (1, 2, 64, 32)) if dry_run else (8192, (4, 16, 4096, 128))
    result["gemm_bf16_tflops"] = _gemm_tflops(device, n)
    result["sdpa_bf16_tflops"] = _sdpa_tflops(device, *shape)
    result["compile"] = {"skipped": "dry run: compiling costs more than the check on CPU"} if dry_run \
        else _one_compile(device)
    return result


#: Keys of the result and the types their values may have.
RESULT_SHAPE = {
    "device": (str,), "dry_run": (bool,), "preset": (str,), "precision": (str,), "tensor_model_parallel_size": (int,),
    "seq_length": (int,), "padded_vocab_size": (int,), "micro_batch": (dict,), "tokens_per_s": (dict,),
    "chunks_2_over_chunks_1": (float, type(None)), "tflops_per_device": (float,), "peak_tflops": (float, type(None)),
    "mfu": (float, type(None)), "peak_memory_gb": (float, type(None)), "peak_reserved_gb": (float, type(None)),
    "syncs_per_iteration": (float,), "syncs": (dict,), "loss_curve": (list,), "loss_falls": (bool,),
    "llama": (dict,), "compile_backend": (str, type(None)), "c_compiler": (str, type(None)),
    "cudnn_version": (int, type(None)), "alloc_conf": (str, type(None)), "oom_retries": (list,),
    "skipped": (dict,), "errors": (dict,), "budget_s": (float,), "torch": (str,), "seconds": (float,),
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
    if "error" in llama:
        if result["errors"].get("llama") != llama["error"]:
            raise ValueError("gpu_check result: 'llama' failed but 'errors' does not say how")
    elif "skipped" in llama:
        if result["skipped"].get("llama") != llama["skipped"]:
            raise ValueError("gpu_check result: 'llama' was skipped but 'skipped' does not say why")
    else:
        if len(llama.get("loss_curve", [])) != LOSS_STEPS or not isinstance(llama.get("loss_falls"), bool):
            raise ValueError(f"gpu_check result: 'llama' must hold a {LOSS_STEPS}-step 'loss_curve' and 'loss_falls'")
        if not llama.get("tokens_per_s", 0) > 0:
            raise ValueError(f"gpu_check result: 'llama' tokens_per_s must be positive, got {llama.get('tokens_per_s')}")
    compiled = result.get("compiled")  # an opt-in stage: present only when --stages named it
    if isinstance(compiled, dict) and "error" not in compiled and "skipped" not in compiled:
        if not all(compiled.get("tokens_per_s", {}).get(k, 0) > 0 for k in ("chunks_1", "chunks_2")):
            raise ValueError(f"gpu_check result: 'compiled' tokens_per_s must hold positive chunks_1 and chunks_2, "
                             f"got {compiled.get('tokens_per_s')}")
    if any(not (v > 0) for v in result["tokens_per_s"].values()):
        raise ValueError(f"gpu_check result: 'tokens_per_s' must be positive, got {result['tokens_per_s']}")
    if torch.cuda.is_available() and result["peak_reserved_gb"] is None:
        raise ValueError("gpu_check result: 'peak_reserved_gb' must be measured on CUDA")
