"""The run's optimizer: which implementation of :class:`~domino.optim.interface.TrainingOptimizer` its settings take."""

from __future__ import annotations

from torch import nn

from domino.config import DominoConfig
from domino.optim.deepspeed_config import zero_stage
from domino.optim.interface import TrainingOptimizer
from domino.optim.torch_optimizer import build_torch_optimizer, uses_torch_optimizer
from domino.runtime.mesh import ParallelMesh


def build_optimizer(model: nn.Module, config: DominoConfig, mesh: ParallelMesh) -> TrainingOptimizer:
    """ZeRO 0: torch's AdamW with domino's bucketed gradients, no DeepSpeed (:mod:`domino.optim.torch_optimizer`
    in fp32; with bf16/fp16 weights fp32 masters and fp32 main gradients, :mod:`domino.optim.mixed_precision`);
    ZeRO 1/2: DeepSpeed's ZeRO and 16-bit optimizers (:mod:`domino.optim.deepspeed_optimizer`)."""
    if uses_torch_optimizer(zero_stage(config, mesh.dp.size)):
        return build_torch_optimizer(model, config, mesh)
    from domino.optim.deepspeed_optimizer import build_deepspeed_optimizer  # imports DeepSpeed when it runs

    return build_deepspeed_optimizer(model, config, mesh)
