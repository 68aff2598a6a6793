"""The parallel layout of a run as one value: :class:`ParallelMesh`, built once at start and passed down.

Ranks are laid out as in Megatron-LM's default order ``tp-cp-ep-dp-pp`` (``RankGenerator`` and
``generate_masked_orthogonal_rank_groups`` in NVIDIA/Megatron-LM ``megatron/core/parallel_state.py``, commit
00caa53), which without expert parallelism reads
``global = tp_rank + cp_rank * tp + dp_rank * tp * cp + pp_rank * tp * cp * dp``: the ``tp`` consecutive ranks form
one tensor-parallel group (each holds a slice of every layer of its stage), ranks ``tp`` apart with the same replica
and stage a context-parallel group (each holds two chunks of every sequence), ranks with the same TP and CP position
and stage a data-parallel group (each reads its own samples), and ranks ``tp * cp * dp`` apart a pipeline group
(one per stage). Weights are replicated over data *and* context parallelism, so gradients are reduced, and ZeRO
shards, over the ``dp_cp`` group of both (Megatron's ``get_data_parallel_group(with_context_parallel=True)``); at
CP 1 it is the data-parallel group itself. The embedding group joins the first and the last stage of each pipeline
(Megatron's ``default_embedding_ranks``): the tied word embeddings' gradients are summed over it.

The mesh is what torchtitan's ``ParallelDims`` (``torchtitan/distributed/parallel_dims.py``) and Megatron core's
``ProcessGroupCollection`` (``megatron/core/process_groups_config.py``, Megatron-LM d98e8a64) are to their models: the
model builder, the layers and their collectives, the pipeline, the checkpoint code and evaluation receive it (or one
of its :class:`MeshGroup` s) as an argument instead of reading a process-wide global, so two models of different
layouts can live in one process (``ParallelMesh.single()`` is the layout of one device, in any world).
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from domino.config.validate import check_tensor_parallel_size
from domino.runtime.comm_timing import CommTimer
from domino.runtime.network_emulator import LinkEmulator


def collective_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """The device a collective over ``group`` needs its tensors on: this process's GPU for NCCL, else CPU.

    NCCL only moves CUDA tensors and gloo reads CPU ones (``check_gpu_single_tensor`` in pytorch/pytorch
    ``torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp`` rejects a CPU tensor: "Tensors must be CUDA and dense"), so
    every small bookkeeping tensor a collective reduces (flags, loss sums) is created here. Without
    ``torch.distributed``: the current CUDA device when there is one, else CPU.
    """
    if dist.is_initialized():
        backend = dist.get_backend(group)
        if "nccl" in str(backend):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@dataclass(frozen=True)
class RankGrid:
    """Every group of a ``tp x cp x dp x pp`` world as lists of global ranks, in Megatron's order (module docstring)."""

    tp: List[List[int]]
    dp: List[List[int]]
    pp: List[List[int]]
    embedding: List[List[int]]
    cp: List[List[int]] = field(default_factory=list)
    dp_cp: List[List[int]] = field(default_factory=list)

    @classmethod
    def build(cls, world_size: int, tensor_model_parallel_size: int, pipeline_model_parallel_size: int = 1,
              context_parallel_size: int = 1) -> "RankGrid":
        """The groups of ``world_size`` ranks; the sizes must divide it (:func:`check_tensor_parallel_size`)."""
        tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
        check_tensor_parallel_size(world_size, tp, pp, cp)
        dp = world_size // (tp * pp * cp)
        per_stage = tp * cp * dp

        def rank(t: int, d: int, p: int, c: int = 0) -> int:
            return t + c * tp + d * tp * cp + p * per_stage

        pipelines = [[rank(t, d, p, c) for p in range(pp)] for d in range(dp) for c in range(cp) for t in range(tp)]
        return cls(tp=[[rank(t, d, p, c) for t in range(tp)] for p in range(pp) for d in range(dp) for c in range(cp)],
                   dp=[[rank(t, d, p, c) for d in range(dp)] for p in range(pp) for t in range(tp) for c in range(cp)],
                   pp=sorted(pipelines),
                   embedding=sorted([ranks[0], ranks[-1]] if len(ranks) > 1 else ranks[:1] for ranks in pipelines),
                   cp=sorted([rank(t, d, p, c) for c in range(cp)] for p in range(pp) for d in range(dp)
                             for t in range(tp)),
                   dp_cp=sorted(sorted(rank(t, d, p, c) for d in range(dp) for c in range(cp))
                                for p in range(pp) for t in range(tp)))


@dataclass(frozen=True)
class MeshGroup:
    """One dimension of the mesh as this rank sees it: the ranks of its group, its place among them, the process
    group collectives over it run on, and the emulated link they ride (TP only).

    Attributes:
        ranks: the group's global ranks, in order (``(0,)`` for a lone process).
        rank: this process's index in ``ranks``.
        process_group: the ``torch.distributed`` group; None for a group of one (every collective is an identity).
        link: the emulated interconnect of this group's collectives (``DOMINO_SIMULATED_NETWORK``), or None.
        timer: where the blocked time of this group's collectives is counted (the training loop reads its TP
            group's); not part of the group's identity.
    """

    ranks: Tuple[int, ...] = (0,)
    rank: int = 0
    process_group: Optional[dist.ProcessGroup] = None
    link: Optional[LinkEmulator] = None
    timer: CommTimer = field(default_factory=CommTimer, compare=False, repr=False)

    @property
    def size(self) -> int:
        """Number of ranks in the group."""
        return len(self.ranks)

    @property
    def first_rank(self) -> int:
        """Global rank of the group's first member (e.g. the TP rank that reads the data and broadcasts it)."""
        return self.ranks[0]

    @classmethod
    def shapes_only(cls, size: int, rank: int = 0) -> "MeshGroup":
        """A group of ``size`` ranks without a process group, seen from position ``rank``: it sizes a model's
        slices (a skeleton on the meta device, a checkpoint tool's shard) but runs no collective."""
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in a group of {size}")
        return cls(tuple(range(size)), rank)


