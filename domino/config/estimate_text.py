"""The one-line summaries ``domino estimate`` prints of an :class:`~domino.config.estimate.Estimate`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the estimate imports these lines back: a type only, no import cycle at run time
    from domino.config.estimate import Estimate

GB = 2**30


def describe(estimate: Estimate) -> str:
    """One line: the layout and its memory parts in GiB (with a pipeline: the fullest stage's, and the bubble)."""
    lay, mem = estimate.layout, estimate.memory_gb()
    recompute = lay.recompute if lay.recompute != "full" else \
        f"full/{lay.recompute_method}/{lay.recompute_num_layers}"
    parts = ", ".join(f"{k} {v:.2f}" for k, v in mem.items())
    pp, v = lay.pipeline_model_parallel_size, lay.virtual_pipeline_model_parallel_size
    pipeline = "" if pp == 1 else f" x PP {pp}" + (f" (interleaved, {v} chunks per stage)" if v > 1 else "")
    pipeline += f" x CP {lay.context_parallel_size}" if lay.context_parallel_size > 1 else ""
    where = "" if pp == 1 else (f" on stage {estimate.stage} of {pp}, {estimate.num_microbatches} micro-batches, "
                                f"bubble {100 * estimate.bubble_fraction:.1f}%")
    return (f"TP {lay.tensor_model_parallel_size}{pipeline} x DP {lay.data_parallel_size}, ZeRO {lay.zero_stage}, "
            f"micro-batch {lay.micro_batch_size}, recompute {recompute}, SP {'on' if lay.sequence_parallel else 'off'}"
            f": {parts} GiB per GPU{where}")


def describe_pipeline(estimate: Estimate) -> str:
    """One line: each stage's total and the bytes the busiest stage sends its neighbours per step."""
    stages = ", ".join(f"{total / GB:.2f}" for total in estimate.stage_totals)
    return (f"total per stage {stages} GiB (first to last); {estimate.p2p_bytes_per_step / GB:.3f} GiB sent to "
            f"neighbouring stages per step by the busiest stage; bubble {100 * estimate.bubble_fraction:.1f}% of "
            f"the step at {estimate.num_microbatches} micro-batches")
