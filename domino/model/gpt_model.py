"""GPT: token (+ learned position) embeddings, pre-norm transformer layers, final norm, output layer.

On one device this is a plain GPT-2-style model by default, and a LLaMA-style one with rotary positions, RMSNorm,
SwiGLU, no biases, grouped-query attention and an untied output layer (each a flag of :class:`ModelConfig`; the
pieces are swapped in :mod:`domino.model.transformer`). Tensor parallelism happens inside the layer classes of
:mod:`domino.parallel.layers`. The forward reads ``embed -> stack -> head``: the layer stack is an object
(:mod:`domino.model.stack`) that the overlapped schedules replace from outside (sequence parallelism and Domino,
:mod:`domino.overlap`; activation recompute, :mod:`domino.model.recompute`), with the same parameters and results.

Activation layout: token ids and what the model returns are batch-first (``[b, s]``, ``[b, s, ...]``), but
between the embedding and the output layer the residual stream is sequence-first, ``[s, b, h]``, as in
Megatron-LM (``LanguageModelEmbedding.forward`` turns ``[b s h]`` into ``[s b h]`` "to avoid explicit
transposes", ``megatron/core/models/common/embeddings/language_model_embedding.py``; ``TransformerBlock`` works
in ``[s, b, h]``; NVIDIA/Megatron-LM d98e8a64). The reason is tensor parallelism: sequence parallelism splits,
gathers and reduce-scatters the sequence, which is then dimension 0, so every collective's buffer is a
contiguous activation or block of one (no transpose, no copy), and Domino's batch chunks split dimension 1, as
DeepSpeed-Domino does (``torch.tensor_split(encoder_input, 2, dim=1)`` in microsoft/DeepSpeedExamples
``training/DeepSpeed-Domino/domino/language_model.py``, 7114c08e). On one device nothing else changes: the
layers are position-wise except attention, which views its ``[s, b, heads, d]`` queries, keys and values as
SDPA's ``[b, heads, s, d]``. There is one transpose in, of the token ids (the lookup then writes ``[s, b, h]``
directly), and one out: of the labels (``[b, s] -> [s, b]``, as Megatron's ``compute_language_model_loss``) and
the per-token losses back, or a ``[b, s, V]`` view of the ``[s, b, V]`` logits.

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
from domino.model.kv_cache import KVCache
from domino.model.rotary import RotaryTables
from domino.model.stack import LayerStack, SynchronousStack
from domino.model.transformer import TransformerLayer, build_norm
from domino.parallel.collectives import gather_from_tp_region
from domino.parallel.context_split import local_token_indices
from domino.parallel.cross_entropy import (LogitsBuffer, vocab_parallel_cross_entropy,
                                           vocab_parallel_linear_cross_entropy)
from domino.parallel.document_attention import is_document_starts
from domino.parallel.kernels import Kernels, resolve
from domino.parallel.layers import VocabParallelEmbedding
from domino.parallel.linear_ops import GradSlot, linear
from domino.runtime.mesh import SINGLE, MeshGroup


class Embedding(nn.Module):
    """Word (vocab-parallel) plus learned position embeddings (none with rotary positions), then dropout."""

    def __init__(self, config: ModelConfig, vocab_size: int, tp: MeshGroup = SINGLE) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(vocab_size, config.hidden_size, config.init_method_std, tp)
        if not config.rope:
            self.position_embeddings = nn.Embedding(config.num_positions, config.hidden_size)
            nn.init.normal_(self.position_embeddings.weight, mean=0.0, std=config.init_method_std)
        self.dropout = config.hidden_dropout

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """``[b, s]`` tokens and ``[b or 1, s]`` positions -> ``[s, b, h]`` (the ids are transposed, not the
        embeddings: the lookup writes sequence-first rows)."""
        return self.finish(self.word_embeddings(tokens.t()), position_ids)

    def finish(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The (all-reduced) word embeddings ``[s, b, h]`` -> plus the embeddings of ``[b or 1, s]`` positions,
        then dropout."""
        if hasattr(self, "position_embeddings"):
            hidden = hidden + self.position_embeddings(position_ids.t())
        return F.dropout(hidden, p=self.dropout, training=self.training) if self.dropout > 0 else hidden


