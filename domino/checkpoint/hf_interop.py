"""Hugging Face interop: export a checkpoint as a GPT-2 or LLaMA model directory, and import one back.

A GPT model is exported as ``GPT2LMHeadModel`` (:mod:`domino.model.hf_gpt2`), a LLaMA-family one (rotary
positions, RMSNorm, SwiGLU) as ``LlamaForCausalLM`` (:mod:`domino.model.hf_llama`); :data:`FAMILIES` holds what
differs between the two. Export merges the TP shards, maps the weights, drops the vocabulary padding rows (the
tokenizer never produces those ids) and writes ``config.json``, ``model.safetensors``,
``generation_config.json`` and the tokenizer files, so that
``transformers.AutoModelForCausalLM.from_pretrained(dir)`` loads it offline. Nothing here imports
``transformers``. Import reads only safetensors weights (never pickles) and writes a TP=1 weights-only
checkpoint that ``domino pretrain --load DIR --finetune`` can warm-start from.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import tempfile
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from safetensors import safe_open

from domino.atomic_files import StagingDirectory, name_too_long
from domino.checkpoint import manifest
from domino.config import ConfigError, DominoConfig, ModelConfig, config_from_dict, padded_vocab_size, validate
from domino.checkpoint import model_loading, model_shards, on_disk
from domino.model import hf_gpt2, hf_llama

logger = logging.getLogger(__name__)

PathLike = Union[str, Path]
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
#: The safetensors dtypes of weights that are imported (names as in the safetensors format's header).
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})


@dataclass(frozen=True)
class Family:
    """What export and import need to know about one Hugging Face architecture.

    Attributes:
        architecture, model_type: the ``config.json`` values that name it.
        hf_config, to_hf, from_hf, model_config: its mappings (``domino.model.hf_gpt2`` or ``hf_llama``).
        embedding, output: its names of the word embeddings and of the output layer (the vocabulary rows).
        layer_prefix, layers_key: where its layer tensors are named, and its ``config.json`` field of the depth.
    """

    architecture: str
    model_type: str
    hf_config: Callable[..., Dict[str, Any]]
    to_hf: Callable[[Dict[str, torch.Tensor], ModelConfig], Dict[str, torch.Tensor]]
    from_hf: Callable[[Dict[str, torch.Tensor], ModelConfig], Dict[str, torch.Tensor]]
    model_config: Callable[[Dict[str, Any], str], ModelConfig]
    embedding: str
    output: str
    layer_prefix: str
    layers_key: str


FAMILIES = {
    "gpt2": Family("GPT2LMHeadModel", "gpt2", hf_gpt2.hf_gpt2_config, hf_gpt2.to_hf_gpt2_state_dict,
                   hf_gpt2.from_hf_gpt2_state_dict, hf_gpt2.model_config_from_hf, "transformer.wte.weight",
                   "lm_head.weight", "transformer.h.", "n_layer"),
    "llama": Family("LlamaForCausalLM", "llama", hf_llama.hf_llama_config, hf_llama.to_hf_llama_state_dict,
                    hf_llama.from_hf_llama_state_dict, hf_llama.model_config_from_hf, hf_llama.EMBEDDING,
                    hf_llama.OUTPUT, "model.layers.", "num_hidden_layers"),
}


def family_of(config: ModelConfig) -> Family:
    """LLaMA when the model uses any of its own pieces (rotary positions, RMSNorm, SwiGLU), else GPT-2; the
    family's mapping then refuses whatever else it cannot express, naming the flags."""
    llama = config.rope or config.normalization == "RMSNorm" or config.swiglu
    return FAMILIES["llama" if llama else "gpt2"]


#: The names an export writes (its tokenizer's files: :meth:`domino.data.tokenizer.Tokenizer.save`).
EXPORT_NAMES = frozenset({"config.json", "generation_config.json", WEIGHTS_FILE, "tokenizer.json", "vocab.json",
                          "merges.txt", "tokenizer_config.json", "special_tokens_map.json"})


def _ours_in_export(name: str) -> bool:
    return name in EXPORT_NAMES


def _ours_in_import(name: str) -> bool:  # a save root: its latest and iter_* folders
    return name == on_disk.LATEST_FILE or on_disk.tag_iteration(name) is not None


def _prepare_output(output: Path, overwrite: bool, source: Path, source_flag: str,
                    ours: Callable[[str], bool]) -> None:
    """Checks ``output`` before any work: publishing replaces it whole, so it must neither be the source nor hold
    it, and ``--overwrite`` replaces only an earlier output of the same verb (``ours`` names its entries)."""
    problem = name_too_long(str(output))  # its staging folder beside it has a longer name
    if problem:
        raise ConfigError(f"--output {output}: {problem}")
    resolved, source_resolved = output.resolve(), source.resolve()
    if resolved == source_resolved or resolved in source_resolved.parents:
        raise ConfigError(f"--output {output} is or contains {source_flag} {source}: replacing it would delete the "
                          "input; write to another folder")
    if not output.exists() or (output.is_dir() and not any(output.iterdir())):
        return
    if not overwrite:
        raise ConfigError(f"--output {output} already exists and is not empty (pass --overwrite to replace it)")
    foreign = sorted(p.name for p in output.iterdir() if not ours(p.name)) if output.is_dir() else [output.name]
    if foreign:
        raise ConfigError(f"--output {output} holds {len(foreign)} file(s) this command did not write "
                          f"({', '.join(foreign[:3])}); --overwrite replaces only an earlier output: move them "
                          "or choose another folder")


