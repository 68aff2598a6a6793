"""Tensors stored by name and global shape, written by every rank and read back on any layout.

The library is ``torch.distributed.checkpoint`` (DCP, torch 2.13), with its safetensors storage
(``torch/distributed/checkpoint/hf_storage.py``): each rank hands DCP its tensors as ``DTensor`` slices of the
global tensors, on a device mesh built from domino's own data- and tensor-parallel groups
(``DeviceMesh.from_group``, no new groups); DCP writes every slice once (replicas are deduplicated,
``_dedup_save_plans.py``) into ``shard-NNNNN-model-00001-of-00001.safetensors`` files whose headers record
each slice's offset in its global tensor (``DCP_SHARDING_INFO``); on load every rank names the slices it
needs and DCP reads exactly the overlapping parts, whatever layout wrote them (``default_planner.py``).

Why DCP and not DeepSpeed's universal checkpoint (``deepspeed/checkpoint/ds_to_universal.py``, 0.19.8): that
one is an offline conversion of DeepSpeed's own per-rank checkpoint files, reloaded through
``torch.load(weights_only=False)`` (``universal_checkpoint.py``: arbitrary unpickling) and only for ZeRO/BF16
optimizers (not the plain AdamW of stage 0); DCP reshards on load, in the run, for any of them, and its
safetensors reader takes its metadata from safetensors headers (JSON), never from a pickle (DCP's default
``FileSystemReader`` unpickles its ``.metadata`` file, so domino does not use it).

The headers are untrusted: :func:`stored_tensors` checks every slice against its global shape (inside it, no
overlaps, full coverage) before anything is read; safetensors itself bounds each header by the file's size.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from domino.checkpoint.sharding import partition_dim
from domino.checkpoint.on_disk import CheckpointError
from domino.runtime.mesh import ParallelMesh, collective_device

FILE_SUFFIX = ".safetensors"


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a layout-free directory: its global shape and the slices (offsets, sizes) stored."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    chunks: Tuple[Tuple[Tuple[int, ...], Tuple[int, ...]], ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def replica_device_mesh(mesh: ParallelMesh, device_type: Optional[str] = None) -> DeviceMesh:
    """The (replica, tensor-parallel) device mesh of this rank's pipeline stage, from the groups of the run's
    ``mesh``: its rows are the ranks holding the same weights (data x context parallel, :attr:`ParallelMesh.dp_cp`;
    at CP 1, rank = stage * DP * TP + dp_rank * TP + tp_rank, :mod:`domino.runtime.mesh`), its columns a TP group.

    ``device_type`` defaults to the collectives' device. ``DTensor.from_local`` moves a local tensor to its mesh's
    device type (torch 2.13 ``distributed/tensor/_api.py``), so host copies being saved get a ``"cpu"`` mesh: it
    only describes where each slice lies (DCP's save runs no collective on the mesh's groups).
    """
    replicas, tp = mesh.dp_cp, mesh.tp
    rows = [[rank - tp.rank + t for t in range(tp.size)] for rank in replicas.ranks]  # TP ranks are consecutive
    device_type = device_type or collective_device().type
    return DeviceMesh.from_group([replicas.process_group, tp.process_group], device_type, mesh=torch.tensor(rows),
                                 mesh_dim_names=("dp", "tp"))


def split_dim(name: str, ndim: int, tp: int) -> Optional[int]:
    """The dimension along which tensor ``name`` (of ``ndim`` dimensions) is cut over ``tp`` ranks; None when it is
    whole on each (replicated, a one-dimensional bias of a split weight, or ``tp`` 1)."""
    dim = partition_dim(name)
    return dim if tp > 1 and dim is not None and dim < ndim else None


def global_shape(name: str, local: torch.Tensor, tp: int) -> Tuple[int, ...]:
    """The shape of the whole tensor whose TP-local slice is ``local`` (split by :func:`split_dim`)."""
    shape, dim = list(local.shape), split_dim(name, local.dim(), tp)
    if dim is not None:
        shape[dim] *= tp
    return tuple(shape)


def _as_dtensors(tensors: Dict[str, torch.Tensor], mesh: DeviceMesh) -> Dict[str, DTensor]:
    tp = mesh.size(1)
    out = {}
    for name, local in tensors.items():
        dim, shape = split_dim(name, local.dim(), tp), global_shape(name, local, tp)
        placements = [Replicate(), Replicate() if dim is None else Shard(dim)]
        # run_check=False: the local slices are already what the placements say; no collective to prove it.
        out[name] = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                                       stride=torch.empty(shape, device="meta").stride())
    return out


def files_this_rank_wrote(directory: Path, before: Set[Path]) -> List[Path]:
    """The files of ``directory`` not in ``before`` that DCP's writer named for this rank (rank r's are
    ``shard-{r+1:05d}-...``); a rank whose slices were all written by a replica wrote none."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = f"shard-{rank + 1:05d}-"
    return sorted(p for p in set(directory.iterdir()) - before if p.name.startswith(mine))


