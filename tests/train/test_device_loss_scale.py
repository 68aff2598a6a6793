"""fp16's dynamic loss scale updated on the device (domino.optim.device_loss_scale) follows DeepSpeed 0.19.8's
``DynamicLossScaler.update_scale`` (``deepspeed/runtime/fp16/loss_scaler.py``) step for step, for both hysteresis
modes and at the minimum scale, and its fields survive the checkpoint code's save-by-name and restore-by-name."""

import pickle
import random
from unittest import mock

import pytest
import torch

from domino.optim.state import loss_scaler_fields


def _scaler(consecutive_hysteresis):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    return DynamicLossScaler(init_scale=2.0**4, scale_window=3, min_scale=2.0, delayed_shift=2,
                             consecutive_hysteresis=consecutive_hysteresis, raise_error_at_min_scale=False)


@pytest.mark.parametrize("consecutive_hysteresis", [False, True])
def test_the_device_update_follows_deepspeeds_and_restores_by_name(consecutive_hysteresis):
    from domino.optim.deepspeed_subclasses import DeviceLossScaler

    theirs, ours = _scaler(consecutive_hysteresis), DeviceLossScaler.like(_scaler(consecutive_hysteresis), "cpu")
    assert isinstance(ours.cur_scale, torch.Tensor)
    rng = random.Random(5)
    # Runs of overflows (down to the minimum scale) and of clean steps (long enough to grow).
    pattern = [rng.random() < 0.4 for _ in range(60)] + [True] * 6 + [False] * 8
    seen = set()
    with mock.patch("deepspeed.runtime.fp16.loss_scaler.dist.get_rank", lambda: 0):  # DeepSpeed's log lines
        for overflow in pattern:
            theirs.update_scale(overflow)
            ours.update_scale(torch.tensor(overflow))
            fields = loss_scaler_fields(ours)
            assert {k: fields[k] for k in ("cur_scale", "cur_hysteresis", "last_overflow_iter", "cur_iter")} == {
                k: getattr(theirs, k) for k in ("cur_scale", "cur_hysteresis", "last_overflow_iter", "cur_iter")}
            seen.add(theirs.cur_scale)
    assert {2.0, 16.0} <= seen and len(seen) >= 3  # the minimum, a halving and a growth all happened
    restored = DeviceLossScaler.like(_scaler(consecutive_hysteresis), "cpu")
    scale = restored.cur_scale
    for key, value in loss_scaler_fields(ours).items():  # what domino/checkpoint does on load
        setattr(restored, key, value)
    assert restored.cur_scale is scale and loss_scaler_fields(restored) == loss_scaler_fields(ours)
    copied = pickle.loads(pickle.dumps(ours))  # DeepSpeed's own state_dict holds the scaler object
    assert type(copied) is type(ours) and loss_scaler_fields(copied) == loss_scaler_fields(ours)
