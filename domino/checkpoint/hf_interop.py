"""Hugging Face interop: export a checkpoint as a GPT-2 model directory, and import one back.

Export merges the TP shards, maps the weights with :mod:`domino.model.hf_gpt2`, drops the vocabulary
padding rows (the tokenizer never produces those ids, and GPT-2 has no padding) and writes
``config.json``, ``model.safetensors``, ``generation_config.json`` and the tokenizer files, so that
``transformers.GPT2LMHeadModel.from_pretrained(dir)`` loads it offline. Nothing here imports
``transformers``. Import reads only safetensors weights (never pickles) and writes a TP=1 weights-only
checkpoint that ``domino pretrain --load DIR --finetune`` can warm-start from.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from domino.checkpoint import manifest
from domino.config import ConfigError, DominoConfig, ModelConfig, config_from_dict, padded_vocab_size
from domino.model import hf_gpt2
from domino.checkpoint import weights_io as wio

logger = logging.getLogger(__name__)

PathLike = Union[str, Path]
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
_WTE = "transformer.wte.weight"


def _prepare_output(output: Path, overwrite: bool) -> None:
    if output.exists() and (not output.is_dir() or any(output.iterdir())) and not overwrite:
        raise ConfigError(f"--output {output} already exists and is not empty (pass --overwrite to replace it)")


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
    """Writes the checkpoint at ``load`` as a Hugging Face GPT-2 directory.

    Args:
        load: a save root or an ``iter_*`` checkpoint directory (any TP size).
        output: the directory to create.
        tokenizer_spec: overrides the checkpoint's tokenizer.
        overwrite: replace a non-empty ``output``.

    Returns:
        ``output``.

    Raises:
        ConfigError: for a bad checkpoint, a non-empty output, or a model GPT-2 cannot express.
    """
    ckpt_dir = wio.resolve_checkpoint_dir(load)
    meta = wio.read_checkpoint_meta(ckpt_dir)
    config = config_from_dict(meta["config"])
    wio.check_checkpoint_fits(ckpt_dir, meta, config)
    output = Path(output)
    _prepare_output(output, overwrite)
    tokenizer = wio.load_checkpoint_tokenizer(ckpt_dir, meta, tokenizer_spec)
    vocab = tokenizer.vocab_size
    if vocab > meta["padded_vocab_size"]:
        raise ConfigError(f"the tokenizer has {vocab} ids but checkpoint {ckpt_dir} only "
                          f"{meta['padded_vocab_size']} embedding rows")
    hf_config = hf_gpt2.hf_gpt2_config(config.model, vocab, eos_token_id=tokenizer.eod)
    hf_sd = hf_gpt2.to_hf_gpt2_state_dict(wio.load_full_state_dict(ckpt_dir), config.model)
    hf_sd[_WTE] = hf_sd[_WTE][:vocab].contiguous()
    hf_sd.pop("lm_head.weight", None)  # tied to wte: from_pretrained re-ties it, and safetensors refuses sharing

    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        config_json = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **hf_config,
                       "domino": {"checkpoint": str(ckpt_dir), "iteration": meta["iteration"],
                                  "padded_vocab_size": meta["padded_vocab_size"]}}
        (staging / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
        (staging / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": tokenizer.eod, "eos_token_id": tokenizer.eod}, indent=2) + "\n")
        save_file({k: v.contiguous() for k, v in hf_sd.items()}, str(staging / WEIGHTS_FILE),
                  metadata={"format": "pt"})
        tokenizer.save(str(staging))
        _publish(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("exported %s (iteration %d) to %s", ckpt_dir, meta["iteration"], output)
    return output


def model_config_from_hf(hf_config: Dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Our :class:`ModelConfig` for a Hugging Face GPT-2 ``config.json``.

    Raises:
        ConfigError: for a model type or feature our GPT does not implement.
    """
    if hf_config.get("model_type") != "gpt2":
        raise ConfigError(f"{source}: model_type {hf_config.get('model_type')!r} is not gpt2")
    activation = hf_config.get("activation_function", "gelu_new")
    if activation in _TANH_GELUS:
        logger.warning("%s: activation %s is the tanh approximation of GeLU; domino uses the exact GeLU "
                       "(outputs differ slightly)", source, activation)
    elif activation != "gelu":
        raise ConfigError(f"{source}: activation_function {activation!r} is not supported (domino uses GeLU)")
    unsupported = {"add_cross_attention": True, "scale_attn_by_inverse_layer_idx": True, "scale_attn_weights": False}
    for key, bad in unsupported.items():
        if hf_config.get(key, not bad) == bad:
            raise ConfigError(f"{source}: {key}={bad} is not supported by domino's GPT")
    if not hf_config.get("tie_word_embeddings", True):
        raise ConfigError(f"{source}: untied output embeddings (tie_word_embeddings=false) are not supported")
    try:
        hidden, positions = int(hf_config["n_embd"]), int(hf_config["n_positions"])
        return ModelConfig(
            num_layers=int(hf_config["n_layer"]), hidden_size=hidden, num_attention_heads=int(hf_config["n_head"]),
            ffn_hidden_size=hf_config.get("n_inner") or None, seq_length=positions, max_position_embeddings=positions,
            vocab_size=int(hf_config["vocab_size"]), hidden_dropout=float(hf_config.get("resid_pdrop", 0.1)),
            attention_dropout=float(hf_config.get("attn_pdrop", 0.1)),
            init_method_std=float(hf_config.get("initializer_range", 0.02)),
            layernorm_epsilon=float(hf_config.get("layer_norm_epsilon", 1e-5)))
    except KeyError as error:
        raise ConfigError(f"{source}: missing field {error.args[0]}") from None


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


