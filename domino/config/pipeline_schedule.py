"""The arithmetic of a pipeline-parallel schedule, before launch: the layer split, the micro-batches each stage
keeps in flight, the bubble and the bytes between stages (what ``domino estimate`` and the launcher's checks read).

Notation: ``p`` pipeline stages (``--pipeline-model-parallel-size``), ``v`` model chunks per stage (the
interleaved schedule's virtual stages; 1 is plain 1F1B), ``m`` micro-batches per step (global batch / (micro-batch
x data-parallel size)), ``r`` the stage's rank in the pipeline (0 = the first stage, with the embedding).

* **Layer split** (Megatron-LM ``megatron/training/arguments.py``, ``validate_args``, core_r0.11.0 commit
  7c00175e): ``--num-layers`` must be divisible by ``p`` ("Number of layers should be divisible by the
  pipeline-model-parallel size"); with ``--num-layers-per-virtual-pipeline-stage n`` the layers per stage must be
  divisible by ``n`` and ``v = L / p / n``; the interleaved schedule needs ``p > 1`` (``> 2`` with
  ``--no-overlap-p2p-communication``). Virtual stage ``k`` holds layers ``[k L/(p v), (k+1) L/(p v))`` and runs on
  rank ``k mod p`` (``get_transformer_layer_offset`` in ``megatron/core/transformer/transformer_layer.py``).
* **Micro-batches in flight**: Megatron (``megatron/core/pipeline_parallel/schedules.py``: core_r0.11.0 in
  ``forward_backward_pipelining_without_interleaving`` / ``_with_interleaving``, main at d98e8a64 (2026-08) in
  ``get_pp_rank_microbatches``) warms rank ``r`` up with ``p - r - 1`` forwards under 1F1B and
  ``2 (p - r - 1) + (v - 1) g`` under the interleaved schedule (``g``: ``--microbatch-group-size-per-virtual-
  pipeline-stage``, default ``p``, ``ModelParallelConfig.__post_init__``), at most ``v m``; the steady state then
  runs one forward before each backward, so ``warm-up + 1`` forwards' activations are alive at once (at most
  ``v m``). torch's ``Schedule1F1B`` (torch 2.13 ``torch/distributed/pipelining/schedules.py``) warms up with
  ``min(m, p - r)`` forwards and runs backward first in its steady state: the same peak. Its
  ``ScheduleInterleaved1F1B`` (``_get_warmup_ops``) uses ``(v - 1) m/rounds + 2 (p - 1 - r)``, Megatron's figure
  whenever ``m`` is a multiple of ``p``. One chunk's activations are ``1/v`` of the stage's, so the first stage of
  the interleaved schedule holds ``p + (p - 1)/v`` micro-batches' worth once ``m >= p + (p - 1)/v`` (1F1B: ``p``
  once ``m >= p``; fewer micro-batches are all in flight).
* **Bubble**: Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", arXiv 2104.04473, sections 2.2.1 and 2.2.2): the idle time of 1F1B is ``(p - 1)`` forward+backward
  slots against ``m`` of work, ``(p - 1)/m`` of the ideal time, and the interleaved schedule divides it by ``v``.
  As a share of the whole step: ``(p - 1) / (m + p - 1)`` and ``(p - 1) / (v m + p - 1)``.
* **Bytes between stages**: every micro-batch crosses ``v p - 1`` stage boundaries forward (its activation) and
  as many backward (that activation's gradient), each a ``[s, b, h]`` tensor per TP rank, ``[s/t, b, h]`` with
  sequence parallelism (``tensor_shape[0] //= tp_group.size()`` in schedules.py).
"""

from __future__ import annotations

from typing import List, Optional

#: Megatron's default, with p2p overlap on (``--no-overlap-p2p-communication`` unset): interleaving needs p > 1.
INTERLEAVED_MIN_STAGES = 2


