"""Mapping between our unsharded GPT state dict and Hugging Face ``GPT2LMHeadModel``'s.

The architectures are the same (learned positions, pre-LN, erf GeLU ``"gelu"``, tied output layer); only the
layout differs:

* HF's ``Conv1D`` stores weights as ``[in, out]``: every linear weight is transposed.
* HF's ``c_attn`` columns are ``[q (all heads) | k | v]``; our fused QKV rows are ``[head, q|k|v, head_dim]``.
* HF names live under ``transformer.`` and repeat the tied output weight as ``lm_head.weight``.

``transformers`` is imported only by :func:`hf_gpt2_config` users; this module itself needs torch alone.
The vocabulary stays padded (HF rows past the tokenizer's size are never produced by the tokenizer).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

import torch

from domino.config import ConfigError, ModelConfig
from domino.model.hf_fields import integer, number

logger = logging.getLogger(__name__)

StateDict = Dict[str, torch.Tensor]
_GPT2_EOS = 50256
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def _check_expressible(config: ModelConfig) -> None:
    llama = [flag for flag, used in (
        ("--position-embedding-type rope", config.rope), ("--normalization RMSNorm", config.normalization == "RMSNorm"),
        ("--swiglu", config.swiglu), ("--disable-bias-linear", config.disable_bias_linear),
        ("--untie-embeddings-and-output-weights", config.untie_embeddings_and_output_weights),
        ("--group-query-attention", config.group_query_attention)) if used]
    if llama:
        raise ConfigError(f"GPT-2 cannot express {', '.join(llama)}")
    if config.hidden_size % config.num_attention_heads:
        raise ConfigError(f"GPT-2 needs --hidden-size ({config.hidden_size}) divisible by "
                          f"--num-attention-heads ({config.num_attention_heads})")


def hf_gpt2_config(config: ModelConfig, vocab_size: int, eos_token_id: Optional[int] = None) -> Dict[str, Any]:
    """Keyword arguments for ``transformers.GPT2Config`` describing the same model.

    Args:
        config: our model config.
        vocab_size: the padded vocabulary size (rows of the word embeddings).
        eos_token_id: end-of-text id for HF generation; default GPT-2's 50256 when it fits the vocabulary.
    """
    _check_expressible(config)
    if eos_token_id is None and vocab_size > _GPT2_EOS:
        eos_token_id = _GPT2_EOS
    return dict(
        vocab_size=vocab_size, n_positions=config.num_positions, n_embd=config.hidden_size,
        n_layer=config.num_layers, n_head=config.num_attention_heads,
        n_inner=None if config.ffn_size == 4 * config.hidden_size else config.ffn_size,
        activation_function="gelu",  # exact erf GeLU, as ours (HF's "gelu_new" would be the tanh approximation)
        resid_pdrop=config.hidden_dropout, embd_pdrop=config.hidden_dropout, attn_pdrop=config.attention_dropout,
        layer_norm_epsilon=config.norm_epsilon, initializer_range=config.init_method_std,
        tie_word_embeddings=True, bos_token_id=eos_token_id, eos_token_id=eos_token_id,
    )


def _qkv_ours_to_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[head, 3, d, ...]`` rows -> ``[3, head, d, ...]`` rows."""
    rest = t.shape[1:]
    return t.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(-1, *rest)


def _qkv_hf_to_ours(t: torch.Tensor, heads: int) -> torch.Tensor:
    rest = t.shape[1:]
    return t.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(-1, *rest)


def _layer_pairs(i: int):
    """(our name, HF name, transposed) for layer ``i``."""
    ours, hf = f"layers.{i}.", f"transformer.h.{i}."
    return [
        (ours + "input_layernorm.weight", hf + "ln_1.weight", False),
        (ours + "input_layernorm.bias", hf + "ln_1.bias", False),
        (ours + "attention.dense.weight", hf + "attn.c_proj.weight", True),
        (ours + "attention.dense.bias", hf + "attn.c_proj.bias", False),
        (ours + "post_attention_layernorm.weight", hf + "ln_2.weight", False),
        (ours + "post_attention_layernorm.bias", hf + "ln_2.bias", False),
        (ours + "mlp.dense_h_to_4h.weight", hf + "mlp.c_fc.weight", True),
        (ours + "mlp.dense_h_to_4h.bias", hf + "mlp.c_fc.bias", False),
        (ours + "mlp.dense_4h_to_h.weight", hf + "mlp.c_proj.weight", True),
        (ours + "mlp.dense_4h_to_h.bias", hf + "mlp.c_proj.bias", False),
    ]


def _get(sd: StateDict, name: str, where: str) -> torch.Tensor:
    if name not in sd:
        raise ConfigError(f"{where} state dict has no {name!r} (is the config the one the weights were made with?)")
    return sd[name]


