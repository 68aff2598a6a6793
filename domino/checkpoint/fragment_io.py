"""The optimizer state written as ZeRO holds it: each rank its own fragments, nothing gathered.

Under ZeRO 1/2 (and DeepSpeed's BF16_Optimizer) a data-parallel rank holds, of each parameter's fp32 master
weight and Adam moments, a fragment: a range of the flattened TP-local slice, cut wherever the flat partition
boundary falls (:func:`domino.optim.state.local_fragments`). Storing whole slices by global shape
(:mod:`domino.checkpoint.distributed_io`) needs every fragment gathered first: an all-reduce of three tensors per
parameter over the group, on the training thread, before an asynchronous save can return. Here each rank writes
its fragments as they are, so the snapshot is a local copy.

A fragment is rarely a box of the tensor (a range of a row-major ``[rows, cols]`` slice is a partial row, full
rows and a partial row), and DCP's safetensors storage keeps one slice per tensor name per file
(``torch/distributed/checkpoint/filesystem.py``, ``_write_files_from_queue``: the file's tensors and
``DCP_SHARDING_INFO`` offsets keyed by name; torch 2.13). So each tensor ``KEY.NAME`` is stored as the
``[R, N]`` matrix of its TP-local slices flattened, one row per TP rank (``R`` = the writer's TP size for a
tensor split over TP, 1 for a replicated one, ``N`` the slice's element count); a fragment is then one
``[1, n]`` box of its row, written by a custom DCP save plan. The rows of a replicated tensor are the same
on every TP rank and DCP keeps one (``_dedup_save_plans.py``).

Reading on the writer's TP size, each rank reads its own row (a DTensor sharded by rows over the TP group) and
any ZeRO split of it; on another TP size the rows are read whole, unflattened, joined along the split dimension
and cut again (:func:`read_whole`). ``checkpoint.json`` records the form: ``optimizer.storage == "fragments"``
and the writer's ``optimizer.tensor_model_parallel_size``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate, Shard

from domino.checkpoint import distributed_io
from domino.checkpoint.model_loading import merged_header_shapes
from domino.checkpoint.on_disk import META_FILE, OPTIMIZER_DIR, CheckpointError
from domino.optim.state import Fragment
from domino.checkpoint.sharding import shard_state_dict
from domino.runtime.mesh import ParallelMesh

STORAGE = "fragments"


class _FragmentPlanner(DefaultSavePlanner):
    """DCP's default save plan for this rank's fragments: one ``[1, n]`` box per tensor, at ``(row, start)`` of its
    ``[rows, columns]`` matrix."""

    def __init__(self, boxes: Dict[str, Tuple[torch.Tensor, int, int, int, int]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.boxes = boxes  # name -> (data, row, start, rows, columns)

    def create_local_plan(self) -> SavePlan:
        items = []
        for name, (data, row, start, rows, columns) in self.boxes.items():
            offsets = torch.Size((row, start))
            items.append(WriteItem(
                index=MetadataIndex(name, offsets), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, torch.Size((1, data.numel()))),
                                            properties=TensorProperties.create_from_tensor(data),
                                            size=torch.Size((rows, columns)))))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self.boxes[write_item.index.fqn][0].view(1, -1)


def save(directory: Path, fragments: Dict[str, Fragment], mesh: ParallelMesh,
         process_group: Optional[dist.ProcessGroup] = None) -> List[Path]:
    """Writes this rank's ``fragments`` into ``directory`` (collective over ``process_group``, default the
    world's, for DCP's planning); returns the files this rank wrote (fsynced by DCP's writer)."""
    tp, tp_rank = mesh.tp.size, mesh.tp.rank
    boxes = {}
    for name, fragment in fragments.items():
        split = distributed_io.split_dim(name, len(fragment.shape), tp) is not None  # one row per rank
        boxes[name] = (fragment.data.contiguous(), tp_rank if split else 0, fragment.start, tp if split else 1,
                       math.prod(fragment.shape))
    directory.mkdir(parents=True, exist_ok=True)
    before = set(directory.iterdir())
    dcp.save({}, process_group=process_group, planner=_FragmentPlanner(boxes),
             storage_writer=HuggingFaceStorageWriter(str(directory), save_distributed=True))
    return distributed_io.files_this_rank_wrote(directory, before)


def load(directory: Path, targets: Dict[str, torch.Tensor], mesh: ParallelMesh, saved_tp: int,
         stored: Optional[Dict[str, distributed_io.StoredTensor]] = None) -> None:
    """Fills every rank's TP-local ``targets`` (whole slices, by ``KEY.NAME``) from ``directory`` (collective).

    On the writer's TP size each rank reads its row; on another, every rank reads the rows whole
    (:func:`read_whole`) and cuts its slice. ``stored``: as :func:`domino.checkpoint.distributed_io.load`'s.

    Raises:
        CheckpointError: when a tensor is missing or stored with another shape (before any data is read).
    """
    tp = mesh.tp.size
    if saved_tp != tp:
        shapes = {name: distributed_io.global_shape(name, t, tp) for name, t in targets.items()}
        whole = read_whole(directory, list(targets), saved_tp, shapes, stored)
        for name, sliced in shard_state_dict(whole, mesh.tp.rank, tp).items():
            targets[name].copy_(sliced)
        return
    stored = distributed_io.stored_tensors(directory) if stored is None else stored
    device_mesh = distributed_io.replica_device_mesh(mesh)
    views = {}
    for name, local in targets.items():
        split = distributed_io.split_dim(name, local.dim(), tp) is not None
        want = (tp if split else 1, local.numel())
        if name not in stored:
            raise CheckpointError(f"{directory} lacks {name}")
        if stored[name].shape != want:
            raise CheckpointError(f"{directory}: {name} is stored as {list(stored[name].shape)}, this run's rows "
                                  f"are {list(want)}")
        # run_check=False: the row is what the placements say; a view, so the read lands in the target.
        views[name] = DTensor.from_local(local.view(1, -1), device_mesh, [Replicate(), Shard(0) if split else
                                         Replicate()], run_check=False, shape=torch.Size(want),
                                         stride=torch.Size((want[1], 1)))
    dcp.load(views, storage_reader=HuggingFaceStorageReader(str(directory)))


def read_whole(directory: Path, names: Optional[Sequence[str]], saved_tp: int, shapes: Dict[str, Tuple[int, ...]],
               stored: Optional[Dict[str, distributed_io.StoredTensor]] = None) -> Dict[str, torch.Tensor]:
    """The whole tensors ``names`` (all for None) of ``directory``, in one process: each stored ``[R, N]`` matrix
    unflattened into its ``R`` TP slices and joined along its split dimension into global shape ``shapes[name]``.

    Raises:
        CheckpointError: when a stored matrix does not hold a tensor of that shape cut ``saved_tp`` ways.
    """
    flat = distributed_io.read_full(directory, names, stored)
    whole = {}
    for name, rows in flat.items():
        shape = shapes.get(name)
        if shape is None or rows.numel() != math.prod(shape) or rows.shape[0] not in (1, saved_tp):
            raise CheckpointError(f"{directory}: {name} is stored as {list(rows.shape)}, which is not a tensor of "
                                  f"shape {shape} cut over {saved_tp} TP ranks")
        if rows.shape[0] == 1:
            whole[name] = rows.view(shape)
            continue
        dim, local = distributed_io.split_dim(name, len(shape), saved_tp), list(shape)
        if dim is None or shape[dim] % saved_tp:
            raise CheckpointError(f"{directory}: {name} is stored in {saved_tp} TP rows, but a tensor of shape "
                                  f"{shape} is not split {saved_tp} ways")
        local[dim] //= saved_tp
        whole[name] = torch.cat([row.view(local) for row in rows], dim=dim)
    return whole


def fragments_tp(meta: dict, source: str) -> Optional[int]:
    """The writer's TP size when ``checkpoint.json`` (``meta``) says its optimizer state is stored as fragments;
    None when it is stored as whole slices.

    Raises:
        CheckpointError: naming ``source`` when the recorded form is malformed.
    """
    recorded = meta.get("optimizer")
    if not isinstance(recorded, dict) or recorded.get("storage", "slices") == "slices":
        return None
    tp = recorded.get("tensor_model_parallel_size")
    if recorded["storage"] != STORAGE or not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise CheckpointError(f"{source}: field optimizer must say storage 'slices' or '{STORAGE}' with a positive "
                              f"tensor_model_parallel_size, got {str(recorded)[:120]}")
    return tp


def read_state(ckpt, names: Optional[Sequence[str]] = None) -> Dict[str, torch.Tensor]:
    """The whole tensors of a checkpoint's optimizer state stored by name (all, or ``names``), whichever form
    it was written in, in one process; each fragment-stored tensor takes its shape from the weight of its name
    (``KEY.NAME`` has ``NAME``'s shape, read from the weight files' headers)."""
    directory = ckpt.path / OPTIMIZER_DIR
    saved_tp = fragments_tp(ckpt.meta, str(ckpt.path / META_FILE))
    if saved_tp is None:
        return distributed_io.read_full(directory, names)
    weights = merged_header_shapes(ckpt.path, ckpt.meta)
    stored = list(names) if names is not None else sorted(distributed_io.stored_tensors(directory))
    shapes = {name: weights[name.split(".", 1)[-1]] for name in stored if name.split(".", 1)[-1] in weights}
    return read_whole(directory, stored, saved_tp, shapes)
