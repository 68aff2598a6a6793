"""Turning a batch of samples into model inputs: tokens, labels, loss mask, document starts, positions.

``get_batch`` follows Megatron's ``pretrain_gpt.get_batch``: the first rank of each tensor-parallel
group reads the next batch and broadcasts it to the rest of its group (the others may pass a ``None``
iterator), then every rank derives the same masks. Without ``torch.distributed`` it simply reads.
"""

from __future__ import annotations

from typing import Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from domino.config import DataConfig
from domino.runtime.mesh import SINGLE, MeshGroup, collective_device


def get_ltor_masks_and_position_ids(data: torch.Tensor, eod_token: int, reset_position_ids: bool,
                                    reset_attention_mask: bool, eod_mask_loss: bool
                                    ) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Left-to-right masks and positions for ``data`` ``[batch, seq]`` (Megatron semantics, vectorised).

    Args:
        data: token ids.
        eod_token: the end-of-document id.
        reset_position_ids: positions restart at 0 after every end-of-document token.
        reset_attention_mask: tokens do not attend across an end-of-document token (to earlier documents).
        eod_mask_loss: no loss on end-of-document tokens.

    Returns:
        ``(attention_mask, loss_mask, position_ids)``: ``attention_mask`` is the *document starts* when
        ``reset_attention_mask``, int64 ``[batch, seq]``: the position where each token's document begins (a token
        attends to the keys from its document's start to itself; :mod:`domino.parallel.document_attention`), the
        ``[batch, seq]`` value from which :func:`dense_document_mask` builds Megatron's ``[batch, 1, seq, seq]``
        mask, never built here; else None, meaning plain causal (the model takes its fast causal path).
        ``loss_mask`` float ``[batch, seq]``; ``position_ids`` int64 ``[batch, seq]``.
    """
    batch, length = data.shape
    is_eod = data == eod_token
    loss_mask = torch.ones(data.shape, dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask.masked_fill_(is_eod, 0.0)  # not loss_mask[is_eod] = 0: boolean indexing counts on the host
    steps = torch.arange(length, dtype=torch.long, device=data.device)
    position_ids = steps.unsqueeze(0).expand(batch, length)
    attention_mask = None
    if reset_position_ids or reset_attention_mask:
        # A document starts after each end-of-document token: its start is the last such position up to t.
        after_eod = torch.zeros_like(is_eod)
        after_eod[:, 1:] = is_eod[:, :-1]
        starts = torch.cummax(torch.where(after_eod, steps, torch.zeros_like(steps)), dim=1).values
        if reset_position_ids:
            position_ids = steps - starts
        if reset_attention_mask:
            attention_mask = starts
    else:
        position_ids = position_ids.clone()
    return attention_mask, loss_mask, position_ids


def dense_document_mask(starts: torch.Tensor) -> torch.Tensor:
    """Megatron's ``[batch, 1, seq, seq]`` bool mask (True = masked) of document ``starts`` ``[batch, seq]``: a key
    is hidden when it follows the query or precedes the query's document. The ``s^2`` reference, for tests and
    for callers that pass a dense mask."""
    steps = torch.arange(starts.shape[1], device=starts.device)
    return ((steps.view(1, 1, -1) > steps.view(1, -1, 1)) | (steps.view(1, 1, -1) < starts.unsqueeze(-1))).unsqueeze(1)


def _check_shape(text: torch.Tensor, shape: Optional[Tuple[int, int]]) -> None:
    if shape is not None and tuple(text.shape) != tuple(shape):
        raise ValueError(f"get_batch: the data iterator gave a batch of shape {tuple(text.shape)}, expected "
                         f"{tuple(shape)} (micro-batch size, sequence length + 1)")


def _to_device(text: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``text`` as int64 on ``device``; from pinned memory the copy is queued without waiting (non_blocking)."""
    return text.to(device=device, dtype=torch.long, non_blocking=True)


def broadcast_text(text: Optional[torch.Tensor], tp: MeshGroup, shape: Optional[Tuple[int, int]] = None
                   ) -> torch.Tensor:
    """``text`` from the first rank of ``tp`` (the source) on every rank of the group (int64, 2-D).

    Args:
        text: the batch on the source rank (None on the others).
        tp: the tensor-parallel group whose first rank read the batch.
        shape: the batch shape every rank expects; then only the tokens are broadcast. Without it the
            shape is broadcast first, and the receivers read it on the host (a device sync under NCCL).
    """
    group = tp.process_group
    if tp.size == 1:
        if text is None:
            raise ValueError("get_batch needs a data iterator on this rank")
        _check_shape(text, shape)
        return text.long()
    device = collective_device(group)
    source = tp.first_rank
    if dist.get_rank() == source:
        if text is None:
            raise ValueError("the first rank of each tensor-parallel group needs a data iterator")
        _check_shape(text, shape)
        text = _to_device(text, device).contiguous()
    if shape is None:
        sent = torch.zeros(2, dtype=torch.long, device=device)
        if dist.get_rank() == source:
            sent.copy_(torch.tensor(text.shape, dtype=torch.long))
        dist.broadcast(sent, source, group=group)
        shape = tuple(sent.tolist())
    if dist.get_rank() != source:
        text = torch.empty(tuple(shape), dtype=torch.long, device=device)
    dist.broadcast(text, source, group=group)
    return text


def get_batch(data_iterator: Optional[Iterator], data_config: DataConfig, eod_token: int,
              shape: Optional[Tuple[int, int]] = None, tp: MeshGroup = SINGLE):
    """The next batch as ``(tokens, labels, loss_mask, attention_mask, position_ids)`` (``attention_mask``: the
    document starts under ``--reset-attention-mask``, else None; :func:`get_ltor_masks_and_position_ids`).

    Tensor-parallel rank 0 reads ``next(data_iterator)`` (a dict with ``"text"`` ``[b, s + 1]``) and
    broadcasts it to its group; other TP ranks may pass ``None``. ``tokens = text[:, :-1]``,
    ``labels = text[:, 1:]``. Tensors are on the current CUDA device when CUDA is available, else CPU.
    Mask flags come from ``data_config`` (``reset_position_ids``, ``reset_attention_mask``, ``eod_mask_loss``).
    With ``shape`` (training: ``[micro-batch, seq + 1]``) no shape is broadcast and a batch of another shape
    is an error; reading the batch never waits on the device. ``tp``: the tensor-parallel group the batch is
    broadcast over (one process by default).
    """
    reads = tp.rank == 0
    text = None
    if reads:
        if data_iterator is None:
            raise ValueError("tensor-parallel rank 0 needs a data iterator")
        text = torch.as_tensor(next(data_iterator)["text"])
    text = broadcast_text(text, tp, shape)
    if torch.cuda.is_available():
        text = _to_device(text, torch.device("cuda", torch.cuda.current_device()))
    tokens = text[:, :-1].contiguous()
    labels = text[:, 1:].contiguous()
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens, eod_token, data_config.reset_position_ids, data_config.reset_attention_mask,
        data_config.eod_mask_loss)
    return tokens, labels, loss_mask, attention_mask, position_ids