def _check_weights_fit(files: List[Path], config: ModelConfig, source: str) -> None:
    """Checks ``config.json`` against the weight files' headers before any tensor is read or allocated.

    The expected shapes are those of our model described by ``config``, built on the meta device (no memory)
    and mapped to Hugging Face names, so a config claiming a huge vocabulary or width fails here, cheaply.
    """
    from domino.model import GPTModel

    stored: Dict[str, Tuple[int, ...]] = {}
    for path in files:
        stored.update(wio.read_header_shapes(path))
    if not any(k.startswith("transformer.") for k in stored):
        stored = {"transformer." + k: v for k, v in stored.items()}
    layers = {int(k.split(".")[2]) for k in stored if k.startswith("transformer.h.") and k.split(".")[2].isdigit()}
    if config.num_layers != (max(layers) + 1 if layers else 0):
        raise ConfigError(f"{source}: n_layer is {config.num_layers} but the weights hold "
                          f"{max(layers) + 1 if layers else 0} layers")
    with torch.device("meta"):
        model = GPTModel(config, config.vocab_size)
        expected = hf_gpt2.to_hf_gpt2_state_dict(model.state_dict(), config)
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
    """Converts a Hugging Face GPT-2 directory into a domino weights-only checkpoint (TP=1).

    The embedding gets zero rows up to the padded vocabulary size. The tokenizer is taken from
    ``tokenizer_spec``, else from ``input_dir`` when it holds tokenizer files, else GPT-2's.

    Returns:
        The written checkpoint directory (``output/iter_0000000``; ``output/latest`` points at it).
    """
    input_dir, output = Path(input_dir), Path(output)
    config_path = input_dir / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"--input {input_dir} has no config.json (is it a Hugging Face model directory?)")
    _prepare_output(output, overwrite)
    try:
        hf_config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{config_path} is not valid JSON: {error}") from None
    config = DominoConfig()
    config.model = model_config_from_hf(hf_config, str(config_path))
    config.model.make_vocab_size_divisible_by = make_vocab_size_divisible_by
    has_tokenizer = (input_dir / "tokenizer.json").is_file() or (input_dir / "vocab.json").is_file()
    config.data.tokenizer = tokenizer_spec or (str(input_dir) if has_tokenizer else "gpt2")
    from domino.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(config.data.tokenizer)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ConfigError(f"tokenizer {config.data.tokenizer} has {tokenizer.vocab_size} ids but the model "
                          f"only {config.model.vocab_size} embedding rows")
    files = _weight_files(input_dir)
    _check_weights_fit(files, config.model, str(config_path))
    full = hf_gpt2.from_hf_gpt2_state_dict(_read_safetensors_weights(files), config.model)
    padded = padded_vocab_size(config.model.vocab_size, config)
    wte = full["embedding.word_embeddings.weight"]
    full["embedding.word_embeddings.weight"] = torch.cat([wte, wte.new_zeros(padded - wte.shape[0], wte.shape[1])])
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        written = wio.write_weights_only_checkpoint(staging, config, full, padded, tokenizer=tokenizer)
        manifest.seal(written)
        _publish(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    ckpt_dir = output / written.name
    logger.info("imported %s into %s (padded vocabulary %d)", input_dir, ckpt_dir, padded)
    return ckpt_dir