def layer_split_problems(num_layers: int, pipeline_model_parallel_size: int,
                         virtual_pipeline_model_parallel_size: int = 1) -> List[str]:
    """Megatron's rules for splitting ``num_layers`` over ``p`` stages of ``v`` chunks, one message each (empty: fine).

    Args:
        num_layers: --num-layers.
        pipeline_model_parallel_size: p.
        virtual_pipeline_model_parallel_size: v (1: plain 1F1B).
    """
    p, v = pipeline_model_parallel_size, virtual_pipeline_model_parallel_size
    problems = []
    if p < 1 or v < 1:
        return [f"--pipeline-model-parallel-size must be >= 1, got {p}" if p < 1 else
                f"--virtual-pipeline-model-parallel-size must be >= 1, got {v}"]
    if num_layers % p:
        problems.append(f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {p} "
                        "(every stage holds the same number of layers, as Megatron requires)")
    elif (num_layers // p) % v:
        problems.append(f"--num-layers {num_layers} / --pipeline-model-parallel-size {p} = {num_layers // p} layers "
                        f"per stage do not split into {v} virtual stages")
    if v > 1 and p < INTERLEAVED_MIN_STAGES:
        problems.append(f"--virtual-pipeline-model-parallel-size {v}: the interleaved schedule needs "
                        f"--pipeline-model-parallel-size >= {INTERLEAVED_MIN_STAGES}, got {p}")
    return problems


def microbatch_problems(num_microbatches: int, pipeline_model_parallel_size: int,
                        virtual_pipeline_model_parallel_size: int = 1) -> List[str]:
    """The interleaved schedule's rule on ``m`` (Megatron's ``forward_backward_pipelining_with_interleaving``, default
    group size ``p``: ``m >= p`` and ``m mod p`` 0 or >= p, i.e. a multiple of ``p``); 1F1B takes any ``m``."""
    p, v, m = pipeline_model_parallel_size, virtual_pipeline_model_parallel_size, num_microbatches
    if v > 1 and (m < p or m % p):
        return [f"the interleaved schedule needs the micro-batches per step ({m}: global batch / (micro-batch x "
                f"data-parallel size)) to be a multiple of --pipeline-model-parallel-size {p}"]
    return []


def warmup_microbatches(rank: int, pipeline_model_parallel_size: int, num_microbatches: int,
                        virtual_pipeline_model_parallel_size: int = 1,
                        microbatch_group_size: Optional[int] = None) -> int:
    """Forwards (of one model chunk each) rank ``rank`` runs before its first backward: Megatron's
    ``get_pp_rank_microbatches`` (see the module doc)."""
    p, v, m = pipeline_model_parallel_size, virtual_pipeline_model_parallel_size, num_microbatches
    if p == 1:
        return 0
    if v == 1:
        warmup = p - rank - 1
    else:
        warmup = 2 * (p - rank - 1) + (v - 1) * (microbatch_group_size or p)
    return min(warmup, v * m)


def in_flight_chunks(rank: int, pipeline_model_parallel_size: int, num_microbatches: int,
                     virtual_pipeline_model_parallel_size: int = 1) -> int:
    """Model-chunk forwards of rank ``rank`` whose activations are alive at once at its peak: warm-up + 1, at
    most all ``v m`` of them (see the module doc)."""
    v, m = virtual_pipeline_model_parallel_size, num_microbatches
    return min(warmup_microbatches(rank, pipeline_model_parallel_size, m, v) + 1, v * m)


def in_flight_microbatches(rank: int, pipeline_model_parallel_size: int, num_microbatches: int,
                           virtual_pipeline_model_parallel_size: int = 1) -> float:
    """:func:`in_flight_chunks` in micro-batches of the whole stage (one chunk is ``1/v`` of the stage's layers):
    ``min(p - r, m)`` under 1F1B; ``p + (p - 1)/v`` on the first stage of the interleaved schedule once
    ``m >= p + (p - 1)/v``."""
    v = virtual_pipeline_model_parallel_size
    return in_flight_chunks(rank, pipeline_model_parallel_size, num_microbatches, v) / v


def chunks_beside_gradients(rank: int, pipeline_model_parallel_size: int, num_microbatches: int,
                            virtual_pipeline_model_parallel_size: int = 1) -> int:
    """Chunk forwards alive (the one being back-propagated included) at the stage's second backward, when the
    gradients of the first already exist (they accumulate over the step): warm-up + 1 when a steady state follows
    the warm-up, one fewer than all ``v m`` when the warm-up holds them all, 0 with a single one."""
    v, m = virtual_pipeline_model_parallel_size, num_microbatches
    warmup = warmup_microbatches(rank, pipeline_model_parallel_size, m, v)
    if v * m > warmup + 1:  # a steady state: forward, then backward with warm-up + 1 alive
        return warmup + 1
    return v * m - 1  # only the cool-down's backwards after the first: one fewer alive each


def bubble_fraction(pipeline_model_parallel_size: int, num_microbatches: int,
                    virtual_pipeline_model_parallel_size: int = 1) -> float:
    """Share of the step a stage idles: ``(p - 1) / (v m + p - 1)`` (Narayanan et al. 2021; see the module doc)."""
    p, v, m = pipeline_model_parallel_size, virtual_pipeline_model_parallel_size, num_microbatches
    return (p - 1) / (v * m + p - 1)


def p2p_bytes_per_step(rank: int, pipeline_model_parallel_size: int, num_microbatches: int,
                       message_bytes: float, virtual_pipeline_model_parallel_size: int = 1) -> float:
    """Bytes rank ``rank`` sends to its pipeline neighbours in one step: each chunk's output activation forward
    (not the last virtual stage's) and each chunk's input gradient backward (not the first virtual stage's)."""
    p, v, m = pipeline_model_parallel_size, virtual_pipeline_model_parallel_size, num_microbatches
    if p == 1:
        return 0.0
    forward = v * m - (m if rank == p - 1 else 0)
    backward = v * m - (m if rank == 0 else 0)
    return (forward + backward) * message_bytes
