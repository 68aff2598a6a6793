"""The start-up lines of domino.train.preemption: a torch whose torchrun ignores the shutdown timeout, and a grace
period shorter than the estimated save."""

import torch

from domino.config import parse_config
from domino.train import preemption

ARGS = ["--preset", "tiny", "--mock-data", "--vocab-size", "256", "--exit-signal-handler", "--save", "/x"]


class _Engine:
    def __init__(self, parameters: int) -> None:
        self.module = torch.nn.Linear(parameters, 1, bias=False)


def test_the_installed_torchrun_reads_the_shutdown_timeout():
    # torch 2.13 distributed/launcher/api.py: LaunchConfig.shutdown_timeout (pytorch/pytorch#172596).
    assert torch.__version__.startswith("2.13") and preemption.torchrun_honours_shutdown_timeout()


def test_a_grace_period_shorter_than_the_estimated_save_is_said_in_one_line(monkeypatch):
    config = parse_config(ARGS)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv(preemption.GRACE_PERIOD_ENV, raising=False)
    assert preemption.grace_period_s() is None and preemption.startup_warnings(config, _Engine(10**6)) == []
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r")
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "162")
    assert preemption.grace_period_s() == 162 and preemption.startup_warnings(config, _Engine(10**6)) == []
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "1")  # 10^8 parameters: 1.6 GB at 500 MB/s, 3 s
    [line] = preemption.startup_warnings(config, _Engine(10**8))
    assert "a save is estimated at 3 s" in line and "longer than the 1 s" in line
    assert preemption.startup_warnings(parse_config(ARGS[:-2]), _Engine(10**8)) == []  # nothing to save


def test_a_torchrun_without_the_shutdown_timeout_is_said_in_one_line(monkeypatch):
    monkeypatch.delenv(preemption.GRACE_PERIOD_ENV, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r")
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "162")
    monkeypatch.setattr(preemption, "torchrun_honours_shutdown_timeout", lambda: False)  # a torch before #172596
    assert preemption.grace_period_s() == 30
    [line] = preemption.startup_warnings(parse_config(ARGS[:-2]), _Engine(10))
    assert "torchrun ignores TORCH_ELASTIC_SHUTDOWN_TIMEOUT=162" in line and "30 s after SIGTERM" in line


def test_under_the_signal_relay_the_time_left_is_the_grace_period_on_any_torch(monkeypatch):
    """The relay (domino.launch.signal_relay) hands SIGTERM to the ranks past torchrun and exports the period."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r")
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "162")
    monkeypatch.setenv(preemption.GRACE_PERIOD_ENV, "180")
    monkeypatch.setattr(preemption, "torchrun_honours_shutdown_timeout", lambda: False)  # a torch before #172596
    assert preemption.grace_period_s() == 180
    assert preemption.startup_warnings(parse_config(ARGS[:-2]), _Engine(10)) == []
    monkeypatch.setenv(preemption.GRACE_PERIOD_ENV, "1")
    [line] = preemption.startup_warnings(parse_config(ARGS), _Engine(10**8))
    assert "longer than the 1 s left after SIGTERM (DOMINO_GRACE_PERIOD_S)" in line
