"""GPT: token (+ learned position) embeddings, pre-norm transformer layers, final norm, output layer.

On one device this is a plain GPT-2-style model by default, and a LLaMA-style one with rotary positions, RMSNorm,
SwiGLU, no biases, grouped-query attention and an untied output layer (each a flag of :class:`ModelConfig`; the
pieces are swapped in :mod:`domino.model.transformer`). Tensor parallelism happens inside the layer classes of
:mod:`domino.parallel.layers`; with ``domino_chunks > 1`` the layer stack runs on the overlapped schedule of
:mod:`domino.model.domino_stack` (same parameters, same results).

Parameter names (stable; checkpoints and :mod:`domino.checkpoint.sharding` rely on them)::

    embedding.word_embeddings.weight            [V/tp, h]   split on dim 0
    embedding.position_embeddings.weight        [P, h]      learned_absolute only
    layers.{i}.input_layernorm.{weight,bias}                no bias with RMSNorm
    layers.{i}.attention.query_key_value.weight [(n+2g)d/tp, h]  split on dim 0, rows [group, q..|k|v, head_dim]
    layers.{i}.attention.query_key_value.bias   [(n+2g)d/tp]     (n heads, g query groups; g = n without GQA)
    layers.{i}.attention.dense.weight           [h, h/tp]   split on dim 1
    layers.{i}.attention.dense.bias             [h]
    layers.{i}.post_attention_layernorm.{weight,bias}
    layers.{i}.mlp.dense_h_to_4h.{weight,bias}  [f/tp, h], [f/tp]  SwiGLU: [2f/tp, h], rows [ffn, gate|up]
    layers.{i}.mlp.dense_4h_to_h.weight         [h, f/tp]   split on dim 1
    layers.{i}.mlp.dense_4h_to_h.bias           [h]
    final_layernorm.{weight,bias}
    output_layer.weight                         [V/tp, h]   untied, or post_process without pre_process

Every ``.bias`` of a linear is absent with ``--disable-bias-linear``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from domino.config import ModelConfig
from domino.model.domino_stack import DominoLayerStack
from domino.model.kv_cache import KVCache
from domino.model.recompute import run_layers
from domino.model.rotary import RotaryTables
from domino.model.transformer import TransformerLayer, build_norm
from domino.parallel.collectives import (
    comm_site, copy_to_tp_region, gather_from_sequence_region, gather_from_tp_region, scatter_to_sequence_region,
)
from domino.parallel.cross_entropy import vocab_parallel_linear_cross_entropy
from domino.parallel.layers import VocabParallelEmbedding
from domino.parallel.linear_ops import linear


class Embedding(nn.Module):
    """Word (vocab-parallel) plus learned position embeddings (none with rotary positions), then dropout."""

    def __init__(self, config: ModelConfig, vocab_size: int) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(vocab_size, config.hidden_size, config.init_method_std)
        if not config.rope:
            self.position_embeddings = nn.Embedding(config.num_positions, config.hidden_size)
            nn.init.normal_(self.position_embeddings.weight, mean=0.0, std=config.init_method_std)
        self.dropout = config.hidden_dropout

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """``[b, s]`` tokens and positions -> ``[b, s, h]``."""
        return self.finish(self.word_embeddings(tokens), position_ids)

    def finish(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The (all-reduced) word embeddings ``[b, s, h]`` -> plus position embeddings, then dropout."""
        if hasattr(self, "position_embeddings"):
            hidden = hidden + self.position_embeddings(position_ids)
        return F.dropout(hidden, p=self.dropout, training=self.training) if self.dropout > 0 else hidden