SINGLE = MeshGroup()  # the group of one process


@dataclass(frozen=True)
class ParallelMesh:
    """The run's parallel layout from this rank's point of view (module docstring).

    Attributes:
        tp: this rank's tensor-parallel group (with the emulated link, if any).
        dp: its data-parallel group (ZeRO shards over it).
        pp: its pipeline, stage 0 first (a group of one at pipeline size 1).
        embedding: the first and last stage of its pipeline when this rank is on one of them and the pipeline
            has more than one stage, else None (a middle stage holds no copy of the tied embeddings).
        global_rank: this process's rank in the world.
        world_size: processes in the world.
        cp: its context-parallel group: the ranks that split this replica's sequences (attention's ring).
        context_replicas: the ranks holding the same weights over data and context parallelism when CP > 1; None
            at CP 1, where they are the data-parallel group (read it as :attr:`dp_cp`).
    """

    tp: MeshGroup = SINGLE
    dp: MeshGroup = SINGLE
    pp: MeshGroup = SINGLE
    embedding: Optional[MeshGroup] = None
    global_rank: int = 0
    world_size: int = 1
    cp: MeshGroup = SINGLE
    context_replicas: Optional[MeshGroup] = None

    @property
    def dp_cp(self) -> MeshGroup:
        """The ranks holding the same weights, over data and context parallelism: gradients are reduced and ZeRO
        shards over it (the data-parallel group itself at CP 1)."""
        return self.context_replicas if self.context_replicas is not None else self.dp

    @classmethod
    def single(cls) -> "ParallelMesh":
        """The layout of one device (every size 1, no groups): a model built with it runs without communication
        in any world."""
        return cls()

    @classmethod
    def build(cls, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
              timeout_minutes: Optional[int] = None, tp_link: Optional[LinkEmulator] = None,
              tp_options=None, context_parallel_size: int = 1) -> "ParallelMesh":
        """Creates the groups of the current ``torch.distributed`` world (collective: every rank calls it, in the
        same order), or the single-process mesh when ``torch.distributed`` is not initialised.

        Args:
            tensor_model_parallel_size: TP size (must divide the world with the pipeline size).
            pipeline_model_parallel_size: pipeline stages.
            timeout_minutes: bound of every collective of the new groups. ``dist.new_group`` without one takes
                torch's default (30 minutes for gloo, 10 for NCCL; torch 2.13
                ``distributed_c10d._new_group_with_tag`` -> ``_get_default_timeout``), not the world group's.
            tp_link: the emulated TP interconnect, if any.
            tp_options: backend options of the TP groups (``pg_options``), e.g. NCCL's high-priority stream.
            context_parallel_size: CP size (ranks that split each sequence).
        """
        tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
        world = dist.get_world_size() if dist.is_initialized() else 1
        grid = RankGrid.build(world, tp, pp, cp)
        if not dist.is_initialized():
            return cls(tp=dataclasses.replace(SINGLE, link=tp_link))
        me = dist.get_rank()
        timeout = datetime.timedelta(minutes=timeout_minutes) if timeout_minutes else None

        def mine(all_ranks: List[List[int]], options=None, link=None) -> Optional[MeshGroup]:
            # Every rank must create every group, in the same order (new_group is collective).
            found = None
            for ranks in all_ranks:
                group = dist.new_group(ranks, timeout=timeout, pg_options=options)
                if me in ranks:
                    found = MeshGroup(tuple(ranks), ranks.index(me), group, link)
            return found

        tp_group = mine(grid.tp, tp_options, tp_link)
        dp_group = mine(grid.dp)
        pp_group, embedding = MeshGroup((me,)), None
        if pp > 1:
            pp_group = mine(grid.pp)
            embedding = mine(grid.embedding)  # None on a middle stage
        cp_group, dp_cp_group = MeshGroup((me,)), None
        if cp > 1:
            cp_group, dp_cp_group = mine(grid.cp), mine(grid.dp_cp)
        return cls(tp=tp_group, dp=dp_group, pp=pp_group, embedding=embedding, global_rank=me, world_size=world,
                   cp=cp_group, context_replicas=dp_cp_group)

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank's stage holds the embeddings (always at pipeline size 1)."""
        return self.pp.rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank's stage holds the final norm, the output layer and the loss (always at PP 1)."""
        return self.pp.rank == self.pp.size - 1

    def with_tp_link(self, link: Optional[LinkEmulator]) -> "ParallelMesh":
        """The same mesh with its TP collectives on ``link`` (None: real communication only)."""
        return dataclasses.replace(self, tp=dataclasses.replace(self.tp, link=link))

    def describe(self) -> str:
        """``TP t x PP p x DP d`` (``x CP c`` when the sequences are split) with this rank's coordinates, for logs."""
        cp, cp_rank = (f" x CP {self.cp.size}", f", cp {self.cp.rank}") if self.cp.size > 1 else ("", "")
        return (f"TP {self.tp.size}{cp} x PP {self.pp.size} x DP {self.dp.size} "
                f"(rank {self.global_rank}: tp {self.tp.rank}{cp_rank}, pp {self.pp.rank}, dp {self.dp.rank})")