class GPTModel(nn.Module):
    """GPT language model with tensor parallelism; readable on one device.

    Args:
        config: model shape and regularisation.
        vocab_size: the *padded* vocabulary size (``domino.config.padded_vocab_size``), divisible by TP.
        pre_process: owns the embeddings (``forward`` takes token ids); else ``tokens`` are hidden states.
        post_process: owns the final LayerNorm and output layer; else ``forward`` returns hidden states.
        parallel_output: keep logits split along the vocabulary (``[b, s, V/tp]``); False gathers them.
        tp: the tensor-parallel group of the run's mesh (``ParallelMesh.tp``) every layer is split over; one
            process by default, so the model reads as plain PyTorch on one device.
        cp: the context-parallel group (``ParallelMesh.cp``) whose ranks hold the other chunks of each sequence:
            attention runs as a ring over it (:mod:`domino.parallel.ring_attention`), the rest is position-wise.
            The model then reads this rank's chunks (by default at their positions in the whole sequence).
    """

    def __init__(self, config: ModelConfig, vocab_size: int, pre_process: bool = True, post_process: bool = True,
                 parallel_output: bool = True, tp: MeshGroup = SINGLE, cp: MeshGroup = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.cp = cp
        self.vocab_size = vocab_size
        self.pre_process = pre_process
        self.post_process = post_process
        self.parallel_output = parallel_output
        # The kernel choice of its loss and its stack, given by parallelize with its layers' (None: the device's).
        self.kernels: Optional[Kernels] = None
        # The fused loss's logits-sized buffer kept from step to step, where the kernels the loss runs with keep
        # one (CPU), else None (:meth:`_logits_buffer`). A plain attribute: no state_dict entry, untouched by .to().
        self.logits_buffer: Optional[LogitsBuffer] = None
        if pre_process:
            self.embedding = Embedding(config, vocab_size, tp)
        self.layers = nn.ModuleList(TransformerLayer(config, i, tp, cp) for i in range(config.num_layers))
        if post_process:
            self.final_layernorm = build_norm(config)
            # Untied, or no embedding here to tie to: the output layer holds its own vocab projection.
            if config.untie_embeddings_and_output_weights or not pre_process:
                self.output_layer = VocabParallelEmbedding(vocab_size, config.hidden_size, config.init_method_std,
                                                           tp)
        #: What runs the layers: synchronous TP; ``domino.overlap`` and ``domino.model.recompute`` change it.
        self.stack: LayerStack = SynchronousStack(self)

    def output_weight(self) -> torch.Tensor:
        """The ``[V/tp, h]`` matrix of the output layer (the word embeddings when tied)."""
        return self.output_layer.weight if hasattr(self, "output_layer") else self.embedding.word_embeddings.weight

    def new_kv_cache(self) -> KVCache:
        """An empty cache sized for this model."""
        return KVCache(self.config.num_layers, max_length=self.config.num_positions)

    def forward(self, tokens: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                kv_cache: Optional[KVCache] = None) -> torch.Tensor:
        """Runs the model: embed -> layer stack -> head.

        Args:
            tokens: ``[b, s]`` int64 token ids (``[s, b, h]`` hidden states when ``pre_process=False``).
            position_ids: ``[b or 1, s]``; default ``arange`` (continuing after the cached tokens).
            attention_mask: None for causal attention; int ``[b, s]`` document starts (``--reset-attention-mask``:
                the position where each token's document begins; each token attends to its document's earlier
                tokens, :mod:`domino.parallel.document_attention`; under context parallelism this rank's chunks'); or
                a dense bool ``[b or 1, 1, s, s_total]`` mask, True = masked (Megatron's; the reference).
            labels: ``[b, s]`` int64 targets; when given, per-token losses are returned instead of logits.
            kv_cache: cache of past keys/values (generation); grows by ``s`` tokens; runs the synchronous stack.

        Returns:
            ``[b, s]`` fp32 losses with ``labels``; else logits ``[b, s, V/tp]`` (``[b, s, V]`` when
            ``parallel_output=False``), a view of the sequence-first ``[s, b, ...]`` result; ``[s, b, h]`` hidden
            states when ``post_process=False`` (what the next pipeline stage reads).
        """
        batch, seq = tokens.shape[:2] if self.pre_process else tokens.shape[1::-1]
        position_ids = self._position_ids(seq, tokens.device, position_ids, kv_cache)
        stack = self.stack.select(batch, kv_cache)  # generation and unsplittable batches: synchronous
        hidden = stack.embed(tokens, position_ids)  # [s, b, h] (or what the stack finishes: a slice, a partial)
        rotary = self._rotary(position_ids, hidden.dtype)  # None without rope
        attend_mask = attention_mask  # None, or document starts: as they are
        if attention_mask is not None and not is_document_starts(attention_mask):
            attend_mask = ~attention_mask  # SDPA: True = may attend; made once
        hidden, grad_slot = stack(hidden, position_ids, attend_mask, rotary, kv_cache)  # [s, b, h] after the norm
        if not self.post_process:
            return hidden
        return self._head(hidden, grad_slot, labels)

    def _position_ids(self, s: int, device: torch.device, position_ids: Optional[torch.Tensor],
                      kv_cache: Optional[KVCache]) -> torch.Tensor:
        """``position_ids``, or ``[1, s]`` positions continuing after the cached tokens (room checked first)."""
        past = 0
        if kv_cache is not None:
            kv_cache.check_room(s)
            past = kv_cache.length
        if position_ids is not None:  # explicit ids are not checked: that would sync a GPU
            return position_ids
        if self.cp.size > 1:  # this rank's chunks of a sequence CP times as long
            whole = s * self.cp.size
            if whole > self.config.num_positions:
                raise ValueError(f"{whole} tokens exceed --max-position-embeddings {self.config.num_positions}")
            return local_token_indices(whole, self.cp, device).unsqueeze(0)
        if past + s > self.config.num_positions:
            raise ValueError(f"{past + s} tokens exceed --max-position-embeddings {self.config.num_positions}")
        return torch.arange(past, past + s, device=device).unsqueeze(0)

    def _rotary(self, position_ids: torch.Tensor, dtype: torch.dtype) -> Optional[RotaryTables]:
        """The rotary tables of ``position_ids`` (--position-embedding-type rope), else None."""
        c = self.config
        if not c.rope:
            return None
        return RotaryTables.for_positions(position_ids, int(c.head_dim * c.rotary_percent), c.rotary_base, dtype,
                                          c.rope_scaling_factor if c.use_rope_scaling else None)

    def _head(self, hidden: torch.Tensor, grad_slot: Optional[GradSlot], labels: Optional[torch.Tensor]) -> torch.Tensor:
        """The output layer on ``[s, b, h]``: ``[b, s]`` per-token losses with ``[b, s]`` ``labels`` (the fused
        vocab-parallel loss), else ``[b, s, V/tp]`` (or gathered ``[b, s, V]``) logits.

        The labels are transposed to the activations' ``[s, b]`` and the losses back (tokens, not ``h``-wide rows:
        Megatron's ``compute_language_model_loss`` does the same); the logits are returned as a batch-first view.
        ``grad_slot`` (from an overlapped stack) receives the launch of the input gradient's reduction.
        """
        weight = self.output_weight()
        if labels is not None:
            labels = labels.t().contiguous()  # [b, s] -> [s, b]
        kernels = resolve(self.kernels, hidden.device)
        if labels is not None and kernels.fused_output_loss:
            # One node: the logits' buffer becomes the softmax, then the gradient (domino.parallel.kernels).
            return vocab_parallel_linear_cross_entropy(hidden, weight, labels, self.tp, grad_slot=grad_slot,
                                                       kernels=kernels,
                                                       buffer=self._logits_buffer(kernels)).t().contiguous()
        # No FP8 recipe: the output layer stays in high precision (Megatron-LM's FP8 keeps it in bf16).
        logits = F.linear(hidden, weight) if grad_slot is None else linear(hidden, weight, grad_slot=grad_slot)
        if labels is not None:
            return vocab_parallel_cross_entropy(logits, labels, self.tp, kernels).t().contiguous()
        return (logits if self.parallel_output else gather_from_tp_region(logits, self.tp)).transpose(0, 1)

    def _logits_buffer(self, kernels: Kernels) -> Optional[LogitsBuffer]:
        """The model's :class:`LogitsBuffer` where ``kernels`` (the table this forward resolved) keep one, else
        None, dropping any kept one: decided per call, so it follows tables given later by ``apply_kernels`` and
        moves between devices."""
        if not kernels.keep_logits_buffer:
            self.logits_buffer = None
            return None
        if self.logits_buffer is None:
            self.logits_buffer = LogitsBuffer()
        return self.logits_buffer