def save(directory: Path, tensors: Dict[str, torch.Tensor], mesh: ParallelMesh,
         process_group: Optional[dist.ProcessGroup] = None) -> List[Path]:
    """Writes every rank's TP-local host ``tensors`` (sliced as ``mesh`` lays them out) into ``directory``
    (collective over ``process_group``).

    The ranks of a tensor-parallel group pass the same names; data-parallel replicas may pass the same tensors
    (DCP writes one copy) or share them out (DCP merges every rank's plan into one set of files).

    Args:
        process_group: the group (spanning every rank) for DCP's planning and finishing collectives; default
            the world's. A background writer passes a group of its own, so these never interleave with the
            training's collectives on one group.

    Returns:
        The files this rank wrote (fsynced by DCP's writer, ``sync_files=True``).
    """
    directory.mkdir(parents=True, exist_ok=True)
    before = set(directory.iterdir())
    dcp.save(_as_dtensors(tensors, replica_device_mesh(mesh, "cpu")), process_group=process_group,
             storage_writer=HuggingFaceStorageWriter(str(directory), save_distributed=True))
    return files_this_rank_wrote(directory, before)


def files(directory: Path) -> List[Path]:
    """The storage files of a layout-free directory, in name order."""
    return sorted(p for p in directory.iterdir() if p.name.endswith(FILE_SUFFIX)) if directory.is_dir() else []


def _check_chunks(name: str, shape: Tuple[int, ...], chunks, source: Path) -> None:
    covered = 0
    boxes = []
    for offsets, sizes in chunks:
        if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape)):
            raise CheckpointError(f"{source}: slice {list(offsets)}+{list(sizes)} of {name} lies outside its "
                                  f"shape {list(shape)}")
        for other in boxes:
            if all(o < oo + os and oo < o + s for o, s, oo, os in zip(offsets, sizes, *other)):
                raise CheckpointError(f"{source}: two stored slices of {name} overlap")
        boxes.append((offsets, sizes))
        covered += math.prod(sizes)
    if covered != math.prod(shape):
        raise CheckpointError(f"{source}: the stored slices of {name} cover {covered} of its "
                              f"{math.prod(shape)} elements")


def stored_tensors(directory: Path) -> Dict[str, StoredTensor]:
    """The tensors a layout-free directory holds, from the safetensors headers alone, each one checked.

    Raises:
        CheckpointError: naming the directory when a header is unreadable or a slice does not fit its tensor.
    """
    if not files(directory):
        raise CheckpointError(f"{directory} holds no {FILE_SUFFIX} files")
    try:
        metadata = HuggingFaceStorageReader(str(directory)).read_metadata()
    except Exception as error:  # safetensors and DCP raise several types for truncated or foreign headers
        raise CheckpointError(f"{directory}: unreadable layout-free tensor headers ({error})") from None
    out = {}
    for name, entry in metadata.state_dict_metadata.items():
        shape = tuple(int(n) for n in entry.size)
        chunks = tuple((tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes)) for c in entry.chunks)
        _check_chunks(name, shape, chunks, directory)
        out[name] = StoredTensor(shape, entry.properties.dtype, chunks)
    return out


def load(directory: Path, targets: Dict[str, torch.Tensor], mesh: ParallelMesh,
         stored: Optional[Dict[str, StoredTensor]] = None) -> None:
    """Fills every rank's TP-local ``targets`` (sliced as ``mesh`` lays them out) from ``directory``, whatever
    layout wrote it (collective).

    Args:
        stored: ``directory``'s :func:`stored_tensors`, when the caller read them already (a resume reads the
            optimizer state a batch at a time: each batch would parse every file's header again); None reads them.

    Raises:
        CheckpointError: when a tensor is missing or has another global shape (before any data is read).
    """
    stored, tp = stored_tensors(directory) if stored is None else stored, mesh.tp.size
    for name, local in targets.items():
        want = global_shape(name, local, tp)
        if name not in stored:
            raise CheckpointError(f"{directory} lacks {name}")
        if stored[name].shape != want:
            raise CheckpointError(f"{directory}: {name} is stored as {list(stored[name].shape)}, this run's is "
                                  f"{list(want)}")
    dcp.load(_as_dtensors(targets, replica_device_mesh(mesh)),
             storage_reader=HuggingFaceStorageReader(str(directory)))


def read_full(directory: Path, names=None, stored: Optional[Dict[str, StoredTensor]] = None
              ) -> Dict[str, torch.Tensor]:
    """The whole tensors of a layout-free directory (or those in ``names``), in one process (no process group).

    Each tensor's slices were checked to cover it exactly (:func:`stored_tensors`; ``stored``: as :func:`load`'s),
    and safetensors checks each header against its file's size, so what is allocated here is backed by as many
    bytes on disk.
    """
    stored = stored_tensors(directory) if stored is None else stored
    wanted = sorted(stored) if names is None else list(names)
    missing = [n for n in wanted if n not in stored]
    if missing:
        raise CheckpointError(f"{directory} lacks {', '.join(missing[:3])}")
    out = {n: torch.empty(stored[n].shape, dtype=stored[n].dtype) for n in wanted}
    with warnings.catch_warnings():  # DCP warns that it loads in one process: that is the point here
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(out, storage_reader=HuggingFaceStorageReader(str(directory)), no_dist=True)
    return out
