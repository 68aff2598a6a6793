"""The fp32 gradients kept beyond the ZeRO paper's accounting, and what of the estimate has been measured.

The ZeRO paper counts 2 + 2 + 12 bytes per parameter in mixed precision (:mod:`domino.config.estimate`). The
optimizers keep more: domino's own at ZeRO 0 and the engines DeepSpeed 0.19.8 builds for domino's config at ZeRO 1/2
(``domino/optim/deepspeed_config.py``, read from its source). The estimate's ``fp32_grads`` part counts them:

* **bf16, ZeRO 1** (``BF16_Optimizer``, ``deepspeed/runtime/bf16_optimizer.py`` ``_setup_for_real_optimizer``):
  ``fp32_groups_gradients_flat``, an fp32 gradient buffer the size of *all* this rank's parameters (``zeros_like``
  of the flat bf16 group, not partitioned), into which every micro-batch's bf16 gradients are summed: 4 bytes per
  parameter on every rank, beside the 2-byte bf16 gradients backward writes first. At GPT-1.3B and TP=1 that is
  4.9 GiB the paper's figure leaves out.
* **fp16/bf16, ZeRO 0** (domino's, no DeepSpeed: ``domino/optim/mixed_precision.py``): the fp32 main
  gradients, 4 bytes per parameter, reduced in place in their buckets (no flattening buffer).
* **fp16/bf16, ZeRO 1/2 otherwise** (``DeepSpeedZeroOptimizer``, ``deepspeed/runtime/zero/stage_1_and_2.py``):
  the fp32 gradients of this rank's partition (``averaged_gradients`` in ``gradient_accumulation_dtype``, or the
  fp32 copy ``step`` makes of the flat 16-bit partition): 4 bytes per parameter / DP.
* **the engine's flattening all-reduce** (``deepspeed/runtime/engine.py`` ``allreduce_gradients`` ->
  ``buffered_allreduce_fallback(elements_per_buffer=MEMORY_OPT_ALLREDUCE_SIZE)``, 5e8 elements): with more than
  one data-parallel replica, the BF16_Optimizer flattens the gradients into one buffer of up to
  5e8 elements per all-reduce (fp32: domino reduces fp32-accumulated gradients in fp32), i.e. up to 1.9 GB. domino
  turns that all-reduce off at one replica. fp32 at ZeRO 0 runs without DeepSpeed: its gradients are reduced in
  place, in the buckets they live in (``domino/optim/grad_buffer.py``), so it has no such buffer.
* **ZeRO 1/2 reduction buckets** (``DeepSpeedZeroOptimizer``'s ``ipg_buckets``, two of ``reduce_bucket_size``
  with ``overlap_comm``): counted with the other buffers in :mod:`domino.config.estimate`.

None of this has been measured on a GPU: see :data:`VALIDATION`.
"""

from __future__ import annotations

from typing import Dict

#: Elements per flattening all-reduce of DeepSpeed's engine (``MEMORY_OPT_ALLREDUCE_SIZE``, runtime/engine.py).
ENGINE_ALLREDUCE_ELEMENTS = 5e8

#: Which figures of ``domino estimate`` have been checked against a measurement, and where.
VALIDATION: Dict[str, str] = {
    "validated": "on CPU, fp32, TP 1 and 2, ZeRO 0/1 at one replica: weights, gradients, optimizer state, "
                 "activations (every recompute setting, sequence parallelism), logits and buffers, against live "
                 "tensor bytes within 6% (TP 1) and 10% (TP 2), each stage of 1F1B at PP 2 within 5%, and "
                 "context parallelism at CP 2 and 4 (the ring and the all-to-all, MHA and GQA, with and without "
                 "attention dropout) with one layer's attention at work (the ring's key/value and gradient "
                 "buffers, one block's scores, the all-to-all's exchange buffers) within 6% "
                 "(benchmarks/estimate_check.py, RESULTS.md)",
    "not_validated": "anything on a GPU (no GPU has run it yet): 1-byte dropout masks, fused attention's saved "
                     "tensors, bf16/fp16 tensors, DeepSpeed's buffers (counted from deepspeed 0.19.8's source), "
                     "the CUDA caching allocator's reserve beyond the usable fraction, the step time (an "
                     "assumed MFU; its communication on a link model checked only against the emulated-link "
                     "benchmark on CPU, Domino's hidden share carried from it), the interleaved schedule's stages (their micro-batches in flight checked "
                     "against torch's schedule tables only), and context parallelism on a GPU (its ring blocks' "
                     "textbook-softmax scores counted from the code, measured only on CPU with attention "
                     "dropout; fused kernels' own workspaces not counted)",
}


def fp32_gradient_bytes(parameters_per_rank: float, data_parallel_size: int, zero_stage: int, bf16: bool,
                        fp16: bool) -> Dict[str, float]:
    """The optimizer's fp32 gradient buffers per GPU beyond the ZeRO paper's count, in bytes, by name (see the
    module doc).

    Args:
        parameters_per_rank: this TP rank's parameters.
        data_parallel_size: replicas.
        zero_stage: 0, 1 or 2.
        bf16, fp16: the run's precision (fp32 when neither).
    """
    parts = {"fp32_gradient_accumulation": 0.0, "flatten_allreduce": 0.0}
    if (bf16 and zero_stage == 1) or ((bf16 or fp16) and zero_stage == 0):
        # ZeRO 0 in 16 bits is domino's fp32 main gradients (domino/optim/mixed_precision.py): 4 bytes too.
        parts["fp32_gradient_accumulation"] = 4 * parameters_per_rank
    elif (bf16 or fp16) and zero_stage >= 1:
        parts["fp32_gradient_accumulation"] = 4 * parameters_per_rank / data_parallel_size
    if data_parallel_size > 1 and bf16 and zero_stage == 1:  # domino's ZeRO 0 reduces its buckets in place
        parts["flatten_allreduce"] = min(parameters_per_rank, ENGINE_ALLREDUCE_ELEMENTS) * 4  # fp32, reduced in fp32
    return parts
