"""Gradients in contiguous fp32 buckets, reduced over the data-parallel replicas as the backward finishes them.

Megatron core's ``param_and_grad_buffer.py`` (d98e8a64: ``_ParamAndGradBuffer``, ``_ParamAndGradBucketGroup``) keeps
every parameter's gradient as a view into a few large buffers, so a bucket is reduced in place with no flatten or
copy, and launches a bucket's reduction as soon as the backward has produced the last of its gradients
(``register_grad_ready``), overlapping the data-parallel reduction with the rest of the backward. Here, for fp32
parameters:

- each parameter's ``.grad`` is a view into its bucket's flat buffer, set once and never set to ``None``: autograd
  then adds every micro-batch's gradient into it in place (torch 2.13 ``AccumulateGrad``: with ``.grad`` defined and
  grad mode off it does ``variable_grad += new_grad``; PyTorch DDP's ``gradient_as_bucket_view`` relies on the same);
- buckets are cut in reverse registration order, the order the backward finishes gradients;
- a post-accumulate-grad hook (``Tensor.register_post_accumulate_grad_hook``) counts each parameter's micro-batches;
  at the step's count its gradient is final, and with the bucket's last final gradient the bucket's sum over the
  replicas is launched asynchronously (a pipeline stage's schedule runs every micro-batch's backward in one go: the
  count is what tells the last one);
- :meth:`GradBuckets.finish` waits for each, launching any bucket a parameter without a gradient held back, and
  scales by ``1 / data-parallel size``: DeepSpeed's ``allreduce_bucket`` arithmetic (``postscale_gradients``: the
  sum, then ``mul_(1 / dp)``; deepspeed 0.19.8 ``runtime/engine.py``), so gradients equal its ZeRO 0 path's.

16-bit parameters (bf16, fp16) get Megatron's fp32 ``main_grad`` instead (``param_and_grad_buffer.py``: the
bucket is the fp32 grad buffer, ``param.main_grad`` its view): their ``.grad`` stays autograd's 16-bit tensor,
and the post-accumulate-grad hook adds it into ``main_grad`` in fp32 and frees it (``.grad = None``), so
micro-batches are summed in fp32, never in 16 bits. DeepSpeed 0.19.8's ``BF16_Optimizer`` does the same
(``runtime/bf16_optimizer.py``: ``accumulate_hp_grads_and_remove_lp`` -> ``_update_hp_grad``,
``hp_grad.add_(lp.grad.to(hp_grad.dtype))`` then ``lp.grad = None``), so the fp32 sums are its bit for bit.

A pipeline stage's buckets are divided by the micro-batch count just before their launch, the division torch's
schedule makes with ``scale_grads=True`` (so the schedule runs with it off); its tied word embeddings are left out
and reduced after their sum over the first and last stage (:mod:`domino.train.pipeline_step`).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from domino.pipeline.grad_overlap import backward_order_buckets
from domino.runtime.mesh import MeshGroup

#: The parameter dtypes whose gradients the buckets hold in fp32.
WIDENED = (torch.float32, torch.bfloat16, torch.float16)


def gradient(param: nn.Parameter) -> Optional[torch.Tensor]:
    """Where ``param``'s accumulated gradient lives: its fp32 ``main_grad`` (16-bit parameters), else ``.grad``."""
    return getattr(param, "main_grad", None) if param.dtype != torch.float32 else param.grad


