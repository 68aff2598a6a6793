"""The bounds each numeric setting keeps whatever its source: the command line, a preset, a checkpoint's
``checkpoint.json`` or an imported Hugging Face ``config.json``. They are checked before anything is sized by them,
so an untrusted file ends in one line naming the field instead of a division by zero, a tensor of negative
size or a storage size that overflows.

The upper bounds of the model's sizes lie far above any published model (Llama 3.1 405B's ``config.json``,
meta-llama/Llama-3.1-405B on the Hugging Face hub: hidden 16384, 126 layers, 128 heads, intermediate 53248, a
128256-token vocabulary) and far below what overflows a tensor's size: a vocabulary of 2^31 ids at the widest
hidden size is 2^48 elements, and a token id must fit the int32 of a dataset's ``.bin``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, List, Optional

from domino.config.field_docs import flag_name

#: Lower bounds of the numeric settings (``None``, "not given", always passes).
MINIMUMS = {
    "model": {"num_layers": 1, "hidden_size": 1, "num_attention_heads": 1, "seq_length": 1,
              "make_vocab_size_divisible_by": 1, "vocab_size": 1, "ffn_hidden_size": 1, "max_position_embeddings": 1,
              "rotary_base": 1, "num_query_groups": 1},
    "parallel": {"tensor_model_parallel_size": 1},
    "train": {"global_batch_size": 1, "train_iters": 1, "train_samples": 1, "lr_decay_iters": 1,
              "lr_decay_samples": 1, "lr_warmup_samples": 0, "lr_wsd_decay_iters": 0, "lr_wsd_decay_samples": 0,
              "weight_decay": 0, "seed": 0, "exit_interval": 1},
}
#: Upper bounds of the model's sizes (see the module's docstring).
MAXIMUMS = {
    "model": {"num_layers": 1 << 12, "hidden_size": 1 << 17, "ffn_hidden_size": 1 << 20, "num_attention_heads": 1 << 12,
              "num_query_groups": 1 << 12, "seq_length": 1 << 24, "max_position_embeddings": 1 << 24,
              "vocab_size": (1 << 31) - 1},
}
#: Settings that must be greater than zero when given.
POSITIVE = {"model": ("init_method_std", "norm_epsilon"), "train": ("adam_eps", "initial_loss_scale"),
            "logging": ("peak_tflops",)}


def bound(group: str, name: str) -> tuple:
    """``(minimum, maximum)`` of a setting (``None`` where it has none); for readers of untrusted files."""
    return MINIMUMS.get(group, {}).get(name), MAXIMUMS.get(group, {}).get(name)


def _not_finite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def bound_problems(config) -> List[str]:
    """What breaks a bound in ``config`` (a :class:`DominoConfig`), one message each, naming the flag.

    A float that is not finite is its one problem (float() takes inf and nan; --lr inf trains on nan weights;
    inf passes a lower bound and nan fails it for no reason), so the bounds are compared only without one.
    """
    problems: List[str] = []
    for section in (getattr(config, group.name) for group in dataclasses.fields(config)):
        for f in dataclasses.fields(section) if dataclasses.is_dataclass(section) else ():
            value = getattr(section, f.name)
            if _not_finite(value):
                problems.append(f"{flag_name(f.name)} must be a finite number, got {value}")
    if problems:
        return problems
    for table, broken in ((MINIMUMS, lambda v, limit: v < limit), (MAXIMUMS, lambda v, limit: v > limit)):
        for group, limits in table.items():
            for name, limit in limits.items():
                value: Optional[Any] = getattr(getattr(config, group), name)
                if value is not None and broken(value, limit):
                    relation = ">=" if table is MINIMUMS else "<="
                    problems.append(f"{flag_name(name)} must be {relation} {limit}, got {value}")
    for group, names in POSITIVE.items():
        for name in names:
            value = getattr(getattr(config, group), name)
            if value is not None and not value > 0:
                problems.append(f"{flag_name(name)} must be > 0, got {value}")
    return problems
