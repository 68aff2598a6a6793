"""Mapping between our unsharded LLaMA-family state dict and Hugging Face ``LlamaForCausalLM``'s.

The computation is the same (``transformers`` 5.24.0, ``models/llama/modeling_llama.py``): pre-norm ``LlamaRMSNorm``,
rotary embeddings in the ``rotate_half`` layout (ours too, :mod:`domino.model.rotary`, so q and k rows map without
a permutation), ``down_proj(silu(gate_proj(x)) * up_proj(x))``, grouped-query attention whose key/value head ``j``
serves query heads ``j n .. (j + 1) n - 1`` (``repeat_kv``), scaling ``head_dim ** -0.5``. Only the layout
differs:

* our fused QKV rows are ``[group, (q_1 .. q_n, k, v), head_dim]``; HF has ``q_proj`` (heads in order), ``k_proj``
  and ``v_proj`` (groups in order);
* our SwiGLU fc1 rows alternate ``[ffn, (gate, up)]``; HF has ``gate_proj`` and ``up_proj``;
* HF names live under ``model.`` and the output layer is ``lm_head.weight`` (absent from the file when tied).

``transformers`` is not imported here; the config is returned as plain data.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

import torch

from domino.config import ConfigError, ModelConfig
from domino.model.hf_fields import integer, number
from domino.model.rotary import LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_LOW_FREQ_FACTOR, LLAMA3_ORIGINAL_POSITIONS

logger = logging.getLogger(__name__)

StateDict = Dict[str, torch.Tensor]
EMBEDDING, OUTPUT = "model.embed_tokens.weight", "lm_head.weight"


def check_expressible(config: ModelConfig) -> None:
    """Raises ConfigError naming what ``LlamaForCausalLM`` cannot express in ``config``."""
    missing = [flag for flag, ok in (
        ("--position-embedding-type rope", config.rope), ("--normalization RMSNorm", config.normalization == "RMSNorm"),
        ("--swiglu", config.swiglu)) if not ok]
    if missing:
        raise ConfigError(f"LlamaForCausalLM needs {', '.join(missing)}")
    if config.rotary_percent != 1.0:
        raise ConfigError(f"LlamaForCausalLM rotates whole heads; --rotary-percent is {config.rotary_percent}")
    if config.hidden_size % config.num_attention_heads:
        raise ConfigError(f"--hidden-size {config.hidden_size} is not divisible by --num-attention-heads "
                          f"{config.num_attention_heads}")


#: transformers' llama3 rope parameters that our model (as Megatron-LM) fixes.
_LLAMA3_FIXED = {"low_freq_factor": LLAMA3_LOW_FREQ_FACTOR, "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
                 "original_max_position_embeddings": LLAMA3_ORIGINAL_POSITIONS}


def _rope_scaling(config: ModelConfig) -> Dict[str, Any]:
    """transformers' rope type and its parameters for our rotary settings."""
    if not config.use_rope_scaling:
        return {"rope_type": "default"}
    return {"rope_type": "llama3", "factor": float(config.rope_scaling_factor), **_LLAMA3_FIXED}


