"""The data-parallel gradient reduction of a pipeline stage overlapped with the schedule's backward
(``--overlap-grad-reduce``).

Without it the stage's gradients are averaged over the data-parallel replicas after the whole schedule
(:func:`domino.train.pipeline_step.average_over_data_parallel`), exposed. Megatron's ``--overlap-grad-reduce``
(Megatron-LM d98e8a64 ``megatron/training/arguments.py``; ``megatron/core/distributed/param_and_grad_buffer.py``:
``_ParamAndGradBucketGroup.register_grad_ready`` launches a bucket's ``start_grad_sync`` once every parameter of the
bucket is ready, and under PP only on the last micro-batch, ``is_last_microbatch``) groups the parameters into
buckets in backward order and all-reduces each bucket asynchronously as soon as its gradients are final. Here:

- a post-accumulate-grad hook per parameter (``Tensor.register_post_accumulate_grad_hook``, torch 2.13) counts the
  micro-batches whose gradient reached ``.grad``; at the step's count the parameter's gradient is final;
- when the last parameter of a bucket is final, the bucket's gradients are copied into one flat buffer, divided by
  the micro-batch count (the division torch's schedule does with ``scale_grads=True``, so the schedule runs with
  ``scale_grads=False``: it would divide ``.grad`` again at its end) and all-reduced over the data-parallel group
  with ``async_op=True``, while the backward of the remaining micro-batches and layers goes on;
- :meth:`OverlappedGradReduce.finish`, before the tied-embedding sum and clipping, waits for every bucket, divides
  by the replica count and copies the means back into ``.grad``.

With ``--bf16`` the buckets are DeepSpeed's fp32 gradient buffers (``main_grad``), not ``.grad``; with ``--fp16`` the
still loss-scaled fp16 ``.grad`` (the unoverlapped fp16 step reduces those too).

The arithmetic is the unoverlapped path's (divide by the micro-batches, sum over the replicas, divide by their
count), so the gradients are bit-equal to it. The tied word embeddings are left out of the buckets and reduced
after the schedule as before: their copy is summed over the first and last stage first, and summing the two in
the other order would round differently. A parameter that got no gradient (none this step) is reduced in
:meth:`finish` too.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from domino.runtime.mesh import MeshGroup

#: Elements per bucket: Megatron's default ``--ddp-bucket-size`` (``max(40000000, 1000000 * dp)``,
#: ``megatron/core/distributed/distributed_data_parallel.py`` at d98e8a64).
DEFAULT_BUCKET_ELEMENTS = 40_000_000


def backward_order_buckets(params: List[nn.Parameter], data_parallel_size: int,
                           bucket_elements: Optional[int] = None) -> List[List[nn.Parameter]]:
    """The trainable ``params`` cut into buckets of about ``bucket_elements`` elements (default: Megatron's
    :data:`DEFAULT_BUCKET_ELEMENTS` rule at ``data_parallel_size``; at least one parameter each), in reverse
    registration order: the order the backward makes gradients final."""
    size = bucket_elements or max(DEFAULT_BUCKET_ELEMENTS, 1_000_000 * data_parallel_size)
    buckets: List[List[nn.Parameter]] = []
    current: List[nn.Parameter] = []
    elements = 0
    for param in reversed([p for p in params if p.requires_grad]):
        if current and elements + param.numel() > size:
            buckets.append(current)
            current, elements = [], 0
        current.append(param)
        elements += param.numel()
    return buckets + [current] if current else buckets


class OverlappedGradReduce:
    """Buckets of a stage's parameters whose data-parallel mean is launched from the backward.

    Args:
        params: the stage's parameters (all chunks'), in registration order; buckets are cut in reverse order,
            the order the backward makes gradients final.
        dp: the data-parallel group the buckets are averaged over (``ParallelMesh.dp``).
        exclude: parameters reduced after the schedule instead (the tied embedding copy).
        bucket_elements: elements per bucket (at least one parameter each).
        main_grad: ``main_grad(param)`` is the tensor the parameter's gradient accumulates in when it is not
            ``.grad``: a bf16 run's fp32 buffer in DeepSpeed's BF16_Optimizer, which its own post-accumulate hook
            (registered earlier, so run first: ``deepspeed/utils/torch.py`` ``register_grad_hook``) has just added
            the micro-batch's gradient to. Those are then scaled by ``1 / micro-batches`` (a multiplication, as
            :mod:`domino.train.pipeline_step` does on that path), ``.grad`` by a division (torch's
            ``scale_grads``).
        replicas: the group the buckets are summed over when it is larger than ``dp``: data x context parallel
            (``ParallelMesh.dp_cp``); the sum is still divided by the DP size.
    """

    def __init__(self, params: List[nn.Parameter], dp: MeshGroup, exclude: Optional[nn.Parameter] = None,
                 bucket_elements: Optional[int] = None,
                 main_grad: Optional[Callable[[nn.Parameter], torch.Tensor]] = None,
                 replicas: Optional[MeshGroup] = None) -> None:
        # Summed over every rank holding these weights (data x context parallel), divided by the data-parallel
        # replicas: context-parallel ranks hold shares of one loss, whose gradients add up.
        self.group = (replicas or dp).process_group
        self.dp = dp.size
        self.main_grad = main_grad
        self.excluded = [p for p in params if p is exclude]
        self.buckets = backward_order_buckets([p for p in params if p is not exclude], dp.size, bucket_elements)
        self._bucket_of: Dict[nn.Parameter, int] = {p: i for i, b in enumerate(self.buckets) for p in b}
        self._counts: Dict[nn.Parameter, int] = {}
        self._pending: List[int] = []
        self._launched: Dict[int, tuple] = {}
        self.micro_batches = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._bucket_of]

    def begin(self, micro_batches: int) -> None:
        """Arms the hooks for a step of ``micro_batches``: a parameter's gradient is final at that count."""
        self.micro_batches = micro_batches
        self._counts = dict.fromkeys(self._bucket_of, 0)
        self._pending = [len(b) for b in self.buckets]
        self._launched = {}

    def _on_grad(self, param: nn.Parameter) -> None:
        """Counts one micro-batch's gradient of ``param``; launches its bucket when the bucket is final."""
        if not self.micro_batches:
            return  # not inside a step armed by begin (an evaluation or a stray backward)
        count = self._counts[param] = self._counts[param] + 1
        if count != self.micro_batches:
            return
        index = self._bucket_of[param]
        self._pending[index] -= 1
        if self._pending[index] == 0:
            self._launch(index)

    def _launch(self, index: int) -> None:
        params = self.buckets[index]
        flat = _flatten_dense_tensors([self._grad(p) for p in params])
        self._scale(flat)
        # async: the bucket's DP sum runs while the backward of the other micro-batches and layers goes on;
        # waited for in finish()
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        self._launched[index] = (work, flat)

    def finish(self) -> None:
        """Waits for every bucket's reduction (launching any not yet final), then leaves the data-parallel mean
        of the step's gradients in ``.grad``; the excluded parameters' ``.grad`` divided by the micro-batch count
        only (their DP mean is the caller's)."""
        for index in range(len(self.buckets)):
            if index not in self._launched:
                self._launch(index)  # a parameter without this step's gradient: its bucket goes now
        for index, params in enumerate(self.buckets):
            work, flat = self._launched[index]
            work.wait()  # the bucket's DP sum launched from the backward (or just above)
            flat.div_(self.dp)
            for param, reduced in zip(params, _unflatten_dense_tensors(flat, params)):
                if self.main_grad is not None:  # DeepSpeed's buffer: a flat view
                    self.main_grad(param).copy_(reduced.reshape(self.main_grad(param).shape))
                elif param.grad is None:
                    param.grad = reduced.clone()
                else:
                    param.grad.copy_(reduced)
        for param in self.excluded:
            grad = self.main_grad(param) if self.main_grad is not None else param.grad
            if grad is not None:
                self._scale(grad)
        self.micro_batches = 0
        self._launched = {}

    def _grad(self, param: nn.Parameter) -> torch.Tensor:
        """The step's summed gradient of ``param`` so far (zeros where it has none)."""
        grad = self.main_grad(param) if self.main_grad is not None else param.grad
        return grad if grad is not None else torch.zeros_like(param)

    def _scale(self, grad: torch.Tensor) -> None:
        """The mean over the micro-batches from their sum, by the unoverlapped path's own operation."""
        if self.main_grad is not None:
            grad.mul_(1.0 / self.micro_batches)  # pipeline_step's _foreach_mul_ of the fp32 buffers
        else:
            grad.div_(self.micro_batches)  # torch's scale_grads division

    def remove(self) -> None:
        """Removes the hooks."""
        for hook in self._hooks:
            hook.remove()
