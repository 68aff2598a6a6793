"""``domino checkpoint inspect`` and ``convert``: what a checkpoint holds, whether it is intact, what it can resume
on; and an offline copy at another tensor-parallel size, or as one file per tensor.

Both read one process's worth of files (no process group); the headers they trust are checked first
(:func:`domino.checkpoint.distributed_io.stored_tensors`, :func:`domino.checkpoint.model_shards.read_header_shapes`).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from domino.atomic_files import fsync_directory, name_too_long
from domino.checkpoint import distributed_io, fragment_io, manifest, model_shards, on_disk, sharding
from domino.checkpoint import model_loading
from domino.checkpoint.on_disk import Checkpoint


def _progress(total: int, description: str, enabled: Optional[bool], unit: str = "B"):
    from tqdm import tqdm

    # enabled None: a bar on a terminal only (tqdm's disable=None); True or False: always or never.
    return tqdm(total=total, desc=description, unit=unit, unit_scale=True,
                disable=None if enabled is None else not enabled)


@dataclass
class Inspection:
    """What :func:`inspect` found; :meth:`lines` renders it for people, :meth:`to_json` for programs."""

    path: str
    iteration: int
    consumed_samples: int
    format_version: int
    optimizer: Optional[str]
    layout: Dict[str, Optional[int]]
    model: Dict[str, object]
    bytes_by_part: Dict[str, int]
    integrity: str
    resumable_on: List[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return dict(vars(self))

    def lines(self) -> List[str]:
        layout = " x ".join(f"{k}={v}" for k, v in self.layout.items() if v is not None)
        sizes = ", ".join(f"{part} {n / 2**20:.1f} MiB" for part, n in self.bytes_by_part.items())
        model = ", ".join(f"{k} {v}" for k, v in self.model.items())
        return [f"checkpoint {self.path}", f"  iteration {self.iteration}, {self.consumed_samples} samples consumed",
                f"  format {self.format_version}, optimizer state: {self.optimizer or 'none (weights only)'}",
                f"  saved on {layout}", f"  model: {model}", f"  sizes: {sizes}", f"  integrity: {self.integrity}",
                *(f"  resumes on: {line}" for line in self.resumable_on)]


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tensor_parallel_sizes(meta: dict) -> List[int]:
    """The TP sizes a checkpoint's model can be cut for: dividing the heads, the key/value groups, the FFN width
    and the vocabulary padding multiple (so ``--make-vocab-size-divisible-by`` can keep the padded rows)."""
    model = meta["config"]["model"]
    multiple = model["make_vocab_size_divisible_by"] * meta["tensor_model_parallel_size"]
    heads = model["num_attention_heads"]
    groups = model.get("num_query_groups") if model.get("group_query_attention") else heads
    ffn = model.get("ffn_hidden_size") or 4 * model["hidden_size"]
    return [t for t in _divisors(heads) if groups % t == 0 and ffn % t == 0 and multiple % t == 0]


def _resumable_on(meta: dict, kind: Optional[str]) -> List[str]:
    """The layouts a resume of this checkpoint can take (the rules of :mod:`domino.checkpoint.resume`)."""
    cfg, tp = meta["config"], meta["tensor_model_parallel_size"]
    model, train = cfg["model"], cfg["train"]
    dp = meta.get("data_parallel_size") or 1
    gbs = meta.get("global_batch_size") or train.get("global_batch_size") or train["micro_batch_size"] * dp
    if kind is None:
        return [f"weights only (no optimizer state): tensor-model-parallel size "
                f"{', '.join(map(str, tensor_parallel_sizes(meta)))}, any data-parallel size, with a fresh optimizer"]
    if kind == "per-rank":
        return [f"TP={tp} x DP={dp} only (the optimizer state is per rank); any layout with --no-load-optim"]
    multiple, tps = model["make_vocab_size_divisible_by"] * tp, tensor_parallel_sizes(meta)
    return [f"tensor-model-parallel size {', '.join(map(str, tps))} (keep the vocabulary padding: "
            f"--make-vocab-size-divisible-by {multiple} / TP)",
            f"any data-parallel size dividing the global batch of {gbs} (the micro-batch dividing {gbs} / DP), "
            "any ZeRO stage 0-2, any --domino-chunks"]


def _verify_all(ckpt: Path, meta: dict, progress: Optional[bool]) -> str:
    try:  # the manifest vouches for the bytes, not for checkpoint.json's description of them (3 layers, 2 stored)
        model_loading.check_checkpoint_fits(ckpt, meta, _config(meta))
    except on_disk.CheckpointError as error:
        return f"DAMAGED: {error}"
    problem = manifest.find_damage(ckpt)
    if problem:
        return f"DAMAGED: {problem}"
    files = manifest.read_manifest(ckpt)
    if files is None:
        return "unverified (no manifest.json: written before manifests existed)"
    with _progress(sum(e["size"] for e in files.values()), "verifying", progress) as bar:
        for name, entry in sorted(files.items()):
            problem = manifest.verify(ckpt, [name])
            if problem:
                return f"DAMAGED: {problem}"
            bar.update(entry["size"])
    return f"intact ({len(files)} files, sizes and CRC-32 as the manifest records)"


def inspect(path, verify: bool = True, progress: Optional[bool] = None) -> Inspection:
    """Describes the checkpoint ``path`` designates (a save root or an ``iter_*`` directory).

    Raises:
        CheckpointError: when ``path`` is not a readable checkpoint.
    """
    found = Checkpoint.open(path)
    ckpt, meta, kind = found.path, found.meta, found.optimizer_format
    parts: Dict[str, int] = {}
    for item in sorted(ckpt.rglob("*")):
        if item.is_file():
            part = item.relative_to(ckpt).parts[0] if len(item.relative_to(ckpt).parts) > 1 else "metadata"
            parts[part] = parts.get(part, 0) + item.stat().st_size
    shapes = model_loading.merged_header_shapes(ckpt, meta)
    model = meta["config"]["model"]
    described = {"layers": model["num_layers"], "hidden": model["hidden_size"], "heads": model["num_attention_heads"],
                 "padded vocabulary": meta["padded_vocab_size"],
                 "parameters": sum(_numel(s) for s in shapes.values())}
    if kind == "by-name":
        distributed_io.stored_tensors(ckpt / on_disk.OPTIMIZER_DIR)  # its headers must fit their tensors
    parallel = meta["config"].get("parallel", {})
    layout = {"TP": meta["tensor_model_parallel_size"], "DP": meta.get("data_parallel_size"),
              "ZeRO": parallel.get("zero_stage"), "Domino chunks": parallel.get("domino_chunks")}
    integrity = _verify_all(ckpt, meta, progress) if verify else "not verified (--no-verify)"
    return Inspection(str(ckpt), meta["iteration"], meta["consumed_samples"], meta["format_version"], kind, layout,
                      described, parts, integrity, _resumable_on(meta, kind))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _fresh_output(output: Path) -> Path:
    problem = name_too_long(str(output))
    if problem:
        raise on_disk.CheckpointError(f"--output {output}: {problem}")
    if output.exists() and any(output.iterdir()):
        raise on_disk.CheckpointError(f"--output {output} is not empty; name a new directory")
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".tmp-{output.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _finish(tmp: Path, output: Path) -> Path:
    fsync_directory(tmp)
    if output.exists():
        output.rmdir()  # empty (checked in _fresh_output)
    tmp.rename(output)
    fsync_directory(output.parent)
    return output


def convert_layout(path, output, tensor_model_parallel_size: int, progress: Optional[bool] = None) -> Path:
    """Writes a copy of a checkpoint whose model shards are cut for ``tensor_model_parallel_size``.

    The copy is a save root (``latest`` and the same ``iter_*``): the optimizer state by name is copied as it
    is (every layout reads it), the RNG streams are left out (they belong to the layout that drew them), and the
    copy gets its own manifest. A per-rank optimizer state (format 1) cannot be cut: it is refused.
    """
    found = Checkpoint.open(path)
    ckpt, meta = found.path, found.meta
    if found.optimizer_format == "per-rank":
        raise on_disk.CheckpointError(
            f"{ckpt}: its optimizer state is per rank (format 1); resume it once on its own layout, then convert "
            "the checkpoint that run saves")
    model_loading.check_checkpoint_fits(ckpt, meta, _config(meta), 1)
    if tensor_model_parallel_size not in tensor_parallel_sizes(meta):
        raise on_disk.CheckpointError(
            f"--tensor-model-parallel-size {tensor_model_parallel_size}: {ckpt}'s model can be cut for TP "
            f"{', '.join(map(str, tensor_parallel_sizes(meta)))} only")
    config = json.loads(json.dumps(meta["config"]))
    multiple = config["model"]["make_vocab_size_divisible_by"] * meta["tensor_model_parallel_size"]
    config["model"]["make_vocab_size_divisible_by"] = multiple // tensor_model_parallel_size
    config["parallel"]["tensor_model_parallel_size"] = tensor_model_parallel_size
    output = Path(output)
    tmp = _fresh_output(output)
    target = tmp / ckpt.name
    target.mkdir()
    full = model_shards.load_full_state_dict(found)
    with _progress(tensor_model_parallel_size, "model shards", progress, unit="shard") as bar:
        for rank in range(tensor_model_parallel_size):
            shard = sharding.shard_state_dict(full, rank, tensor_model_parallel_size)
            model_shards.save_model_shard(target, shard, rank)
            bar.update(1)
    for sub in (on_disk.OPTIMIZER_DIR, on_disk.TOKENIZER_DIR):
        if (ckpt / sub).is_dir():
            shutil.copytree(ckpt / sub, target / sub)
    on_disk.write_checkpoint_meta(target, {**meta, "tensor_model_parallel_size": tensor_model_parallel_size,
                                              on_disk.MODEL_STAGES_KEY: 1, "data_parallel_size": None,
                                              "config": config})
    manifest.seal(target)
    on_disk.write_latest(tmp, ckpt.name)
    return _finish(tmp, output)


def convert_per_tensor(path, output, progress: Optional[bool] = None) -> Path:
    """Writes every whole tensor of a checkpoint (model weights; optimizer state stored by name) to its own
    ``NAME.safetensors`` under ``output/model/`` and ``output/optimizer/``, with ``index.json`` listing them."""
    found = Checkpoint.open(path)
    ckpt, meta = found.path, found.meta
    output = Path(output)
    groups = {"model": model_shards.load_full_state_dict(found)}
    if found.optimizer_format == "by-name":
        groups["optimizer"] = fragment_io.read_state(found)
    for group, tensors in groups.items():  # names from the headers become file names: each checked first
        for name in tensors:
            on_disk.check_file_name(name, f"{ckpt / (on_disk.MODEL_DIR if group == 'model' else group)}")
    tmp = _fresh_output(output)
    index = {}
    with _progress(sum(len(g) for g in groups.values()), "tensors", progress, unit="tensor") as bar:
        for group, tensors in groups.items():
            (tmp / group).mkdir()
            for name, tensor in sorted(tensors.items()):
                model_shards.save_safetensors({name: tensor.contiguous()}, tmp / group / f"{name}.safetensors")
                index[f"{group}/{name}"] = {"shape": list(tensor.shape), "dtype": str(tensor.dtype).split(".")[-1]}
                bar.update(1)
    (tmp / "index.json").write_text(json.dumps({"checkpoint": str(ckpt), "iteration": meta["iteration"],
                                                "tensors": index}, indent=1))
    return _finish(tmp, output)


def _config(meta: dict):
    from domino.config import config_from_dict

    return config_from_dict(meta["config"])
