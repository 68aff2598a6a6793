"""Model FLOPs, device peak and memory: the numbers behind tokens/s, TFLOP/s and MFU."""

from __future__ import annotations

import resource
import sys
from typing import Optional

import torch

from domino.config import ModelConfig, memory_formulas

#: Dense bf16/fp16 peak TFLOP/s per device for GPUs we recognise by name (vendor data sheets, SXM parts).
KNOWN_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "V100": 125.0}
#: Dense FP8 peak TFLOP/s (``--fp8-format``; the same data sheets, without sparsity): twice the bf16 figure on
#: Hopper and Ada. The MFU line divides by it: the FP8 GEMMs' ceiling (attention and the output layer stay
#: bf16, so a run's MFU against it is a lower bound of the GEMMs' own).
KNOWN_FP8_PEAK_TFLOPS = {"H200": 1979.0, "H100": 1979.0, "L40S": 733.0}


def training_flops_per_token(model: ModelConfig, vocab_size: int) -> float:
    """FLOPs to train on one token: forward x 3 (Megatron's count; no activation recomputation).

    Per layer the matmuls cost ``2 * (4h^2 + 2 h ffn)`` per token and attention scores plus values
    ``4 s h`` (full square, as Megatron counts); the logits ``2 h V``. With ffn = 4h this is the familiar
    ``72 L h^2 (1 + s/6h + V/12Lh)`` per token divided by s. The count is ``domino estimate``'s, so it follows the
    architecture fields (SwiGLU's third matrix, grouped-query attention's smaller K and V).
    """
    return memory_formulas.training_flops_per_token(model, vocab_size)


def detect_peak_tflops(fp8: bool = False) -> Optional[float]:
    """Peak TFLOP/s of the current CUDA device when known (its FP8 peak with ``fp8``), else ``None`` (CPU,
    unknown GPU)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, peak in (KNOWN_FP8_PEAK_TFLOPS if fp8 else KNOWN_PEAK_TFLOPS).items():
        if key in name:
            return peak
    return None


def memory_gb() -> float:
    """Peak memory of this process: CUDA allocations on GPU, else resident set size (GB)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**30 if sys.platform == "darwin" else 2**20)
