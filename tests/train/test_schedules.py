"""The learning-rate schedule: warm-up, then constant/linear/cosine decay to the floor."""

import math

import pytest

from domino.config import TrainConfig
from domino.train.schedules import LearningRateSchedule


def _schedule(**kw):
    train = TrainConfig(lr=1.0, min_lr=0.1, **kw)
    return LearningRateSchedule.from_config(train, train_iters=110)


def test_linear_warmup_then_cosine():
    s = _schedule(lr_warmup_iters=10, lr_decay_style="cosine")
    assert [s.lr_at(i) for i in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    assert s.lr_at(9) == pytest.approx(1.0)
    assert s.lr_at(10) == pytest.approx(1.0)
    assert s.lr_at(60) == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi * 0.5) + 1))
    assert s.lr_at(110) == pytest.approx(0.1) and s.lr_at(500) == pytest.approx(0.1)


def test_linear_and_constant():
    lin = _schedule(lr_decay_style="linear")
    assert lin.lr_at(0) == pytest.approx(1.0) and lin.lr_at(55) == pytest.approx(0.55)
    const = _schedule(lr_decay_style="constant", lr_warmup_iters=4)
    assert const.lr_at(1) == pytest.approx(0.5) and const.lr_at(100) == 1.0


def test_warmup_fraction_and_decay_iters():
    s = _schedule(lr_warmup_fraction=0.1, lr_decay_iters=50)
    assert s.warmup_iters == 5 and s.decay_iters == 50 and s.lr_at(50) == pytest.approx(0.1)


def test_warmup_longer_than_the_run_is_shortened():
    s = _schedule(lr_warmup_iters=200)
    assert s.warmup_iters == 110 and s.lr_at(54) == pytest.approx(0.5) and s.lr_at(109) == pytest.approx(1.0)
