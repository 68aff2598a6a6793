"""The learning-rate schedule equals Megatron-LM's OptimizerParamScheduler, step for step.

``MegatronScheduler`` below transcribes ``get_lr``/``step`` of ``megatron/core/optimizer_param_scheduler.py`` and
the step counts of ``get_optimizer_param_scheduler`` in ``megatron/training/training.py`` (NVIDIA/Megatron-LM
core_r0.11.0, commit 7c00175e6b24b3cd835d21a9d287c35a07e275b3), driven as Megatron's training loop drives it:
``step(0)`` at construction, then ``step(increment=global_batch_size)`` after every iteration.
"""

import math

import pytest

from domino.config import TrainConfig
from domino.train.schedules import LearningRateSchedule


class MegatronScheduler:
    """Transcription of Megatron's OptimizerParamScheduler (learning-rate part), counted in samples."""

    def __init__(self, init_lr, max_lr, min_lr, lr_warmup_steps, lr_decay_steps, lr_decay_style,
                 wsd_decay_steps=None, lr_wsd_decay_style=None):
        self.init_lr, self.max_lr, self.min_lr = init_lr, float(max_lr), min_lr
        self.lr_warmup_steps, self.lr_decay_steps = lr_warmup_steps, lr_decay_steps
        self.wsd_decay_steps, self.lr_wsd_decay_style = wsd_decay_steps, lr_wsd_decay_style
        self.lr_decay_style = lr_decay_style
        assert self.lr_decay_steps > 0 and self.lr_warmup_steps < self.lr_decay_steps
        self.num_steps = 0
        self.lr = None
        self.step(0)

    def get_lr(self):
        max_lr, min_lr = self.max_lr, self.min_lr
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + ((max_lr - self.init_lr) * float(self.num_steps) / float(self.lr_warmup_steps))
        if self.lr_decay_style == 'constant':
            return max_lr
        if self.num_steps > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == 'inverse-square-root':
            warmup_steps = max(self.lr_warmup_steps, 1)
            num_steps = max(self.num_steps, 1)
            lr = max_lr * warmup_steps ** 0.5 / (num_steps ** 0.5)
            return max(min_lr, lr)
        num_steps_ = self.num_steps - self.lr_warmup_steps
        decay_steps_ = self.lr_decay_steps - self.lr_warmup_steps
        decay_ratio = float(num_steps_) / float(decay_steps_)
        assert 0.0 <= decay_ratio <= 1.0
        delta_lr = max_lr - min_lr
        if self.lr_decay_style == 'linear':
            coeff = 1.0 - decay_ratio
        elif self.lr_decay_style == 'cosine':
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        elif self.lr_decay_style == 'WSD':
            wsd_anneal_start_ = self.lr_decay_steps - self.wsd_decay_steps
            if self.num_steps <= wsd_anneal_start_:
                coeff = 1.0
            else:
                wsd_steps = self.num_steps - wsd_anneal_start_
                wsd_decay_ratio = float(wsd_steps) / float(self.wsd_decay_steps)
                if self.lr_wsd_decay_style == "linear":
                    coeff = 1.0 - wsd_decay_ratio
                elif self.lr_wsd_decay_style == "cosine":
                    coeff = 0.5 * (math.cos(math.pi * wsd_decay_ratio) + 1.0)
                elif self.lr_wsd_decay_style == "exponential":
                    coeff = (2.0 * math.pow(0.5, wsd_decay_ratio)) - 1.0
        else:
            raise Exception(f'{self.lr_decay_style} decay style is not supported.')
        return min_lr + coeff * delta_lr

    def step(self, increment):
        self.num_steps += increment
        self.lr = self.get_lr()