class GradBuckets:
    """The parameters' fp32 gradients as views into contiguous buckets, reduced from the backward: ``.grad`` of
    fp32 parameters, ``.main_grad`` of 16-bit ones (module docstring).

    Args:
        params: the parameters (fp32, bf16 or fp16, on one device), in registration order.
        dp: the data-parallel group the mean is taken over (its size divides the sum).
        replicas: the group the buckets are summed over: data x context parallel (``ParallelMesh.dp_cp``), the
            ranks holding shares of one loss and copies of these weights.
        reduce_in_backward: launch each bucket's reduction from the backward (False: the caller reduces).
        exclude: a parameter kept out of the buckets (a pipeline stage's tied embeddings), its ``.grad`` autograd's.
        divide_by_micro_batches: divide each bucket by the step's micro-batch count before its launch (a pipeline
            stage's schedule, whose loss is not divided by it).
        bucket_elements: elements per bucket (default: Megatron's rule,
            :func:`domino.pipeline.grad_overlap.backward_order_buckets`).
    """

    def __init__(self, params: List[nn.Parameter], dp: MeshGroup, replicas: MeshGroup,
                 reduce_in_backward: bool = True, bucket_elements: Optional[int] = None,
                 exclude: Optional[nn.Parameter] = None, divide_by_micro_batches: bool = False) -> None:
        trainable = [p for p in params if p.requires_grad and p is not exclude]
        self.excluded = [p for p in params if p is exclude]
        wrong = sorted({str(p.dtype) for p in trainable if p.dtype not in WIDENED})
        if wrong:
            raise ValueError(f"GradBuckets holds fp32, bf16 and fp16 parameters only, got {', '.join(wrong)}")
        self.dp, self.group = dp.size, replicas.process_group
        self.reduces = reduce_in_backward and replicas.size > 1
        self.buckets = backward_order_buckets(trainable, dp.size, bucket_elements)
        self.buffers: List[torch.Tensor] = []
        self._bucket_of: Dict[int, int] = {}
        for index, bucket in enumerate(self.buckets):
            buffer = torch.zeros(sum(p.numel() for p in bucket), dtype=torch.float32, device=bucket[0].device)
            offset = 0
            for param in bucket:
                view = buffer[offset:offset + param.numel()].view_as(param)
                if param.dtype == torch.float32:
                    param.grad = view
                else:
                    param.main_grad = view
                self._bucket_of[id(param)] = index
                offset += param.numel()
            self.buffers.append(buffer)
        self.divide = divide_by_micro_batches
        self._micro_batches = 1
        self._counts: Dict[int, int] = {}
        self._ready = [0] * len(self.buckets)
        self._handles: List[Optional[dist.Work]] = [None] * len(self.buckets)
        for param in self.excluded:  # a 16-bit tied embedding sums in fp32 too, outside any bucket
            if param.dtype != torch.float32:
                param.main_grad = torch.zeros_like(param, dtype=torch.float32)
        #: Whether any parameter is 16-bit: its hook must widen every micro-batch's gradient, reduced or not.
        self.widens = any(p.dtype != torch.float32 for p in trainable + self.excluded)
        hooked = [p for b in self.buckets for p in b] if self.reduces or self.widens else []
        hooked += [p for p in self.excluded if p.dtype != torch.float32]
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in hooked]

    def begin(self, micro_batches: int) -> None:
        """Call before a step's first backward: a gradient is final after ``micro_batches`` accumulations."""
        self._micro_batches = micro_batches
        self._counts = {}

    def _on_grad(self, param: nn.Parameter) -> None:
        if param.dtype != torch.float32:
            # The micro-batch's 16-bit gradient added in fp32, then freed (DeepSpeed's
            # accumulate_hp_grads_and_remove_lp): the next micro-batch's starts from None again.
            param.main_grad.add_(param.grad)
            param.grad = None
        if not self.reduces or id(param) not in self._bucket_of:
            return
        count = self._counts[id(param)] = self._counts.get(id(param), 0) + 1
        if count != self._micro_batches:
            return
        index = self._bucket_of[id(param)]
        self._ready[index] += 1
        if self._ready[index] == len(self.buckets[index]):
            self._launch(index)

    def _launch(self, index: int) -> None:
        if self.divide:
            self.buffers[index].div_(self._micro_batches)
        # Async: the backward of the earlier layers goes on; waited for in finish().
        self._handles[index] = dist.all_reduce(self.buffers[index], group=self.group, async_op=True)

    def finish(self) -> None:
        """After the last micro-batch's backward: every bucket's mean over the replicas is in its gradients."""
        if not self.reduces:
            return
        for index in range(len(self.buckets)):
            if self._handles[index] is None:  # a parameter got no gradient this step: its bucket goes now
                self._launch(index)
        for index, handle in enumerate(self._handles):
            handle.wait()  # the wait for the launch in _on_grad (or just above)
            self.buffers[index].mul_(1.0 / self.dp)
        for param in self.excluded:  # its mean over the replicas is the caller's, after the tied copies' sum
            if self.divide and gradient(param) is not None:
                gradient(param).div_(self._micro_batches)
        self._ready = [0] * len(self.buckets)
        self._handles = [None] * len(self.buckets)
        self._counts = {}

    def zero(self) -> None:
        """Zeroes every gradient in place (the views stay the parameters' ``.grad``)."""
        for buffer in self.buffers:
            buffer.zero_()
        for param in self.excluded:
            if gradient(param) is not None:
                gradient(param).zero_()

    def remove(self) -> None:
        """Removes the hooks (an in-process restart frees the groups after it)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
