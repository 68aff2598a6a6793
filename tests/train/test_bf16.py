"""--bf16: fp32 gradient accumulation and fp32 master weights, and a bit-exact resume with their state.

At one replica the default is ZeRO 0: domino's fp32 masters and main gradients (domino.optim.mixed_precision);
with ZeRO 1 DeepSpeed 0.19.8 picks ``BF16_Optimizer`` for bf16 weights with ``data_types.grad_accum_dtype: fp32``
(``deepspeed/runtime/engine.py``, ``_do_optimizer_sanity_check``). Either keeps fp32 master weights, which the
checkpoint stores by parameter name (``optimizer/``).
The model is tiny with a 256-token vocabulary: bf16 matmuls are slow on CPUs without bf16 units.
"""

import torch
from safetensors.torch import load_file

from domino.config import parse_config, validate
from domino.config.validate import zero_stage_for
from domino.optim.deepspeed_config import deepspeed_config
from train_helpers import run_pretrain, read_metrics

BF16 = ["--preset", "tiny", "--log-interval", "1", "--num-workers", "0", "--seed", "7", "--mock-data",
        "--vocab-size", "256", "--bf16", "--train-iters", "6", "--eval-iters", "0", "--eval-interval", "0",
        "--global-batch-size", "8",  # 2 micro-batches per step: gradients are accumulated
        "--hidden-dropout", "0.1"]  # dropout on: resuming must restore the RNG streams too


def test_bf16_accumulates_gradients_in_fp32_at_every_zero_stage():
    ds = deepspeed_config(parse_config(["--preset", "tiny", "--bf16"]), dp=1)
    assert ds["bf16"] == {"enabled": True} and ds["data_types"] == {"grad_accum_dtype": "fp32"}
    assert "data_types" not in deepspeed_config(parse_config(["--preset", "tiny"]), dp=1)
    # Stage 0 is domino's fp32 master weights and main gradients (domino.optim.mixed_precision), no DeepSpeed.
    validate(parse_config(["--preset", "tiny", "--bf16", "--zero-stage", "0", "--mock-data", "--train-iters", "1"]))
    assert zero_stage_for(parse_config(["--preset", "tiny", "--bf16"]), 1) == 0
    assert zero_stage_for(parse_config(["--preset", "tiny", "--bf16"]), 2) == 1


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
    # The fp32 master weights, not the bf16 weights widened: some are off bf16's grid.
    assert masters and any(not torch.equal(t, t.bfloat16().float()) for t in masters)
    assert sorted(ref_optim) == sorted(run_optim)
    for name, value in ref_optim.items():
        assert torch.equal(value, run_optim[name]), name
