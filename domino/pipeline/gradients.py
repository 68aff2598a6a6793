"""What the gradients of a pipeline stage need after the schedule's backward, before the optimizer step.

The tied word embeddings live on the first stage (the input lookup) and, as a copy, on the last (the output layer,
:mod:`domino.pipeline.stages`). Unsplit, the one matrix's gradient is the sum of both uses; here each copy holds
one use's share, so the two are summed over the embedding group (Megatron-LM's ``_allreduce_word_embedding_grads``,
``megatron/core/distributed/finalize_model_grads.py``, run after the schedule and before the data-parallel
reduction's step). Both copies then hold the same gradient and take the same update.

The data-parallel reduction itself stays DeepSpeed's (:mod:`domino.optim.deepspeed_config`): it reads ``.grad`` at the step.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from domino.pipeline.stages import is_shared_copy
from domino.runtime.mesh import ParallelMesh


def tied_embedding_weight(model: nn.Module, mesh: ParallelMesh) -> Optional[nn.Parameter]:
    """This stage's copy of the tied word embeddings: the first stage's lookup table, the last stage's output
    layer; None on a middle stage, with untied output weights, or at one stage of ``mesh.pp``."""
    if mesh.pp.size == 1 or model.config.untie_embeddings_and_output_weights:
        return None
    if model.pre_process:
        return model.embedding.word_embeddings.weight
    if model.post_process and is_shared_copy(model.output_layer.weight):
        return model.output_layer.weight
    return None


def sync_tied_embeddings(model: nn.Module, mesh: ParallelMesh,
                         main_grads: Optional[Dict[nn.Parameter, torch.Tensor]] = None) -> None:
    """Sums the tied word embeddings' gradient over the first and the last stage (``mesh.embedding``; a no-op
    elsewhere and at one stage). Call it on every rank after the schedule's backward, before gradient clipping and
    the step.
    ``main_grads`` maps parameters to the fp32 buffers their gradients accumulate in (a bf16 run's), else
    ``.grad`` is summed."""
    weight = tied_embedding_weight(model, mesh)
    if weight is None or mesh.embedding is None:
        return
    group = mesh.embedding.process_group
    if main_grads is not None:
        dist.all_reduce(main_grads[weight], group=group)  # synchronous: the step reads it next
        return
    if weight.grad is None:  # a stage whose copy got no gradient still takes part in the sum
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(weight.grad, group=group)  # synchronous: the step reads it next


def norm_parameters(params: List[nn.Parameter]) -> List[nn.Parameter]:
    """The parameters a gradient norm counts on this rank: all but the last stage's tied copy (the first stage's
    copy stands for both, as Megatron's ``param_is_not_shared``)."""
    return [p for p in params if not is_shared_copy(p)]
