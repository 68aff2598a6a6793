"""The optimizer's own state dict, per rank: checkpoint format 1's optimizer files.

Saved as plain tensors, numbers and strings, so they load with ``torch.load(weights_only=True)`` (nothing
arbitrary is unpickled). The state by parameter name (:mod:`domino.optim.state`) replaced these files; they
remain for checkpoints written before, and for an optimizer without a state by name (none that a run builds).
"""

from __future__ import annotations

import enum
from typing import Any, Dict

from domino.optim.state import loss_scaler_fields
from domino.runtime.mesh import MeshGroup


def optimizer_snapshot(training) -> Dict[str, Any]:
    """The optimizer's state dict reduced to tensors, numbers, strings and containers of them.

    DeepSpeed's ZeRO state holds a loss-scaler object, an enum and slice-mapping objects; keeping them
    out lets loading use ``weights_only=True`` (no arbitrary unpickling).
    """
    sd = dict(training.inner.state_dict())
    scaler = sd.pop("loss_scaler", None)
    if scaler is not None:
        sd["loss_scaler_fields"] = loss_scaler_fields(scaler)
    sd.pop("param_slice_mappings", None)
    for key, value in list(sd.items()):
        if isinstance(value, enum.Enum):
            sd[key] = value.value
    return sd


def restore_optimizer(training, sd: Dict[str, Any], dp: MeshGroup) -> None:
    """Loads what :func:`optimizer_snapshot` saved, on the layout that saved it (``dp``: the ranks holding this
    rank's weights, data x context parallel, over which the state is partitioned)."""
    optimizer = training.inner
    live_scaler = getattr(optimizer, "loss_scaler", None)
    fields = sd.pop("loss_scaler_fields", None)
    if live_scaler is not None:
        for key, value in (fields or {}).items():
            setattr(live_scaler, key, value)
        sd["loss_scaler"] = live_scaler
    # ZeRO's and the BF16 optimizer's states (deepspeed 0.19.8: runtime/zero/stage_1_and_2.py,
    # runtime/bf16_optimizer.py) hold this DP rank's partition of the fp32 master weights; both load from a
    # per-DP-rank list and must take those fp32 weights (load_from_fp32_weights) or resuming would restart from
    # the rounded bf16/fp16 weights.
    partitioned = "zero_stage" in sd or "single_partition_of_fp32_groups" in sd
    if "zero_stage" in sd:
        from deepspeed.runtime.zero.config import ZeroStageEnum

        sd["zero_stage"] = ZeroStageEnum(sd["zero_stage"])
    if partitioned:
        sd["param_slice_mappings"] = getattr(optimizer, "_param_slice_mappings", None)
        state_list = [None] * dp.size
        state_list[dp.rank] = sd
        optimizer.load_state_dict(state_list, load_optimizer_states=True, load_from_fp32_weights=True)
    else:
        optimizer.load_state_dict(sd)
