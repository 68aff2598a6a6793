"""The host allocator settings serve a step-sized buffer from the heap (kept) instead of a fresh mmap."""

import json
import os
import subprocess
import sys

from domino.train.host_allocator import keep_step_buffers_in_heap

# In a fresh process: where a 96 MiB tensor (a step's logits or activations) lands, inside the process's brk
# heap or outside it (glibc's default above its 32 MiB mmap threshold ceiling: a fresh mapping every time).
_PROBE = """
import json, sys, torch
from domino.train.host_allocator import keep_step_buffers_in_heap
applied = keep_step_buffers_in_heap() if sys.argv[1] == "tuned" else {}
buffer = torch.empty(96 << 18, dtype=torch.float32)
start, end = (int(x, 16) for x in next(l for l in open("/proc/self/maps") if "[heap]" in l).split()[0].split("-"))
print(json.dumps({"applied": applied, "in_heap": start <= buffer.data_ptr() < end}))
"""


def _probe(mode: str, **extra_env) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-c", _PROBE, mode], env={**env, **extra_env}, capture_output=True,
                          text=True, check=True, timeout=120)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_step_sized_buffer_comes_from_the_heap():
    assert _probe("default") == {"applied": {}, "in_heap": False}  # glibc's default: its own mapping
    tuned = _probe("tuned")
    assert set(tuned["applied"]) == {"mmap threshold", "trim threshold", "top pad"} and tuned["in_heap"]


def test_a_user_tuned_allocator_is_left_alone():
    assert keep_step_buffers_in_heap({"MALLOC_ARENA_MAX": "2"}) == {}
    assert keep_step_buffers_in_heap({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}) == {}
    assert _probe("tuned", MALLOC_TOP_PAD_="131072") == {"applied": {}, "in_heap": False}