def _publish(staging: Path, output: Path) -> None:
    """Moves a fully written staging directory to ``output`` (replacing it only now, when all is written).

    An existing ``output`` is first moved into a fresh private directory beside it, so no folder of the
    user's (``output.old``, say) is ever touched, and is deleted only once the new one is in place.
    """
    if output.exists():
        holder = Path(tempfile.mkdtemp(prefix=f".{output.name}.replaced.", dir=output.parent))
        output.rename(holder / output.name)
        staging.rename(output)
        shutil.rmtree(holder, ignore_errors=True)
    else:
        staging.rename(output)


def export_hf(load: PathLike, output: PathLike, tokenizer_spec: Optional[str] = None,
              overwrite: bool = False) -> Path:
    """Writes the checkpoint at ``load`` as a Hugging Face ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` directory.

    Args:
        load: a save root or an ``iter_*`` checkpoint directory (any TP size).
        output: the directory to create.
        tokenizer_spec: overrides the checkpoint's tokenizer.
        overwrite: replace a non-empty ``output``.

    Returns:
        ``output``.

    Raises:
        ConfigError: for a bad checkpoint, a non-empty output, or a model neither family can express.
    """
    ckpt = on_disk.Checkpoint.open(load)  # checkpoint.json read and checked once, then passed along
    ckpt_dir, meta = ckpt.path, ckpt.meta
    config = config_from_dict(meta["config"])
    model_loading.check_checkpoint_fits(ckpt_dir, meta, config)
    output = Path(output)
    _prepare_output(output, overwrite, Path(ckpt_dir), "--load", _ours_in_export)
    tokenizer = model_loading.load_checkpoint_tokenizer(ckpt_dir, meta, tokenizer_spec)
    vocab = tokenizer.vocab_size
    if vocab > meta["padded_vocab_size"]:
        raise ConfigError(f"the tokenizer has {vocab} ids but checkpoint {ckpt_dir} only "
                          f"{meta['padded_vocab_size']} embedding rows")
    family = family_of(config.model)
    hf_config = family.hf_config(config.model, vocab, eos_token_id=tokenizer.eod)
    hf_sd = family.to_hf(model_shards.load_full_state_dict(ckpt), config.model)
    hf_sd[family.embedding] = hf_sd[family.embedding][:vocab].contiguous()
    if config.model.untie_embeddings_and_output_weights:
        hf_sd[family.output] = hf_sd[family.output][:vocab].contiguous()
    else:  # tied: from_pretrained re-ties it, and safetensors refuses shared tensors
        hf_sd.pop(family.output, None)

    output.parent.mkdir(parents=True, exist_ok=True)
    with StagingDirectory(str(output)) as staged:  # a killed export's staging folder is swept by the next one
        staging = Path(staged.path)
        config_json = {"architectures": [family.architecture], "model_type": family.model_type, **hf_config,
                       "domino": {"checkpoint": str(ckpt_dir), "iteration": meta["iteration"],
                                  "padded_vocab_size": meta["padded_vocab_size"]}}
        (staging / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
        (staging / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": tokenizer.eod, "eos_token_id": tokenizer.eod}, indent=2) + "\n")
        model_shards.save_safetensors({k: v.contiguous() for k, v in hf_sd.items()}, staging / WEIGHTS_FILE,
                                      metadata={"format": "pt"})
        tokenizer.save(str(staging))
        staged.publish(lambda: _publish(staging, output))
    logger.info("exported %s (iteration %d) to %s", ckpt_dir, meta["iteration"], output)
    return output


def _weight_files(input_dir: Path) -> List[Path]:
    """The safetensors files of a Hugging Face directory; an index's entries must stay inside it."""
    files = [input_dir / WEIGHTS_FILE]
    index = input_dir / WEIGHTS_INDEX_FILE
    if not files[0].is_file() and index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as error:
            raise ConfigError(f"{index} is not a safetensors index with a weight_map object ({error!r})") from None
        for name in names:
            if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
                raise ConfigError(f"{index}: weight_map entry {name!r} is not a file name inside {input_dir}")
        files = [input_dir / name for name in names]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ConfigError(f"--input {input_dir}: no safetensors weights ({', '.join(missing)} missing); "
                          "pickled pytorch_model.bin files are not read: convert them to safetensors first")
    return files


def _check_weights_fit(files: List[Path], config: ModelConfig, family: Family, source: str) -> None:
    """Checks ``config.json`` against the weight files' headers before any tensor is read or allocated.

    The expected shapes are those of our model described by ``config``, built on the meta device (no memory)
    and mapped to Hugging Face names, so a config claiming a huge vocabulary or width fails here, cheaply.
    """
    from domino.model import GPTModel

    stored: Dict[str, Tuple[int, ...]] = {}
    for path in files:
        stored.update(model_shards.read_header_shapes(path))
        for name, dtype in model_shards.read_header_dtypes(path).items():
            if dtype not in FLOAT_DTYPES:  # an integer or bool tensor would become weights nothing can train
                raise ConfigError(f"{path}: tensor {name[:80]!r} has dtype {dtype}; a model's weights are floating "
                                  f"point ({', '.join(sorted(FLOAT_DTYPES))})")
    if family.model_type == "gpt2" and not any(k.startswith("transformer.") for k in stored):
        stored = {"transformer." + k: v for k, v in stored.items()}  # GPT2Model's names lack the prefix
    depth = len(family.layer_prefix.split(".")) - 1
    layers = {int(k.split(".")[depth]) for k in stored
              if k.startswith(family.layer_prefix) and k.split(".")[depth].isdigit()}
    if config.num_layers != (max(layers) + 1 if layers else 0):
        raise ConfigError(f"{source}: {family.layers_key} is {config.num_layers} but the weights hold "
                          f"{max(layers) + 1 if layers else 0} layers")
    with torch.device("meta"):
        model = GPTModel(config, config.vocab_size)
        expected = family.to_hf(model.state_dict(), config)
    for name, shape in expected.items():
        if name in stored and tuple(shape.shape) != stored[name]:
            raise ConfigError(f"{source} describes {name} as {tuple(shape.shape)} but the weights hold "
                              f"{stored[name]}")


def _read_safetensors_weights(files: List[Path]) -> Dict[str, torch.Tensor]:
    tensors: Dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    return tensors


def import_hf(input_dir: PathLike, output: PathLike, tokenizer_spec: Optional[str] = None,
              make_vocab_size_divisible_by: int = 128, overwrite: bool = False) -> Path:
    """Converts a Hugging Face GPT-2 or LLaMA directory into a domino weights-only checkpoint (TP=1).

    The embedding (and an untied output layer) gets zero rows up to the padded vocabulary size. The
    tokenizer is taken from ``tokenizer_spec``, else from ``input_dir`` when it holds tokenizer files, else
    GPT-2's.

    Returns:
        The written checkpoint directory (``output/iter_0000000``; ``output/latest`` points at it).
    """
    input_dir, output = Path(input_dir), Path(output)
    config_path = input_dir / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"--input {input_dir} has no config.json (is it a Hugging Face model directory?)")
    _prepare_output(output, overwrite, input_dir, "--input", _ours_in_import)
    try:
        hf_config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{config_path} is not valid JSON: {error}") from None
    model_type = hf_config.get("model_type") if isinstance(hf_config, dict) else None
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ConfigError(f"{config_path}: model_type {model_type!r} is not one of {', '.join(FAMILIES)}")
    config = DominoConfig(model=dataclasses.replace(family.model_config(hf_config, str(config_path)),
                                                    make_vocab_size_divisible_by=make_vocab_size_divisible_by))
    try:  # the relations between the fields (the width a multiple of the heads...), before the model is sized
        validate(config)
    except ConfigError as error:
        raise ConfigError(f"{config_path}: {error}") from None
    has_tokenizer = (input_dir / "tokenizer.json").is_file() or (input_dir / "vocab.json").is_file()
    config = config.replace(tokenizer=tokenizer_spec or (str(input_dir) if has_tokenizer else "gpt2"))
    from domino.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(config.data.tokenizer)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ConfigError(f"tokenizer {config.data.tokenizer} has {tokenizer.vocab_size} ids but the model "
                          f"only {config.model.vocab_size} embedding rows")
    files = _weight_files(input_dir)
    _check_weights_fit(files, config.model, family, str(config_path))
    full = family.from_hf(_read_safetensors_weights(files), config.model)
    padded = padded_vocab_size(config.model.vocab_size, config)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in full:
            rows = full[name]
            full[name] = torch.cat([rows, rows.new_zeros(padded - rows.shape[0], rows.shape[1])])
    output.parent.mkdir(parents=True, exist_ok=True)
    with StagingDirectory(str(output)) as staged:  # as in export_hf
        staging = Path(staged.path)
        written = model_shards.write_weights_only_checkpoint(staging, config, full, padded, tokenizer=tokenizer)
        manifest.seal(written)
        staged.publish(lambda: _publish(staging, output))
    ckpt_dir = output / written.name
    logger.info("imported %s into %s (padded vocabulary %d)", input_dir, ckpt_dir, padded)
    return ckpt_dir
