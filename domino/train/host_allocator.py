"""Host memory allocator settings for training: keep a step's large buffers in the heap from step to step.

On Linux, PyTorch's CPU tensors come from glibc's ``malloc``. glibc serves a request above its mmap threshold
(dynamic, at most 32 MiB by default) with a fresh ``mmap`` and unmaps it when it is freed, and it returns freed
memory at the top of the heap to the OS above its trim threshold. A training step allocates and frees the same
large buffers every iteration (logits, activations, gradients), so under those defaults it faults in and zeroes
fresh pages for them again and again. With the thresholds raised they come from the heap and stay there; the
resident size stays at the step's peak, which the process reaches every step anyway.

Measured on the 2-core CPU machine (``benchmarks/RESULTS.md``, "End-to-end = model step"): ``domino pretrain``
at 1 thread ran 3-10% faster in each of eight alternating pairs against glibc's defaults, with the same maximum
resident size after 12 and after 60 iterations. The bare model step in a process of its own gains nothing from
it (0.99-1.00x), so the saving is in what pretraining adds around the step (not traced further). On
GPUs the activations live in CUDA's caching allocator and this touches only host-side buffers.

A user who tunes glibc's allocator (any ``MALLOC_*`` variable, or ``GLIBC_TUNABLES`` naming malloc) keeps
exactly that: nothing is changed then. C libraries without ``mallopt`` are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from typing import Dict, Mapping, Optional

logger = logging.getLogger(__name__)

#: ``mallopt`` parameters (glibc ``malloc/malloc.h``) and the values set: requests up to 1 GiB come from the
#: heap, freed heap memory is kept (up to 2 GiB - 1, the largest ``int``), the heap grows 256 MiB at a time.
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS: Dict[str, tuple] = {
    "mmap threshold": (M_MMAP_THRESHOLD, 1 << 30),
    "trim threshold": (M_TRIM_THRESHOLD, (1 << 31) - 1),
    "top pad": (M_TOP_PAD, 256 << 20),
}


def _user_tuned(environ: Mapping[str, str]) -> Optional[str]:
    """The first environment variable by which the user tunes glibc's malloc, if any."""
    for name, value in environ.items():
        if name.startswith("MALLOC_") or (name == "GLIBC_TUNABLES" and "malloc" in value):
            return name
    return None


def keep_step_buffers_in_heap(environ: Optional[Mapping[str, str]] = None) -> Dict[str, int]:
    """Raises glibc's mmap and trim thresholds for this process (see the module docstring).

    Call once, early, before the model and the data are built. Returns the settings applied (empty when
    the C library has no ``mallopt`` or the environment already tunes the allocator).
    """
    environ = os.environ if environ is None else environ
    tuned = _user_tuned(environ)
    if tuned is not None:
        logger.info("host allocator: left as the environment (%s) sets it", tuned)
        return {}
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): no such knobs
        return {}
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = {name: value for name, (param, value) in SETTINGS.items() if mallopt(param, value) == 1}
    logger.info("host allocator: glibc %s", ", ".join(f"{name} {value >> 20} MiB" for name, value in applied.items()))
    return applied