def to_hf_gpt2_state_dict(full_sd: StateDict, config: ModelConfig) -> StateDict:
    """Our unsharded state dict -> ``GPT2LMHeadModel`` state dict (``lm_head.weight`` included, tied).

    Raises:
        ConfigError: when a parameter is missing or the config cannot be expressed as GPT-2.
    """
    _check_expressible(config)
    heads = config.num_attention_heads
    wte = _get(full_sd, "embedding.word_embeddings.weight", "domino")
    hf: StateDict = {
        "transformer.wte.weight": wte.clone(),
        "transformer.wpe.weight": _get(full_sd, "embedding.position_embeddings.weight", "domino").clone(),
        "transformer.ln_f.weight": _get(full_sd, "final_layernorm.weight", "domino").clone(),
        "transformer.ln_f.bias": _get(full_sd, "final_layernorm.bias", "domino").clone(),
        "lm_head.weight": wte.clone(),
    }
    for i in range(config.num_layers):
        qkv_w = _get(full_sd, f"layers.{i}.attention.query_key_value.weight", "domino")
        qkv_b = _get(full_sd, f"layers.{i}.attention.query_key_value.bias", "domino")
        hf[f"transformer.h.{i}.attn.c_attn.weight"] = _qkv_ours_to_hf(qkv_w, heads).t().contiguous()
        hf[f"transformer.h.{i}.attn.c_attn.bias"] = _qkv_ours_to_hf(qkv_b, heads).contiguous()
        for ours, theirs, transpose in _layer_pairs(i):
            t = _get(full_sd, ours, "domino")
            hf[theirs] = t.t().contiguous() if transpose else t.clone()
    return hf


def from_hf_gpt2_state_dict(hf_sd: StateDict, config: ModelConfig) -> StateDict:
    """``GPT2LMHeadModel`` (or ``GPT2Model``, without the ``transformer.`` prefix) state dict -> ours.

    Raises:
        ConfigError: when a weight is missing or its shape does not fit ``config``.
    """
    _check_expressible(config)
    if not any(k.startswith("transformer.") for k in hf_sd):
        hf_sd = {"transformer." + k: v for k, v in hf_sd.items()}
    heads, h = config.num_attention_heads, config.hidden_size
    ours: StateDict = {
        "embedding.word_embeddings.weight": _get(hf_sd, "transformer.wte.weight", "Hugging Face").clone(),
        "embedding.position_embeddings.weight": _get(hf_sd, "transformer.wpe.weight", "Hugging Face").clone(),
        "final_layernorm.weight": _get(hf_sd, "transformer.ln_f.weight", "Hugging Face").clone(),
        "final_layernorm.bias": _get(hf_sd, "transformer.ln_f.bias", "Hugging Face").clone(),
    }
    expected = {"embedding.position_embeddings.weight": (config.num_positions, h)}
    for i in range(config.num_layers):
        qkv_w = _get(hf_sd, f"transformer.h.{i}.attn.c_attn.weight", "Hugging Face")
        if tuple(qkv_w.shape) != (h, 3 * h):
            raise ConfigError(f"transformer.h.{i}.attn.c_attn.weight has shape {tuple(qkv_w.shape)}; "
                              f"--hidden-size {h} needs ({h}, {3 * h})")
        ours[f"layers.{i}.attention.query_key_value.weight"] = _qkv_hf_to_ours(qkv_w.t(), heads).contiguous()
        ours[f"layers.{i}.attention.query_key_value.bias"] = _qkv_hf_to_ours(
            _get(hf_sd, f"transformer.h.{i}.attn.c_attn.bias", "Hugging Face"), heads).contiguous()
        for name, theirs, transpose in _layer_pairs(i):
            t = _get(hf_sd, theirs, "Hugging Face")
            ours[name] = t.t().contiguous() if transpose else t.clone()
        expected[f"layers.{i}.mlp.dense_h_to_4h.weight"] = (config.ffn_size, h)
    if f"transformer.h.{config.num_layers}.ln_1.weight" in hf_sd:
        raise ConfigError(f"the Hugging Face weights have more than --num-layers {config.num_layers} layers")
    for name, shape in expected.items():
        if tuple(ours[name].shape) != shape:
            raise ConfigError(f"{name} has shape {tuple(ours[name].shape)} from the Hugging Face weights; "
                              f"the config needs {shape}")
    return ours


def model_config_from_hf(hf_config: Dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Our :class:`ModelConfig` for a Hugging Face GPT-2 ``config.json``.

    Raises:
        ConfigError: for a model type or feature our GPT does not implement.
    """
    if hf_config.get("model_type") != "gpt2":
        raise ConfigError(f"{source}: model_type {hf_config.get('model_type')!r} is not gpt2")
    activation = hf_config.get("activation_function", "gelu_new")
    if not isinstance(activation, str):
        raise ConfigError(f"{source}: activation_function must be a name, got {activation!r:.80}")
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
    positions = integer(hf_config, "n_positions", source, "max_position_embeddings")
    return ModelConfig(
        num_layers=integer(hf_config, "n_layer", source, "num_layers"),
        hidden_size=integer(hf_config, "n_embd", source, "hidden_size"),
        num_attention_heads=integer(hf_config, "n_head", source, "num_attention_heads"),
        ffn_hidden_size=integer(hf_config, "n_inner", source, "ffn_hidden_size", default=None),
        seq_length=positions, max_position_embeddings=positions,
        vocab_size=integer(hf_config, "vocab_size", source, "vocab_size"),
        hidden_dropout=number(hf_config, "resid_pdrop", source, 0.1, below=1.0),
        attention_dropout=number(hf_config, "attn_pdrop", source, 0.1, below=1.0),
        init_method_std=number(hf_config, "initializer_range", source, 0.02, positive=True),
        norm_epsilon=number(hf_config, "layer_norm_epsilon", source, 1e-5, positive=True))