def megatron_lrs(train: TrainConfig, train_iters: int, gbs: int):
    """The rate of each of Megatron's optimizer steps (iteration-based run), as get_optimizer_param_scheduler sets up."""
    lr_decay_iters = train.lr_decay_iters or train_iters
    lr_decay_steps = lr_decay_iters * gbs
    wsd_decay_steps = train.lr_wsd_decay_iters * gbs if train.lr_wsd_decay_iters is not None else None
    if train.lr_warmup_fraction is not None:
        lr_warmup_steps = train.lr_warmup_fraction * lr_decay_steps
    else:
        lr_warmup_steps = train.lr_warmup_iters * gbs
    scheduler = MegatronScheduler(train.lr_warmup_init, train.lr, train.min_lr, lr_warmup_steps, lr_decay_steps,
                                  train.lr_decay_style, wsd_decay_steps, train.lr_wsd_decay_style)
    rates = []
    for _ in range(train_iters):
        rates.append(scheduler.lr)  # the rate the optimizer step of this iteration uses
        scheduler.step(increment=gbs)
    return rates


CASES = {
    "warmup-cosine": dict(lr_warmup_iters=10, lr_decay_style="cosine"),
    "warmup-fraction-cosine": dict(lr_warmup_fraction=0.03, lr_decay_iters=90, lr_decay_style="cosine"),
    "warmup-linear": dict(lr_warmup_iters=7, lr_decay_style="linear", lr_decay_iters=100),
    "linear-no-warmup": dict(lr_decay_style="linear"),
    "warmup-constant": dict(lr_warmup_iters=4, lr_decay_style="constant"),
    "inverse-square-root": dict(lr_warmup_iters=5, lr_decay_style="inverse-square-root"),
    "warmup-init": dict(lr_warmup_iters=6, lr_warmup_init=0.05, lr_decay_style="cosine"),
    "WSD-exponential": dict(lr_warmup_iters=5, lr_decay_style="WSD", lr_wsd_decay_iters=30),
    "WSD-linear": dict(lr_warmup_iters=5, lr_decay_style="WSD", lr_wsd_decay_iters=30, lr_wsd_decay_style="linear"),
    "WSD-cosine": dict(lr_warmup_fraction=0.1, lr_decay_style="WSD", lr_wsd_decay_iters=20, lr_wsd_decay_style="cosine"),
}


@pytest.mark.parametrize("gbs", [1, 8])
@pytest.mark.parametrize("case", list(CASES))
def test_every_step_equals_megatron(case, gbs):
    train = TrainConfig(lr=1.0, min_lr=0.1, train_iters=110, **CASES[case])
    schedule = LearningRateSchedule.from_config(train, train_iters=110, global_batch_size=gbs)
    ours = [schedule.lr_at(i) for i in range(110)]
    assert ours == pytest.approx(megatron_lrs(train, 110, gbs), rel=1e-12, abs=1e-15)


def test_first_warmup_step_runs_at_the_initial_rate():
    s = LearningRateSchedule.from_config(TrainConfig(lr=1.0, lr_warmup_iters=10), train_iters=100)
    assert [s.lr_at(i) for i in range(3)] == pytest.approx([0.0, 0.1, 0.2])
    assert s.lr_at(10) == pytest.approx(1.0)


def test_megatron_default_style_is_linear():
    s = LearningRateSchedule.from_config(TrainConfig(lr=1.0, min_lr=0.0), train_iters=100)
    assert s.style == "linear" and s.lr_at(50) == pytest.approx(0.5) and s.lr_at(100) == pytest.approx(0.0)


def test_sample_based_lengths():
    train = TrainConfig(lr=1.0, min_lr=0.0, train_samples=800, lr_warmup_samples=80, lr_decay_samples=400)
    s = LearningRateSchedule.from_config(train, train_iters=100, global_batch_size=8)
    assert (s.warmup_iters, s.decay_iters) == (10, 50)
    assert s.lr_at(5) == pytest.approx(0.5) and s.lr_at(30) == pytest.approx(0.5) and s.lr_at(60) == 0.0


def test_warmup_longer_than_the_run_is_shortened():
    s = LearningRateSchedule.from_config(TrainConfig(lr=1.0, lr_warmup_iters=200), train_iters=110)
    assert s.warmup_iters == 110 and s.lr_at(55) == pytest.approx(0.5) and s.lr_at(110) == pytest.approx(1.0)
