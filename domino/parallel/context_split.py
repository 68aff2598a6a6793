"""Context parallelism's data side: which tokens a rank holds, its slice of a batch, and the loss over all of them.

A sequence of ``S`` tokens is cut into ``2N`` chunks of ``S / 2N`` for a context-parallel group of ``N``; rank ``r``
holds chunks ``r`` and ``2N - 1 - r``, in that order (Megatron-LM's causal load balancing:
``get_batch_on_this_cp_rank`` in ``megatron/training/utils.py``, d98e8a64). Under a causal mask a late chunk
attends to many keys and an early one to few; pairing them gives every rank the same work. For ``N = 2``::

    chunk     0    1    2    3          (S / 4 tokens each, positions ascending)
    rank      0    1    1    0

Every rank of the group reads the same samples (they share a data-parallel replica) and keeps its chunks of the
tokens, labels, loss mask and positions; learned position embeddings and RoPE then see each token's true
position. The loss is a mean over every token of the sequence: each rank divides its masked sum by the token
count of the whole group, so the ranks' losses add up to the mean and their weight gradients sum to its gradient
(DeepSpeed sums gradients over the sequence-parallel ranks and averages over the data-parallel replicas:
``_reduce_non_expert_gradients`` in deepspeed 0.19.8 ``runtime/engine.py`` divides by
``seq_dp_world_size / sequence_parallel_size``).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist

from domino.runtime.mesh import SINGLE, MeshGroup


def local_token_indices(seq_length: int, cp: MeshGroup, device: Optional[torch.device] = None) -> torch.Tensor:
    """The positions (0-based, ascending) of the ``seq_length / cp.size`` tokens this rank of ``cp`` holds."""
    n = cp.size
    if n == 1:
        return torch.arange(seq_length, device=device)
    if seq_length % (2 * n):
        raise ValueError(f"a sequence of {seq_length} tokens does not cut into {2 * n} equal chunks")
    chunk = seq_length // (2 * n)
    first, second = cp.rank * chunk, (2 * n - 1 - cp.rank) * chunk
    return torch.cat((torch.arange(first, first + chunk, device=device),
                      torch.arange(second, second + chunk, device=device)))


def split_batch(batch: Dict[str, Optional[torch.Tensor]], cp: MeshGroup) -> Dict[str, Optional[torch.Tensor]]:
    """This rank's chunks of a ``[b, s]`` batch's tensors (tokens, labels, loss mask, position ids).

    Positions are filled in as ``0 .. s - 1`` where the batch has none, so the chunks keep their true positions.
    The batch is returned as it is at CP 1. Document starts (``--reset-attention-mask``'s ``attention_mask``,
    ``[b, s]``) are cut as the tokens are: each rank holds its chunks' (their values stay positions in the whole
    sequence); a dense ``[b, 1, s, s]`` mask stays whole, being of the whole sequence.
    """
    if cp.size == 1:
        return batch
    tokens = batch["tokens"]
    seq = tokens.shape[1]
    index = local_token_indices(seq, cp, tokens.device)
    out = dict(batch)
    names = ("tokens", "labels", "loss_mask", "position_ids")
    mask = out.get("attention_mask")
    if mask is not None and mask.dtype != torch.bool:  # document starts: per token
        names += ("attention_mask",)
    for name in names:
        if out.get(name) is not None:
            out[name] = out[name].index_select(1, index)
    if out.get("position_ids") is None:  # the default positions 0 .. s - 1, at this rank's tokens: the indices
        out["position_ids"] = index.unsqueeze(0)
    return out


def token_count(loss_mask: torch.Tensor, cp: MeshGroup) -> torch.Tensor:
    """The number of counted tokens of the whole sequences this rank's chunks belong to (at least 1), as a device
    tensor: summed over ``cp`` (an all-reduce on the group's device, no host read)."""
    count = loss_mask.float().sum()
    if cp.size > 1:
        dist.all_reduce(count, group=cp.process_group)
    return count.clamp(min=1.0)


def masked_mean_loss(per_token_losses: torch.Tensor, loss_mask: torch.Tensor, cp: MeshGroup = SINGLE
                     ) -> torch.Tensor:
    """The mean of the per-token losses where ``loss_mask`` is 1, in fp32; under context parallelism this rank's
    share of it (its masked sum over the count of the whole sequences held by ``cp``: the shares add up to the
    mean, and so do their gradients). The loss of a micro-batch, with or without pipeline stages."""
    mask = loss_mask.reshape(-1).float()
    return torch.sum(per_token_losses.float().reshape(-1) * mask) / token_count(mask, cp)


def sum_over_context(value: torch.Tensor, cp: MeshGroup) -> torch.Tensor:
    """A detached scalar summed over ``cp`` (the whole sequence's loss from each rank's share, for logging)."""
    total = value.detach().clone().float().reshape(1)
    if cp.size > 1:
        dist.all_reduce(total, group=cp.process_group)
    return total[0]
