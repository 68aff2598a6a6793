"""--bf16: fp32 gradient accumulation through DeepSpeed's BF16 optimizer, and a bit-exact resume with its state.

DeepSpeed 0.19.8 picks ``BF16_Optimizer`` for bf16 weights with ``data_types.grad_accum_dtype: fp32`` at ZeRO 1
(``deepspeed/runtime/engine.py``, ``_do_optimizer_sanity_check``); it keeps fp32 master weights, which the checkpoint
stores by parameter name (``optimizer/``, read through DeepSpeed's ``safe_get_full_fp32_param``).
The model is tiny with a 256-token vocabulary: bf16 matmuls are slow on CPUs without bf16 units.
"""

import pytest
import torch
from safetensors.torch import load_file

from domino.config import ConfigError, parse_config, validate
from domino.optim.deepspeed_config import deepspeed_config
from train_helpers import run_pretrain, read_metrics

BF16 = ["--preset", "tiny", "--log-interval", "1", "--num-workers", "0", "--seed", "7", "--mock-data",
        "--vocab-size", "256", "--bf16", "--train-iters", "6", "--eval-iters", "0", "--eval-interval", "0",
        "--global-batch-size", "8",  # 2 micro-batches per step: gradients are accumulated
        "--hidden-dropout", "0.1"]  # dropout on: resuming must restore the RNG streams too


def test_bf16_accumulates_gradients_in_fp32_and_needs_a_zero_stage():
    ds = deepspeed_config(parse_config(["--preset", "tiny", "--bf16"]), dp=1)
    assert ds["bf16"] == {"enabled": True} and ds["data_types"] == {"grad_accum_dtype": "fp32"}
    assert "data_types" not in deepspeed_config(parse_config(["--preset", "tiny"]), dp=1)
    with pytest.raises(ConfigError, match="--bf16 needs --zero-stage 1 or 2"):
        validate(parse_config(["--preset", "tiny", "--bf16", "--zero-stage", "0", "--mock-data", "--train-iters",
                               "1"]))


def _records(path):
    return {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in read_metrics(path) if "eval" not in r}


def test_bf16_resume_is_bit_exact(tmp_path):
    reference = tmp_path / "reference.jsonl"
    run_pretrain([*BF16, "--metrics-file", str(reference), "--save", str(tmp_path / "ref")])

    save, metrics = tmp_path / "run", tmp_path / "run.jsonl"
    run_pretrain([*BF16, "--metrics-file", str(metrics), "--save", str(save), "--save-interval", "3",
                  "--exit-interval", "3"])
    assert (save / "latest").read_text().strip() == "iter_0000003"
    resumed = run_pretrain([*BF16, "--metrics-file", str(metrics), "--save", str(save), "--load", str(save)])
    assert "resumed from" in resumed.stderr

    expected = _records(reference)
    assert sorted(expected) == list(range(1, 7))
    assert _records(metrics) == expected  # losses and gradient norms: exact float equality

    from domino.checkpoint.fragment_io import read_state
    from domino.checkpoint.on_disk import Checkpoint

    ref_optim = read_state(Checkpoint.read(tmp_path / "ref" / "iter_0000006"))
    run_optim = read_state(Checkpoint.read(save / "iter_0000006"))
    masters = [t for name, t in ref_optim.items() if name.startswith("fp32.")]
    # The fp32 master weights (DeepSpeed's BF16_Optimizer), not the bf16 weights widened: some are off bf16's grid.
    assert masters and any(not torch.equal(t, t.bfloat16().float()) for t in masters)
    assert sorted(ref_optim) == sorted(run_optim)
    for name, value in ref_optim.items():
        assert torch.equal(value, run_optim[name]), name
