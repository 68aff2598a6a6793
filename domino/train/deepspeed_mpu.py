"""DeepSpeed's view of one :class:`~domino.runtime.mesh.ParallelMesh`: the ``mpu`` object its engine is given.

``deepspeed.initialize(mpu=...)`` takes Megatron's old ``mpu`` module interface: the engine, its ZeRO and BF16
optimizers and ``deepspeed.utils.groups`` ask it for the tensor-, data- and pipeline-parallel groups, sizes and
ranks, preferring the ``get_tensor_model_parallel_*`` names and falling back to ``get_model_parallel_*``
(deepspeed 0.19.8 ``utils/bwc.py``: ``bwc_tensor_model_parallel_world_size`` and friends use ``hasattr``; the
ZeRO optimizer calls ``mpu.get_model_parallel_group`` for its norm and overflow reductions,
``runtime/zero/stage_1_and_2.py``). Answering from a mesh value, not from the process-wide shim, lets the engine be
built over the mesh the trainer passes down. Sequence parallelism in DeepSpeed's sense (Ulysses,
``get_sequence_parallel_*``) is not offered: DeepSpeed then takes the sequence-parallel world as 1
(``utils/groups.py`` ``_get_sequence_parallel_world_size`` checks ``hasattr`` and returns 1).
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from domino.runtime.mesh import ParallelMesh


class DeepSpeedMpu:
    """The ``mpu`` interface DeepSpeed 0.19.8 reads, answered from ``mesh`` (DeepSpeed's "model parallel" is
    domino's tensor parallel).

    Args:
        mesh: The run's layout.
    """

    def __init__(self, mesh: ParallelMesh):
        self.mesh = mesh

    def get_tensor_model_parallel_group(self) -> Optional[dist.ProcessGroup]:
        """This rank's TP group (None for one process)."""
        return self.mesh.tp.process_group

    def get_tensor_model_parallel_world_size(self) -> int:
        """Ranks in this rank's TP group."""
        return self.mesh.tp.size

    def get_tensor_model_parallel_rank(self) -> int:
        """This rank's position in its TP group."""
        return self.mesh.tp.rank

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of TP rank 0 of this rank's group."""
        return self.mesh.tp.first_rank

    def get_data_parallel_group(self) -> Optional[dist.ProcessGroup]:
        """This rank's data-parallel group (None for one process)."""
        return self.mesh.dp.process_group

    def get_data_parallel_world_size(self) -> int:
        """Data-parallel replicas."""
        return self.mesh.dp.size

    def get_data_parallel_rank(self) -> int:
        """This rank's replica."""
        return self.mesh.dp.rank

    def get_pipeline_model_parallel_group(self) -> Optional[dist.ProcessGroup]:
        """This rank's pipeline group (None at one stage)."""
        return self.mesh.pp.process_group

    def get_pipeline_model_parallel_world_size(self) -> int:
        """Pipeline stages."""
        return self.mesh.pp.size

    def get_pipeline_model_parallel_rank(self) -> int:
        """This rank's stage."""
        return self.mesh.pp.rank

    get_model_parallel_group = get_tensor_model_parallel_group
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_src_rank = get_tensor_model_parallel_src_rank
