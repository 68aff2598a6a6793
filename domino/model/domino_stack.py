"""The Domino layer stack: the same transformer layers, run on batch chunks so communication overlaps.

The micro-batch is split along the batch dimension into N chunks. Per layer, each chunk runs two stages:

* attention stage: finish the chunk's pending MLP all-reduce (residual add), LN1, QKV, attention, output
  projection (partial sum), *launch* its all-reduce;
* MLP stage: wait for that all-reduce, residual add, LN2, fc1, GeLU, fc2 (partial sum), *launch* its
  all-reduce (which stays in flight into the next layer's attention stage).

Stages run as ``attn(0..N-1), mlp(0..N-1)`` per layer, so each all-reduce of chunk ``c`` is hidden behind
the computation of the other chunks (for N=2 this is the reference schedule: AR(a0) behind chunk 1's
attention, AR(a1) behind chunk 0's MLP, AR(m0) behind chunk 1's MLP, AR(m1) behind the next layer's chunk-0
attention). Every rank runs the same Python, so collectives are issued (and waited) in the same order on
all ranks. In backward, the forward all-reduces are identities and the column-parallel input gradients are
all-reduced asynchronously (:mod:`domino.model.domino_ops`).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from domino.model.domino_ops import column_parallel_async
from domino.model.transformer import TransformerLayer, bias_dropout_add
from domino.parallel.collectives import all_reduce_async


class _Pending:
    """A chunk's row-parallel partial sum whose all-reduce is in flight, plus what to add once it lands."""

    __slots__ = ("partial", "bias", "handle")

    def __init__(self, partial: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        self.partial = partial
        self.bias = bias
        # Async launch: waited in finish(), after the other chunks' next stage has been computed.
        self.handle = all_reduce_async(partial)

    def finish(self, residual: torch.Tensor, p: float, training: bool) -> torch.Tensor:
        # Wait for the all-reduce launched in __init__: its sum is read right here.
        self.handle.wait()
        return bias_dropout_add(self.partial, self.bias, residual, p, training)


def _split_mask(mask: Optional[torch.Tensor], sizes: List[int]) -> List[Optional[torch.Tensor]]:
    if mask is None or mask.shape[0] == 1:
        return [mask] * len(sizes)
    return list(torch.split(mask, sizes, dim=0))


class DominoLayerStack:
    """Runs ``layers`` (and the final LayerNorm) on the overlapped N-chunk schedule.

    Not an ``nn.Module``: it owns no parameters, it only drives the model's own layers, so parameter names
    and checkpoints are the same with and without Domino.

    Args:
        layers: the model's transformer layers.
        chunks: number of batch chunks (>= 1; 1 still runs the async code path, with nothing to overlap).
    """

    def __init__(self, layers: Sequence[TransformerLayer], chunks: int) -> None:
        if chunks < 1:
            raise ValueError(f"--domino-chunks must be >= 1, got {chunks}")
        self.layers = layers
        self.chunks = chunks

    def __call__(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor],
                 final_layernorm: Optional[torch.nn.Module]) -> torch.Tensor:
        """``[b, s, h]`` embeddings -> ``[b, s, h]`` (after the final LayerNorm when one is given)."""
        b = hidden.shape[0]
        if b < self.chunks:
            raise ValueError(f"micro-batch size {b} is smaller than --domino-chunks {self.chunks}")
        sizes = [len(idx) for idx in torch.arange(b).tensor_split(self.chunks)]
        h = list(torch.split(hidden, sizes, dim=0))
        masks = _split_mask(attention_mask, sizes)
        pending: List[Optional[_Pending]] = [None] * self.chunks
        for layer in self.layers:
            p, training = layer.hidden_dropout, layer.training
            attention, mlp = layer.attention, layer.mlp
            for c in range(self.chunks):  # attention stage of every chunk
                if pending[c] is not None:
                    h[c] = pending[c].finish(h[c], p, training)
                mixed = column_parallel_async(layer.input_layernorm(h[c]), attention.query_key_value)
                ctx = attention.context(mixed, masks[c])
                pending[c] = _Pending(attention.dense.partial(ctx), attention.dense.bias)
            for c in range(self.chunks):  # MLP stage of every chunk
                h[c] = pending[c].finish(h[c], p, training)
                inner = F.gelu(column_parallel_async(layer.post_attention_layernorm(h[c]), mlp.dense_h_to_4h))
                pending[c] = _Pending(mlp.dense_4h_to_h.partial(inner), mlp.dense_4h_to_h.bias)
        out = []
        for c in range(self.chunks):
            if pending[c] is not None:
                h[c] = pending[c].finish(h[c], self.layers[-1].hidden_dropout, self.layers[-1].training)
            out.append(final_layernorm(h[c]) if final_layernorm is not None else h[c])
        return torch.cat(out, dim=0)
