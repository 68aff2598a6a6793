"""TensorBoard events carry Megatron-LM's tag names (training_log / evaluate_and_print_results in
megatron/training/training.py, NVIDIA/Megatron-LM core_r0.11.0, commit 7c00175e6b24b3cd835d21a9d287c35a07e275b3)."""

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from domino.train.metrics import MetricsWriter

TRAIN = {"iteration": 10, "consumed_samples": 80, "batch_size": 8, "lm_loss": 5.5, "lr": 1e-4, "grad_norm": 1.25,
         "loss_scale": 65536.0, "skipped_iterations": 0, "iteration_time_s": 0.5, "tokens_per_s": 1000.0,
         "tflops_per_device": 0.1, "mfu": None, "memory_gb": 0.4, "eta_s": 3.0,
         "goodput": 0.75, "goodput_s": {"wall_s": 40.0, "productive_s": 30.0, "startup_s": 10.0}}


def _scalars(directory):
    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.parametrize("log_timers", [False, True])
def test_training_and_validation_tags(tmp_path, log_timers):
    writer = MetricsWriter(None, str(tmp_path), enabled=True, log_timers=log_timers)
    writer.write(TRAIN)
    writer.write({"eval": "valid", "iteration": 10, "consumed_samples": 80, "lm_loss": 5.0, "ppl": 148.4})
    writer.write({"eval": "test", "iteration": 10, "consumed_samples": 80, "lm_loss": 5.1, "ppl": 164.0})
    writer.close()
    scalars = _scalars(tmp_path)
    for tag, value in (("lm loss", 5.5), ("learning-rate", 1e-4), ("grad-norm", 1.25), ("loss-scale", 65536.0),
                       ("batch-size", 8), ("lm loss validation", 5.0), ("lm loss validation ppl", 148.4)):
        assert scalars[tag] == [(10, pytest.approx(value))], tag
        assert scalars[f"{tag} vs samples"] == [(80, pytest.approx(value))], tag
    assert scalars["lm loss test"] == [(10, pytest.approx(5.1))]
    assert ("iteration-time" in scalars) is log_timers and ("throughput" in scalars) is log_timers
    if log_timers:
        assert scalars["iteration-time"] == [(10, pytest.approx(0.5))]
    assert "mfu" not in scalars  # None is not written
    # The run's goodput (domino.goodput), under the names MLflow gets too (tracking_scalars), no samples twin.
    assert scalars["goodput/goodput"] == [(10, 0.75)] and scalars["goodput/productive_s"] == [(10, 30.0)]
    assert scalars["goodput/wall_s"] == [(10, 40.0)] and "goodput/goodput vs samples" not in scalars
    assert not [tag for tag in scalars if tag.startswith("train/")]
