"""The device check's ``cp_2`` stage: ring attention at CP 2 over 32k tokens through the device's fused blocks.

On CUDA the ring's blocks are FlashAttention or memory-efficient attention (``domino/parallel/attention_blocks.py``),
which had not run on a GPU before this stage. It runs the ring of ``domino/parallel/ring_attention.py`` for both
ranks of a CP 2 group on the one device of the check: each rank a thread, its forward and backward called
directly (``_RingAttention.forward`` / ``backward`` with a plain context object: two threads in autograd's one
CUDA worker would wait on each other), the ring's ``_shift`` replaced by an in-process hand-over (NCCL refuses two
ranks on one device). It checks and reports:

* ``kind``: the block kernel the ring chose (``flash`` expected for bf16, head size 128);
* ``max_rel_error``: outputs and q, k, v gradients of both ranks against unsplit causal SDPA of the whole
  sequence (max abs difference over max abs value; the stage fails above 2e-2, bf16);
* ``dropout_finite``, ``dropout_changes_output``: with attention dropout 0.1 the ring runs, its outputs and
  gradients finite and its output unlike the one without dropout (that each block's backward gets its forward's RNG
  state is tested on CPU, ``tests/parallel/test_attention_blocks.py``: the two threads here draw from one
  generator in no fixed order, so two runs need not draw alike);
* ``seconds`` of one forward + backward of both ranks, ``peak_memory_gb`` of it (both ranks' tensors on one device),
  and ``textbook_scores_gb``: what one textbook block's fp32 scores would take (the blocks no longer hold them).

``--dry-run`` runs it on CPU at 512 tokens in fp32 (the CPU kernels: ``cpu_flash``).
"""

from __future__ import annotations

import queue
import threading
import time
import types
from typing import Any, Dict, List

import torch
import torch.nn.functional as F

from domino.parallel import ring_attention as R
from domino.parallel.kernels import kernels_for
from domino.parallel.context_split import local_token_indices
from domino.runtime.mesh import MeshGroup

CP = 2


class _Request:
    """One hand-over's receive: waits for the other rank's tensor and copies it into the receive buffer."""

    def __init__(self, box: "queue.Queue", received: torch.Tensor) -> None:
        self.box, self.received = box, received

    def wait(self) -> None:
        self.received.copy_(self.box.get(timeout=120))


def _loopback(boxes: Dict[Any, "queue.Queue"]):
    """The ring's ``_shift`` between threads: ``tensor`` (a copy: the sender may free it) to the next rank's box."""
    def shift(tensor: torch.Tensor, cp: MeshGroup, tag: int):
        boxes[((cp.rank + 1) % cp.size, tag)].put(tensor.clone())
        return (received := torch.empty_like(tensor)), [_Request(boxes[(cp.rank, tag)], received)]
    return shift


def _rank(rank: int, q, k, v, dout, dropout: float, results: List[Any]) -> None:
    """One rank's ring forward and backward (no autograd engine), its results at ``results[rank]``."""
    cp = MeshGroup.shapes_only(CP, rank)
    index = local_token_indices(q.shape[2], cp, q.device)
    local = [t.index_select(2, index) for t in (q, k, v)]
    ctx = types.SimpleNamespace()
    ctx.save_for_backward = lambda *tensors: setattr(ctx, "saved_tensors", tensors)
    out = R._RingAttention.forward(ctx, *local, cp, q.shape[-1] ** -0.5, None, dropout,
                                   kernels_for(q.device))  # the device's own choice, as a model given none
    grads = R._RingAttention.backward(ctx, dout.index_select(2, index))[:3]
    results[rank] = (index, ctx.kernels.kind, [out, *grads])


def _ring(q, k, v, dout, dropout: float, seed: int):
    """Both ranks' ``(kind, [out, dq, dk, dv])`` assembled in position order."""
    boxes = {(r, tag): queue.Queue() for r in range(CP) for tag in (R.KV_TAG, R.GRAD_TAG)}
    shift, R._shift = R._shift, _loopback(boxes)
    results: List[Any] = [None] * CP
    try:
        torch.manual_seed(seed)
        threads = [threading.Thread(target=_rank, args=(r, q, k, v, dout, dropout, results), daemon=True)
                   for r in range(CP)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        R._shift = shift
    if any(r is None for r in results):
        raise RuntimeError("a CP rank's thread failed (its traceback is above)")
    whole = [torch.empty_like(t) for t in (q, q, k, v)]
    for index, _, tensors in results:
        for target, part in zip(whole, tensors):
            target[:, :, index] = part.to(target.dtype)
    return results[0][1], whole


def cp_2_stage(device: torch.device, dry_run: bool) -> Dict[str, Any]:
    """The stage's result (module docstring); raises when the ring disagrees with unsplit SDPA."""
    seq, heads, groups, d = (512, 4, 2, 16) if dry_run else (32768, 16, 4, 128)
    dtype = torch.float32 if dry_run else torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, n, seq, d, generator=g, device=device, dtype=dtype) for n in (heads, groups, groups))
    dout = torch.randn(q.shape, generator=g, device=device, dtype=dtype)
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
    want = [ref.detach(), *torch.autograd.grad(ref, full, dout)]
    del ref, full
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    kind, got = _ring(q, k, v, dout, 0.0, 1)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    error = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(got, want))
    if error > 2e-2:
        raise RuntimeError(f"CP 2 ring ({kind} blocks) differs from unsplit SDPA: relative error {error:.3g}")
    _, dropped = _ring(q, k, v, dout, 0.1, 5)
    return {"seq_length": seq, "cp": CP, "heads": heads, "kv_heads": groups, "head_dim": d, "dtype": str(dtype),
            "kind": kind, "expected_kind": "flash" if cuda else "cpu_flash", "max_rel_error": error,
            "dropout_finite": all(bool(torch.isfinite(t).all()) for t in dropped),
            "dropout_changes_output": not torch.equal(dropped[0], got[0]), "seconds": seconds,
            "peak_memory_gb": peak, "textbook_scores_gb": 4 * heads * (seq // CP) ** 2 / 2**30}
