"""--bf16: fp32 gradient accumulation through DeepSpeed's BF16 optimizer, and a bit-exact resume with its state.

DeepSpeed 0.19.8 picks ``BF16_Optimizer`` for bf16 weights with ``data_types.grad_accum_dtype: fp32`` at ZeRO 1
(``deepspeed/runtime/engine.py``, ``_do_optimizer_sanity_check``); its state dict carries this rank's fp32 master
weights under ``single_partition_of_fp32_groups`` (``deepspeed/runtime/bf16_optimizer.py``, ``state_dict``).
The model is tiny with a 256-token vocabulary: bf16 matmuls are slow on CPUs without bf16 units.
"""

import pytest
import torch
from safetensors.torch import load_file

from domino.config import ConfigError, parse_config, validate
from domino.train.engine import deepspeed_config
from train_helpers import run_pretrain, read_metrics

BF16 = ["--preset", "tiny", "--log-interval", "1", "--num-workers", "0", "--seed", "7", "--mock-data",
        "--vocab-size", "256", "--bf16", "--train-iters", "6", "--eval-iters", "0", "--eval-interval", "0",
        "--global-batch-size", "8",  # 2 micro-batches per step: gradients are accumulated
        "--hidden-dropout", "0.1"]  # dropout on: resuming must restore the RNG streams too


def test_bf16_accumulates_gradients_in_fp32_and_needs_a_zero_stage():
    ds = deepspeed_config(parse_config(["--preset", "tiny", "--bf16"]))
    assert ds["bf16"] == {"enabled": True} and ds["data_types"] == {"grad_accum_dtype": "fp32"}
    assert "data_types" not in deepspeed_config(parse_config(["--preset", "tiny"]))
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

    ref_optim = torch.load(tmp_path / "ref" / "iter_0000006" / "optim" / "rank_00000.pt", weights_only=True)
    run_optim = torch.load(save / "iter_0000006" / "optim" / "rank_00000.pt", weights_only=True)
    masters = ref_optim["single_partition_of_fp32_groups"]  # only DeepSpeed's BF16_Optimizer saves this key
    assert masters and all(t.dtype == torch.float32 for t in masters)
    for a, b in zip(masters, run_optim["single_partition_of_fp32_groups"]):
        assert torch.equal(a, b)
    for key, moments in ref_optim["base_optimizer_state"]["state"].items():
        for name, value in moments.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(
                run_optim["base_optimizer_state"]["state"][key][name])), (key, name)
    ref_model = load_file(tmp_path / "ref" / "iter_0000006" / "model" / "tp_rank_00.safetensors")
    run_model = load_file(save / "iter_0000006" / "model" / "tp_rank_00.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in ref_model.values())
    assert all(torch.equal(ref_model[k], run_model[k]) for k in ref_model)
