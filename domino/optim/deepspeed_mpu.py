"""DeepSpeed's view of one :class:`~domino.runtime.mesh.ParallelMesh`: the ``mpu`` object its engine is given.

``deepspeed.initialize(mpu=...)`` takes Megatron's old ``mpu`` module interface: the engine, its ZeRO and BF16
optimizers and ``deepspeed.utils.groups`` ask it for the tensor-, data- and pipeline-parallel groups, sizes and
ranks, preferring the ``get_tensor_model_parallel_*`` names and falling back to ``get_model_parallel_*``
(deepspeed 0.19.8 ``utils/bwc.py``: ``bwc_tensor_model_parallel_world_size`` and friends use ``hasattr``; the
ZeRO optimizer calls ``mpu.get_model_parallel_group`` for its norm and overflow reductions,
``runtime/zero/stage_1_and_2.py``). Answering from a mesh value, not from the process-wide shim, lets the engine be
built over the mesh the trainer passes down.

Context parallelism is answered through DeepSpeed's sequence-parallel getters (its Ulysses interface,
``get_sequence_parallel_*`` and ``get_sequence_data_parallel_*``, read by ``utils/groups.py`` with ``hasattr``):
the engine then reduces gradients over the data x context group and divides by the data-parallel size only,
summing the context-parallel ranks' shares of the loss (``_reduce_non_expert_gradients`` in ``runtime/engine.py``;
the ZeRO optimizer's ``average_tensor`` divides by ``dp_world_size / sequence_parallel_size`` the same way,
``runtime/zero/stage_1_and_2.py``), ZeRO shards over it, and the batch size counts data-parallel replicas only
(``runtime/config.py`` reads ``get_data_parallel_world_size``). At CP 1 these are the data-parallel group's.
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

    def get_sequence_parallel_group(self) -> Optional[dist.ProcessGroup]:
        """This rank's context-parallel group (the ranks splitting its sequences)."""
        return self.mesh.cp.process_group

    def get_sequence_parallel_world_size(self) -> int:
        """Ranks splitting each sequence."""
        return self.mesh.cp.size

    def get_sequence_parallel_rank(self) -> int:
        """This rank's position among them."""
        return self.mesh.cp.rank

    def get_sequence_data_parallel_group(self) -> Optional[dist.ProcessGroup]:
        """The ranks holding the same weights (data x context parallel): gradients are reduced over it."""
        return self.mesh.dp_cp.process_group

    def get_sequence_data_parallel_world_size(self) -> int:
        """Ranks holding the same weights."""
        return self.mesh.dp_cp.size

    def get_sequence_data_parallel_rank(self) -> int:
        """This rank's position among them."""
        return self.mesh.dp_cp.rank

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
