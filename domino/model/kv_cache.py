"""Keys and values of past tokens, so generation feeds one new token per step.

Each layer appends the new tokens' keys/values (this rank's heads, ``[b, heads/tp, n, head_dim]``) and
attends over everything cached. The cache starts empty; ``GPTModel.forward(..., kv_cache=cache)`` reads
``cache.length`` to place the new tokens (position ids and the causal mask start there) and the cache grows
by the number of tokens fed.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch


class KVCache:
    """Per-layer key/value tensors and the number of tokens they hold.

    Args:
        num_layers: number of transformer layers of the model it serves.
        max_length: optional limit (the model's position-embedding count); feeding past it raises.
    """

    def __init__(self, num_layers: int, max_length: Optional[int] = None) -> None:
        self.num_layers = num_layers
        self.max_length = max_length
        self.keys: List[Optional[torch.Tensor]] = [None] * num_layers
        self.values: List[Optional[torch.Tensor]] = [None] * num_layers

    @property
    def length(self) -> int:
        """Tokens cached so far (read before a forward pass: layer 0 grows first)."""
        return 0 if self.keys[-1] is None else self.keys[-1].shape[2]

    def check_room(self, new_tokens: int) -> None:
        """Raises ValueError when ``new_tokens`` more would exceed ``max_length``."""
        if self.max_length is not None and self.length + new_tokens > self.max_length:
            raise ValueError(f"KV cache holds {self.length} tokens; {new_tokens} more exceed the model's "
                             f"{self.max_length} positions")

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Appends ``[b, h, n, d]`` key/value of the new tokens to ``layer``; returns all cached ones."""
        if self.keys[layer] is not None:
            key = torch.cat([self.keys[layer], key], dim=2)
            value = torch.cat([self.values[layer], value], dim=2)
        self.keys[layer], self.values[layer] = key, value
        return key, value

    def reorder(self, batch_indices: torch.Tensor) -> None:
        """Keeps (and reorders) the sequences ``batch_indices`` along the batch dimension (beam search)."""
        for i in range(self.num_layers):
            if self.keys[i] is not None:
                self.keys[i] = self.keys[i].index_select(0, batch_indices)
                self.values[i] = self.values[i].index_select(0, batch_indices)

    def reset(self) -> None:
        """Empties the cache."""
        self.keys = [None] * self.num_layers
        self.values = [None] * self.num_layers
