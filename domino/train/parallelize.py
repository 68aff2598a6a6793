"""``parallelize(model, mesh, config)``: the one place a model built for one device becomes this rank's share of a run.

The model (:class:`domino.model.GPTModel`) is built over the mesh's TP group, so its layers hold this rank's slices;
everything else a run's layout asks for is applied here, from outside the model, in one fixed order:

1. the pipeline stage cut (:func:`domino.pipeline.stages.split_model`): this rank's stage of ``mesh.pp``, or its
   interleaved model chunks (:class:`domino.pipeline.stages.VirtualStages`);
2. then, on each model chunk, sequence parallelism (:mod:`domino.overlap.sequence_parallel`), which must come
   first because Domino's chunks take its stack over;
3. Domino's overlapped schedule (:mod:`domino.overlap.schedule`);
4. activation recompute (:mod:`domino.model.recompute`), which marks the layer groups of whichever stack runs;
5. context-parallel attention's communication (``--cp-comm-type``): the ring each layer is built with, or the
   all-to-all over heads (:mod:`domino.parallel.all_to_all_attention`);
6. the numerics: the FP8 recipe of ``--fp8-format`` (:mod:`domino.parallel.fp8`) given to every tensor-parallel
   linear of the layers, a value each holds (the output layer, an embedding's weight, keeps high precision), and
   the kernel choice (``DOMINO_KERNELS``, read by the entry point: :mod:`domino.parallel.kernels`) given to every
   module that holds one (norms, linears, attention, the layers, the model's loss and stack).

torchtitan applies its parallelisms the same way, from one function per model family in a fixed order over a
model built on the meta device (``parallelize_llama`` in ``torchtitan/models/llama3/infra/parallelize.py``: TP,
activation checkpointing, compile, FSDP), and Megatron core builds each pipeline stage from its
``pre_process``/``post_process`` flags; context parallelism and FP8 recipes join this list, not the model.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from domino.config import DominoConfig
from domino.parallel import fp8
from domino.parallel.kernels import Kernels, apply_kernels
from domino.parallel.layers import apply_fp8
from domino.config.layout import virtual_stages
from domino.model.recompute import RecomputePlan, apply_activation_recompute
from domino.overlap.schedule import apply_domino
from domino.overlap.sequence_parallel import apply_sequence_parallel
from domino.parallel.all_to_all_attention import all_to_all_attention
from domino.parallel.ring_attention import ring_attention
from domino.pipeline.stages import model_chunks, split_model
from domino.runtime.mesh import ParallelMesh

#: The attention of each ``--cp-comm-type`` (:data:`domino.config.layout.CP_COMM_TYPES`).
CONTEXT_PARALLEL_ATTENTION = {"p2p": ring_attention, "a2a": all_to_all_attention}


def parallelize(model: nn.Module, mesh: ParallelMesh, config: DominoConfig,
                kernels: Optional[Kernels] = None) -> nn.Module:
    """This rank's part of ``model`` laid out as ``config`` and ``mesh`` ask (module docstring); returns it.

    Args:
        model: a whole ``GPTModel`` with its synchronous stack, built over ``mesh.tp``.
        mesh: the run's parallel layout (this rank's TP group and pipeline).
        config: the run's configuration (virtual stages, sequence parallelism, Domino chunks, recompute).
        kernels: the kernel table of every op (:func:`domino.parallel.kernels.for_device` of the entry point's
            choice); None leaves each op its device's own choice.

    Raises:
        ValueError: the model was built over another TP group than ``mesh.tp``, or already parallelized.
    """
    if model.tp != mesh.tp:
        raise ValueError(f"the model is split over {model.tp.size} TP rank(s) but the mesh's TP group has "
                         f"{mesh.tp.size}: build it with GPTModel(..., tp=mesh.tp)")
    if model.stack.fallback is not None or model.stack.units != [(0, len(model.layers), False)]:
        raise ValueError("parallelize() takes the model as built: sequence parallelism, Domino or recompute "
                         "was already applied")
    model = split_model(model, mesh.pp.rank, mesh.pp.size, virtual_stages(config))
    plan = RecomputePlan.from_config(config.train)
    attention = CONTEXT_PARALLEL_ATTENTION[config.parallel.cp_comm_type]
    fmt = config.train.fp8_format
    recipe = fp8.recipe(fmt, next(model.parameters()).device) if fmt else None  # the device the shards live on
    for chunk in model_chunks(model):
        if config.parallel.sequence_parallel:
            apply_sequence_parallel(chunk)
        apply_domino(chunk, config.parallel.domino_chunks or 1)
        apply_activation_recompute(chunk, plan)
        for layer in chunk.layers:
            layer.attention.context_parallel_attention = attention
        apply_fp8(chunk, recipe)
        apply_kernels(chunk, kernels)
    return model
