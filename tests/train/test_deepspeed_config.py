"""--deepspeed-config FILE: its keys are merged into the DeepSpeed config domino derives from the flags
(nested objects key by key, so an override of one ZeRO setting keeps the stage); bad files are named."""

import json
import os

import pytest

from domino.config import ConfigError, parse_config
from domino.optim.deepspeed_config import deepspeed_config


def _config(tmp_path, overrides, *flags):
    path = tmp_path / "ds.json"
    path.write_text(overrides if isinstance(overrides, str) else json.dumps(overrides))
    return parse_config(["--preset", "tiny", "--zero-stage", "2", "--clip-grad", "0.5", *flags,
                         "--deepspeed-config", str(path)])


def test_overrides_merge_key_by_key_into_the_derived_config(tmp_path):
    derived = deepspeed_config(parse_config(["--preset", "tiny", "--zero-stage", "2", "--clip-grad", "0.5"]), dp=1)
    merged = deepspeed_config(_config(tmp_path, {"zero_optimization": {"overlap_comm": False, "reduce_bucket_size": 1e6},
                                                 "gradient_clipping": 2.0, "flops_profiler": {"enabled": False}}), dp=1)
    assert merged["zero_optimization"] == {**derived["zero_optimization"], "overlap_comm": False,
                                           "reduce_bucket_size": 1e6}
    assert merged["zero_optimization"]["stage"] == 2  # kept: only the named keys changed
    assert merged["gradient_clipping"] == 2.0 and derived["gradient_clipping"] == 0.5
    assert merged["flops_profiler"] == {"enabled": False}
    untouched = {k: v for k, v in derived.items() if k not in ("zero_optimization", "gradient_clipping")}
    assert {k: merged[k] for k in untouched} == untouched


def test_a_scalar_replaces_an_object_and_an_object_replaces_a_scalar(tmp_path):
    merged = deepspeed_config(_config(tmp_path, {"zero_optimization": 0, "steps_per_print": {"odd": 1}}), dp=1)
    assert merged["zero_optimization"] == 0 and merged["steps_per_print"] == {"odd": 1}


@pytest.mark.parametrize("text, message", [
    ("{not json", "cannot read JSON"),
    ("[1, 2]", "must hold a JSON object"),
])
def test_unreadable_or_non_object_files_are_named(tmp_path, text, message):
    with pytest.raises(ConfigError, match=f"--deepspeed-config {tmp_path / 'ds.json'}: {message}"):
        deepspeed_config(_config(tmp_path, text), dp=1)


def test_zero_overlaps_its_reductions_as_deepspeed_reads_the_section():
    """The derived ZeRO section, parsed by DeepSpeed's own config model (deepspeed/runtime/zero/config.py)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    section = deepspeed_config(parse_config(["--preset", "tiny", "--zero-stage", "1"]), dp=1)["zero_optimization"]
    parsed = DeepSpeedZeroConfig(**section)
    assert parsed.stage == 1 and parsed.overlap_comm is True and parsed.contiguous_gradients is True
    assert parsed.reduce_bucket_size == parsed.allgather_bucket_size == 5 * 10**7
    assert DeepSpeedZeroConfig(stage=1).overlap_comm is False  # what DeepSpeed would do without the setting


def test_recomputed_domino_chunks_reduce_once_at_the_boundary():
    """Each recomputed chunk delivers a weight's gradient once more; with overlap_comm ZeRO would hook and reduce
    every arrival and refuse the second (stage_1_and_2.py reduce_ipg_grads), so the section turns it off."""
    flags = ["--preset", "tiny", "--tensor-model-parallel-size", "2", "--domino-chunks", "2", "--zero-stage", "1",
             "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    section = deepspeed_config(parse_config(flags), dp=1)["zero_optimization"]
    assert section["overlap_comm"] is False and section["contiguous_gradients"] is False
    unrecomputed = deepspeed_config(parse_config(flags[:8]), dp=1)["zero_optimization"]
    assert unrecomputed["overlap_comm"] is True


def test_pretrain_sets_one_cuda_connection_unless_the_environment_chose(monkeypatch):
    from domino.train import runtime_start

    warnings = []
    monkeypatch.setattr(runtime_start.logger, "warning", lambda message, *args: warnings.append(message % args))
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    runtime_start.set_overlap_environment()
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and warnings == []
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    runtime_start.set_overlap_environment()
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "8" and "expects 1" in warnings[0]


@pytest.mark.parametrize("flags, communication", [(["--bf16", "--zero-stage", "1"], "fp32"),
                                                  (["--bf16", "--zero-stage", "2"], "fp32"),
                                                  (["--zero-stage", "1"], None)])
def test_no_throughput_timer_and_fp32_reduction_of_fp32_accumulated_gradients(flags, communication):
    """Parsed by DeepSpeed's own config code (deepspeed 0.19.8 utils/config.py, runtime/config.py): its
    ThroughputTimer is off (it would synchronise the device twice per micro-batch), and bf16, whose gradients
    DeepSpeed accumulates in fp32 (ZeRO 1's BF16_Optimizer buffers, ZeRO 2's partitions), reduces them in fp32
    (DeepSpeed's default is bf16)."""
    import torch
    from deepspeed.runtime.config import get_communication_data_type
    from deepspeed.utils.config import get_timers_config

    ds = deepspeed_config(parse_config(["--preset", "tiny", *flags]), dp=1)
    assert get_timers_config({}).enabled is True  # DeepSpeed's default, without our key
    assert get_timers_config(ds).enabled is False
    assert get_communication_data_type(ds) == (torch.float32 if communication else None)


def test_deepspeed_is_imported_without_mlflow_which_stays_importable_after():
    """DeepSpeed's autotuner imports MLflow at import time if it can (0.19.8 ``autotuning/autotuner.py``): about a
    second of every rank's start-up; domino hides it during that import only."""
    import subprocess
    import sys

    code = ("import sys; from domino.optim import deepspeed_runtime; "
            "deepspeed_runtime.import_deepspeed(); "
            "from deepspeed.autotuning import autotuner; print('mlflow' in sys.modules, autotuner.has_mlflow); "
            "import mlflow; print(mlflow.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False", "mlflow"], out.stdout
