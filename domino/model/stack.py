"""The layer stack: what runs between the embedding and the output layer, and the one shape every stack returns.

:meth:`GPTModel.forward <domino.model.gpt_model.GPTModel.forward>` reads ``embed -> stack -> head`` and asks its
stack for both of the first two steps. A stack is any object with the :class:`LayerStack` methods; the model
builds the :class:`SynchronousStack` (plain tensor parallelism, every all-reduce waited where it is issued), and
the overlapped stacks are applied from outside, each keeping the stack it replaced as its ``fallback`` for what it
cannot run (generation with a KV cache, a batch it cannot split):

* full activation recompute sets ``units`` on every stack (:mod:`domino.model.recompute`);
* sequence parallelism: :class:`domino.overlap.sequence_parallel.SequenceParallelStack`;
* Domino's overlapped schedule: :class:`domino.overlap.schedule.DominoStack`.

Every stack returns a :class:`StackOutput`: the final norm's output ready for the output layer, and the gradient
slot that layer launches its input gradient's reduction into (None: the stack already placed the synchronous
reduction, ``copy_to_tp_region``, or the model has no output layer).
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Protocol, Sequence, Tuple

import torch
from torch import nn

from domino.model.kv_cache import KVCache
from domino.model.rotary import RotaryTables
from domino.model.segments import checkpoints_attention, draws_tp_dropout
from domino.parallel.collectives import comm_site, copy_to_tp_region
from domino.parallel.document_attention import is_document_starts
from domino.parallel.kernels import Kernels, resolve, run_compiled_block
from domino.parallel.linear_ops import GradSlot
from domino.parallel.recompute import checkpoint

#: ``(start, end, checkpointed)``: a group of consecutive layers, recomputed in backward when checkpointed.
Unit = Tuple[int, int, bool]


class StackOutput(NamedTuple):
    """What every stack returns."""

    hidden: torch.Tensor
    """``[s, b, h]`` after the final norm, ready for the output layer (without one: the last layer's output)."""
    grad_slot: Optional[GradSlot]
    """Where the output layer launches its input gradient's reduction; None when the stack reduces it."""


class LayerStack(Protocol):
    """What :meth:`GPTModel.forward` needs from a stack (declared here, beside its caller)."""

    units: List[Unit]
    """Layer groups in order (full activation recompute checkpoints some); one unchecked group by default."""
    fallback: Optional["LayerStack"]
    """The stack this one replaced; it runs what this one cannot (None for the synchronous stack)."""
    sequence_parallel: bool
    """Whether the residual stream between embedding and output layer is this rank's sequence slice."""

    def select(self, batch: int, kv_cache: Optional[KVCache]) -> "LayerStack":
        """The stack that runs a batch of ``batch`` sequences (``kv_cache``: generation): this one or a fallback."""

    def embed(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The stack's input from ``[b, s]`` tokens: ``[s, b, h]`` embeddings, or what the stack's call finishes
        (this rank's sequence slice; Domino's unreduced lookups); ``tokens`` itself (``[s, b, h]`` hidden states)
        without an embedding."""

    def __call__(self, hidden: torch.Tensor, position_ids: torch.Tensor, attend_mask: Optional[torch.Tensor],
                 rotary: Optional[RotaryTables], kv_cache: Optional[KVCache]) -> StackOutput:
        """Runs the layers and the final norm on what :meth:`embed` returned."""


def embed_tokens(model: nn.Module, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """The model's embedding of ``tokens`` (all-reduced over the TP ranks), or ``tokens`` without an embedding."""
    if not model.pre_process:
        return tokens
    with comm_site("fwd embedding", model.tp):  # labels its all-reduce in the comm-wait breakdown
        return model.embedding(tokens, position_ids)


def run_layers(layers: Sequence[nn.Module], units: Sequence[Unit], hidden: torch.Tensor,
               attend_mask: Optional[torch.Tensor], rotary: Optional[RotaryTables] = None,
               has_collectives: bool = False, kernels: Optional[Kernels] = None) -> torch.Tensor:
    """The synchronous layer loop over ``units``, checkpointing the groups marked so (full recompute).

    With ``compile_blocks`` (``DOMINO_KERNELS=compiled``) each layer runs compiled whole, but only where a block
    holds no collective (``has_collectives`` False: TP=1 and CP=1). At TP>1 the synchronous block all-reduces
    inside its row-parallel linears, at CP>1 its attention exchanges keys and values, and Domino's stacks never
    call a whole layer (they run its parts around their async launches and waits), so a compiled graph never
    swallows a collective: those layers compile their segments between collectives instead
    (:mod:`domino.model.segments`). ``kernels``: the model's choice (given by ``parallelize``), else the device's."""
    kernels = resolve(kernels, hidden.device)
    # Per-document attention reads its documents on the host, selective recompute the generators' states: no
    # whole-block graph holds them.
    whole = (kernels.compile_blocks is not None and not has_collectives and not is_document_starts(attend_mask)
             and not any(checkpoints_attention(layer.attention) for layer in layers))
    for start, end, checkpointed in units:
        def group(h: torch.Tensor, start: int = start, end: int = end) -> torch.Tensor:
            for layer in layers[start:end]:
                if whole:
                    h = run_compiled_block(layer, kernels, h, attend_mask, rotary=rotary,
                                           tp_dropout=draws_tp_dropout(layer.attention))
                else:
                    h = layer(h, attend_mask, rotary=rotary)
            return h

        hidden = checkpoint(group, hidden) if checkpointed else group(hidden)
    return hidden


class SynchronousStack:
    """Plain tensor parallelism: the layers in order, each collective waited for where it is issued.

    Not an ``nn.Module``: it owns no parameters, it drives the model's own layers, so parameter names and
    checkpoints are the same whichever stack runs them. It also runs generation (KV cache), and the batches an
    overlapped stack cannot split.
    """

    sequence_parallel = False
    fallback = None

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.units: List[Unit] = [(0, len(model.layers), False)]

    def select(self, batch: int, kv_cache: Optional[KVCache]) -> "SynchronousStack":
        """Runs everything."""
        return self

    def embed(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The all-reduced embeddings ``[s, b, h]``."""
        return embed_tokens(self.model, tokens, position_ids)

    def __call__(self, hidden: torch.Tensor, position_ids: torch.Tensor, attend_mask: Optional[torch.Tensor],
                 rotary: Optional[RotaryTables], kv_cache: Optional[KVCache]) -> StackOutput:
        """``[s, b, h] -> [s, b, h]``: every layer, then the final norm; recompute groups only without a cache."""
        model = self.model
        if kv_cache is None:
            hidden = run_layers(model.layers, self.units, hidden, attend_mask, rotary,
                                model.tp.size > 1 or model.cp.size > 1, model.kernels)
        else:
            for layer in model.layers:
                hidden = layer(hidden, attend_mask, kv_cache, rotary)
        if not model.post_process:
            return StackOutput(hidden, None)
        # The output layer is column-parallel: its input gradient is all-reduced inside backward.
        return StackOutput(copy_to_tp_region(model.final_layernorm(hidden), model.tp), None)
