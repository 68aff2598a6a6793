"""State that belongs to one rank and is read back by the same rank: RNG streams (format 1's optimizer state
dict: :mod:`domino.optim.state_dict`).

Both are saved as plain tensors, numbers and strings, so they load with ``torch.load(weights_only=True)``
(nothing arbitrary is unpickled). RNG streams only mean something on the layout that drew them; the
optimizer state by parameter name (:mod:`domino.optim.state`) replaced format 1's per-rank
files, which remain for checkpoints written before (DeepSpeed's fp16 optimizer without ZeRO, which runs no
longer build) and for an optimizer without a state by name.
"""

from __future__ import annotations

from typing import Any, Dict

from domino.parallel import random as tp_random


def rng_snapshot() -> Dict[str, Any]:
    """All RNG states with numpy's array turned into a tensor (loadable with ``weights_only=True``)."""
    import torch

    snapshot = dict(tp_random.get_rng_state())
    kind, keys, pos, has_gauss, cached = snapshot.pop("numpy")
    snapshot["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached)
    return snapshot


def restore_rng(snapshot: Dict[str, Any]) -> None:
    """Restores what :func:`rng_snapshot` saved."""
    kind, keys, pos, has_gauss, cached = snapshot["numpy"]
    snapshot["numpy"] = (kind, keys.numpy().astype("uint32"), pos, has_gauss, cached)
    tp_random.set_rng_state(snapshot)