class GPTModel(nn.Module):
    """GPT language model with tensor parallelism and optional Domino overlap.

    Args:
        config: model shape and regularisation.
        vocab_size: the *padded* vocabulary size (``domino.config.padded_vocab_size``), divisible by TP.
        domino_chunks: batch chunks of the overlapped schedule; 1 = plain synchronous TP.
        pre_process: owns the embeddings (``forward`` takes token ids); else ``tokens`` are hidden states.
        post_process: owns the final LayerNorm and output layer; else ``forward`` returns hidden states.
        parallel_output: keep logits split along the vocabulary (``[b, s, V/tp]``); False gathers them.
    """

    def __init__(self, config: ModelConfig, vocab_size: int, domino_chunks: int = 1, pre_process: bool = True,
                 post_process: bool = True, parallel_output: bool = True) -> None:
        super().__init__()
        self.config = config
        self.vocab_size = vocab_size
        self.pre_process = pre_process
        self.post_process = post_process
        self.parallel_output = parallel_output
        if pre_process:
            self.embedding = Embedding(config, vocab_size)
        self.layers = nn.ModuleList(TransformerLayer(config, i) for i in range(config.num_layers))
        if post_process:
            self.final_layernorm = build_norm(config)
            # Untied, or no embedding here to tie to: the output layer holds its own vocab projection.
            if config.untie_embeddings_and_output_weights or not pre_process:
                self.output_layer = VocabParallelEmbedding(vocab_size, config.hidden_size, config.init_method_std)
        self.domino_chunks = domino_chunks
        self.domino = DominoLayerStack(self.layers, domino_chunks) if domino_chunks > 1 else None
        #: Layer groups of full activation recompute (set by domino.model.recompute); None: no recompute.
        self.recompute_units = None
        #: Sequence parallelism of the training forward (set by domino.model.sequence_parallel).
        self.sequence_parallel = False

    def output_weight(self) -> torch.Tensor:
        """The ``[V/tp, h]`` matrix of the output layer (the word embeddings when tied)."""
        return self.output_layer.weight if hasattr(self, "output_layer") else self.embedding.word_embeddings.weight

    def new_kv_cache(self) -> KVCache:
        """An empty cache sized for this model."""
        return KVCache(self.config.num_layers, max_length=self.config.num_positions)

    def forward(self, tokens: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                kv_cache: Optional[KVCache] = None) -> torch.Tensor:
        """Runs the model.

        Args:
            tokens: ``[b, s]`` int64 token ids (``[b, s, h]`` hidden states when ``pre_process=False``).
            position_ids: ``[b or 1, s]``; default ``arange`` (continuing after the cached tokens).
            attention_mask: None for causal attention; else bool ``[b or 1, 1, s, s_total]``, True = masked.
            labels: ``[b, s]`` int64 targets; when given, per-token losses are returned instead of logits.
            kv_cache: cache of past keys/values (generation); grows by ``s`` tokens. Runs synchronously
                (as does a batch smaller than ``domino_chunks``).

        Returns:
            ``[b, s]`` fp32 losses with ``labels``; else logits ``[b, s, V/tp]`` (``[b, s, V]`` when
            ``parallel_output=False``); ``[b, s, h]`` hidden states when ``post_process=False``.
        """
        s = tokens.shape[1]
        past = 0
        if kv_cache is not None:
            kv_cache.check_room(s)
            past = kv_cache.length
        if position_ids is None:
            if past + s > self.config.num_positions:  # explicit ids are not checked: that would sync a GPU
                raise ValueError(f"{past + s} tokens exceed --max-position-embeddings {self.config.num_positions}")
            position_ids = torch.arange(past, past + s, device=tokens.device).unsqueeze(0)
        # Generation (KV cache) and batches too small to split run the synchronous path: same weights, same maths.
        overlapped = self.domino is not None and kv_cache is None and tokens.shape[0] >= self.domino.chunks
        sequence_parallel = overlapped and self.sequence_parallel
        # Domino: the word embeddings' all-reduce is launched per chunk, each chunk waits for its own as it starts
        # (not with embedding dropout, whose mask is drawn for the whole batch, as without Domino).
        embed_in_stack = overlapped and self.pre_process and not sequence_parallel and not (
            self.embedding.dropout > 0 and self.training)
        if embed_in_stack:
            hidden = self.embedding.word_embeddings.partial(tokens)
        else:
            with comm_site("fwd embedding"):  # labels its all-reduce in the comm-wait breakdown
                hidden = self.embedding(tokens, position_ids) if self.pre_process else tokens
        rotary = None
        if self.config.rope:
            c = self.config
            rotary = RotaryTables.for_positions(position_ids, int(c.head_dim * c.rotary_percent), c.rotary_base,
                                                hidden.dtype, c.rope_scaling_factor if c.use_rope_scaling else None)
        final_ln = self.final_layernorm if self.post_process else None
        # SDPA takes True = may attend: inverted once per batch, shared (as views) by every layer and chunk.
        attend_mask = None if attention_mask is None else ~attention_mask
        if overlapped:
            if sequence_parallel:  # the residual stream becomes this rank's sequence slice
                hidden = scatter_to_sequence_region(hidden)
            # Plain TP with the output layer here: each chunk's output is guarded, so the output layer's input
            # gradient is all-reduced per chunk and the last chunk's backward overlaps the others' all-reduces.
            chunked_slots = final_ln is not None and not sequence_parallel
            finish = None
            if embed_in_stack:
                def finish(words: torch.Tensor, rows: slice) -> torch.Tensor:
                    return self.embedding.finish(words, position_ids[rows] if position_ids.shape[0] > 1 else
                                                 position_ids)
            hidden = self.domino(hidden, attend_mask, final_ln, rotary, guard_output=chunked_slots,
                                 finish_input=finish)
            if chunked_slots:
                hidden, output_slot = hidden
        else:
            if self.recompute_units is not None and kv_cache is None:
                hidden = run_layers(self.layers, self.recompute_units, hidden, attend_mask, rotary)
            else:
                for layer in self.layers:
                    hidden = layer(hidden, attend_mask, kv_cache, rotary)
            if final_ln is not None:
                hidden = final_ln(hidden)
        if not self.post_process:
            return hidden
        if sequence_parallel:  # the gather's backward reduce-scatters the input gradient
            hidden, slot = gather_from_sequence_region(hidden), None
        elif overlapped:  # the input-gradient all-reduces run during the output layer's weight-gradient GEMM
            slot = output_slot
        else:
            hidden, slot = copy_to_tp_region(hidden), None
        if labels is not None:  # the logits are computed inside, so their buffer is reused for the softmax
            return vocab_parallel_linear_cross_entropy(hidden, self.output_weight(), labels, grad_slot=slot)
        logits = F.linear(hidden, self.output_weight()) if slot is None else linear(hidden, self.output_weight(),
                                                                                    grad_slot=slot)
        return logits if self.parallel_output else gather_from_tp_region(logits)