def _rope_scaling_from_hf(rope: Dict[str, Any], source: str) -> Optional[float]:
    """The --rope-scaling-factor of an HF rope dict (None: plain RoPE); refuses what our model does not compute."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ConfigError(f"{source}: rope type {kind!r} is not supported (only default and llama3)")
    for key, value in _LLAMA3_FIXED.items():
        if number(rope, key, source, value) != value:
            raise ConfigError(f"{source}: llama3 rope scaling with {key} {rope[key]} is not supported (only {value:g},"
                              " as in every Llama 3.x release and Megatron-LM)")
    if "factor" not in rope:
        raise ConfigError(f"{source}: llama3 rope scaling without a factor")
    return number(rope, "factor", source, positive=True)


def hf_llama_config(config: ModelConfig, vocab_size: int, eos_token_id: Optional[int] = None) -> Dict[str, Any]:
    """Keyword arguments of ``transformers.LlamaConfig`` describing the same model.

    Args:
        config: our model config.
        vocab_size: rows of the exported embedding (and output layer).
        eos_token_id: end-of-text id for HF generation (also its beginning-of-text id); None when unknown.
    """
    check_expressible(config)
    bias = not config.disable_bias_linear
    rope = _rope_scaling(config)
    return dict(
        vocab_size=vocab_size, hidden_size=config.hidden_size, intermediate_size=config.ffn_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.query_groups, head_dim=config.head_dim, hidden_act="silu",
        max_position_embeddings=config.num_positions, initializer_range=config.init_method_std,
        rms_norm_eps=config.norm_epsilon, tie_word_embeddings=not config.untie_embeddings_and_output_weights,
        # transformers 5 reads rope_parameters; 4.x reads rope_theta and rope_scaling (5 converts them too): both
        # forms, the same values.
        rope_parameters={"rope_theta": float(config.rotary_base), **rope},
        rope_theta=float(config.rotary_base), rope_scaling=rope if config.use_rope_scaling else None,
        attention_bias=bias, mlp_bias=bias,
        attention_dropout=config.attention_dropout, bos_token_id=eos_token_id, eos_token_id=eos_token_id,
    )


def model_config_from_hf(hf_config: Dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Our :class:`ModelConfig` for a Hugging Face ``LlamaForCausalLM`` ``config.json``.

    Raises:
        ConfigError: for a feature our model does not implement (another activation, a RoPE scaling other than
            Llama 3's, a head width
            other than hidden / heads, attention and MLP biases that differ).
    """
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: hidden_act {hf_config.get('hidden_act')!r} is not supported (SwiGLU uses silu)")
    key = "rope_parameters" if hf_config.get("rope_parameters") else "rope_scaling"
    rope = hf_config.get(key) or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{source}: {key} must be an object, got {rope!r:.80}")
    scaling = _rope_scaling_from_hf(rope, source)
    if number(rope, "partial_rotary_factor", source, number(hf_config, "partial_rotary_factor", source, 1.0)) != 1.0:
        raise ConfigError(f"{source}: partial_rotary_factor is not supported by LlamaForCausalLM exports")
    attention_bias, mlp_bias = hf_config.get("attention_bias", False), hf_config.get("mlp_bias", False)
    if not isinstance(attention_bias, bool) or not isinstance(mlp_bias, bool) or attention_bias != mlp_bias:
        raise ConfigError(f"{source}: attention_bias={attention_bias!r:.20} with mlp_bias={mlp_bias!r:.20}: both "
                          "true or both false (domino's --disable-bias-linear covers both)")
    hidden = integer(hf_config, "hidden_size", source, "hidden_size")
    heads = integer(hf_config, "num_attention_heads", source, "num_attention_heads")
    groups = integer(hf_config, "num_key_value_heads", source, "num_query_groups", heads)
    if integer(hf_config, "head_dim", source, "hidden_size", hidden // heads) * heads != hidden:
        raise ConfigError(f"{source}: head_dim {hf_config.get('head_dim')} x {heads} heads is not hidden_size "
                          f"{hidden} (domino's head width is hidden / heads)")
    positions = integer(hf_config, "max_position_embeddings", source, "max_position_embeddings")
    tie = hf_config.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ConfigError(f"{source}: tie_word_embeddings must be true or false, got {tie!r:.80}")
    return ModelConfig(
        num_layers=integer(hf_config, "num_hidden_layers", source, "num_layers"), hidden_size=hidden,
        num_attention_heads=heads, ffn_hidden_size=integer(hf_config, "intermediate_size", source, "ffn_hidden_size"),
        seq_length=positions, max_position_embeddings=positions,
        vocab_size=integer(hf_config, "vocab_size", source, "vocab_size"), hidden_dropout=0.0,
        attention_dropout=number(hf_config, "attention_dropout", source, 0.0, below=1.0),
        init_method_std=number(hf_config, "initializer_range", source, 0.02, positive=True),
        norm_epsilon=number(hf_config, "rms_norm_eps", source, 1e-6, positive=True), normalization="RMSNorm",
        position_embedding_type="rope",
        rotary_base=int(number(rope, "rope_theta", source, number(hf_config, "rope_theta", source, 10000.0),
                               minimum=1.0)),
        **({} if scaling is None else {"use_rope_scaling": True, "rope_scaling_factor": scaling}),
        swiglu=True, disable_bias_linear=not attention_bias, untie_embeddings_and_output_weights=not tie,
        group_query_attention=groups != heads, num_query_groups=groups if groups != heads else 1)


def _get(sd: StateDict, name: str, where: str) -> torch.Tensor:
    if name not in sd:
        raise ConfigError(f"{where} state dict has no {name!r} (is the config the one the weights were made with?)")
    return sd[name]


def _pairs(i: int, config: ModelConfig):
    """(our name, HF name) of layer ``i``'s tensors that map one to one."""
    ours, hf = f"layers.{i}.", f"model.layers.{i}."
    pairs = [(ours + "input_layernorm.weight", hf + "input_layernorm.weight"),
             (ours + "post_attention_layernorm.weight", hf + "post_attention_layernorm.weight"),
             (ours + "attention.dense.weight", hf + "self_attn.o_proj.weight"),
             (ours + "mlp.dense_4h_to_h.weight", hf + "mlp.down_proj.weight")]
    if not config.disable_bias_linear:
        pairs += [(ours + "attention.dense.bias", hf + "self_attn.o_proj.bias"),
                  (ours + "mlp.dense_4h_to_h.bias", hf + "mlp.down_proj.bias")]
    return pairs


def _fused(i: int, config: ModelConfig):
    """(our fused name, [HF names of its parts], rows per group of each part, groups) of layer ``i``."""
    ours, hf = f"layers.{i}.", f"model.layers.{i}."
    groups, d = config.query_groups, config.head_dim
    n = config.num_attention_heads // groups
    out = []
    for kind in ("weight",) + (() if config.disable_bias_linear else ("bias",)):
        out.append((ours + f"attention.query_key_value.{kind}",
                    [hf + f"self_attn.{p}_proj.{kind}" for p in "qkv"], (n * d, d, d), groups))
        out.append((ours + f"mlp.dense_h_to_4h.{kind}",
                    [hf + f"mlp.{p}_proj.{kind}" for p in ("gate", "up")], (1, 1), config.ffn_size))
    return out


def to_hf_llama_state_dict(full_sd: StateDict, config: ModelConfig) -> StateDict:
    """Our unsharded state dict -> ``LlamaForCausalLM`` state dict (``lm_head.weight`` included even when tied).

    Raises:
        ConfigError: when a tensor is missing or the config cannot be expressed as LLaMA.
    """
    check_expressible(config)
    embedding = _get(full_sd, "embedding.word_embeddings.weight", "domino")
    untied = config.untie_embeddings_and_output_weights
    output = _get(full_sd, "output_layer.weight", "domino") if untied else embedding
    hf: StateDict = {EMBEDDING: embedding.clone(), OUTPUT: output.clone(),
                     "model.norm.weight": _get(full_sd, "final_layernorm.weight", "domino").clone()}
    for i in range(config.num_layers):
        for ours, theirs in _pairs(i, config):
            hf[theirs] = _get(full_sd, ours, "domino").clone()
        for ours, parts, widths, groups in _fused(i, config):
            fused = _get(full_sd, ours, "domino")
            rows = fused.reshape(groups, sum(widths), *fused.shape[1:])
            for name, part in zip(parts, torch.split(rows, list(widths), dim=1)):
                hf[name] = part.reshape(-1, *fused.shape[1:]).contiguous()
    return hf


def from_hf_llama_state_dict(hf_sd: StateDict, config: ModelConfig) -> StateDict:
    """``LlamaForCausalLM`` state dict -> ours (``lm_head.weight`` may be absent when tied).

    Raises:
        ConfigError: when a tensor is missing or has a shape ``config`` does not describe.
    """
    check_expressible(config)
    if config.num_layers and f"model.layers.{config.num_layers}.input_layernorm.weight" in hf_sd:
        raise ConfigError(f"the Hugging Face weights have more than --num-layers {config.num_layers} layers")
    ours: StateDict = {"embedding.word_embeddings.weight": _get(hf_sd, EMBEDDING, "Hugging Face").clone(),
                       "final_layernorm.weight": _get(hf_sd, "model.norm.weight", "Hugging Face").clone()}
    if config.untie_embeddings_and_output_weights:
        ours["output_layer.weight"] = _get(hf_sd, OUTPUT, "Hugging Face").clone()
    for i in range(config.num_layers):
        for name, theirs in _pairs(i, config):
            ours[name] = _get(hf_sd, theirs, "Hugging Face").clone()
        for name, parts, widths, groups in _fused(i, config):
            tensors = [_get(hf_sd, p, "Hugging Face") for p in parts]
            rest = tensors[0].shape[1:]
            for p, t, w in zip(parts, tensors, widths):
                if t.shape[0] != groups * w or t.shape[1:] != rest:
                    raise ConfigError(f"{p} has shape {tuple(t.shape)}; the config needs {(groups * w, *rest)}")
            ours[name] = torch.cat([t.reshape(groups, w, *rest) for t, w in zip(tensors, widths)],
                                   dim=1).reshape(-1, *rest).contiguous()
    return ours
