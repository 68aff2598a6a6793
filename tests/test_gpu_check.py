"""benchmarks/gpu_check.sh --dry-run: the GPU check runs end to end on CPU (tiny preset) and prints valid JSON."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_prints_one_valid_json_object_and_the_loss_falls():
    env = dict(os.environ, PYTHON=sys.executable, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--dry-run"], cwd="/", env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)  # stdout holds the JSON object and nothing else
    _gpu_check_module().check_result(result)
    assert result["dry_run"] is True and result["device"] == "cpu" and result["precision"] == "bf16"
    assert result["micro_batch"] == {"largest_that_fits": 2, "tried": {"1": True, "2": True}}
    assert set(result["tokens_per_s"]) == {"chunks_1", "chunks_2"}
    assert result["loss_falls"] and result["loss_curve"][-1] < result["loss_curve"][0]
    llama = result["llama"]
    assert llama["preset"] == "tiny-llama" and llama["tokens_per_s"] > 0
    assert llama["loss_falls"] and llama["loss_curve"][-1] < llama["loss_curve"][0]


@pytest.mark.parametrize("change, message", [
    (lambda r: r.pop("mfu"), "'mfu' is missing"),
    (lambda r: r.update(loss_curve=[1.0] * 3), "'loss_curve' must hold 20 floats"),
    (lambda r: r.update(tokens_per_s={"chunks_1": 0.0}), "'tokens_per_s' must be positive"),
    (lambda r: r.update(peak_memory_gb="12"), "'peak_memory_gb' is str, expected float or NoneType"),
    (lambda r: r["llama"].update(loss_curve=[1.0]), "'llama' must hold a 20-step 'loss_curve'"),
    (lambda r: r["llama"].update(tokens_per_s=0.0), "'llama' tokens_per_s must be positive"),
])
def test_check_result_names_what_is_wrong(change, message):
    module = _gpu_check_module()
    result = {"device": "cpu", "dry_run": True, "preset": "tiny", "precision": "bf16", "seq_length": 64,
              "padded_vocab_size": 256, "micro_batch": {"largest_that_fits": 2, "tried": {"1": True, "2": True}},
              "tokens_per_s": {"chunks_1": 10.0, "chunks_2": 9.0}, "chunks_2_over_chunks_1": 0.9,
              "tflops_per_device": 0.1, "peak_tflops": None, "mfu": None, "peak_memory_gb": None,
              "syncs_per_iteration": None, "syncs": {}, "loss_curve": [float(20 - i) for i in range(20)],
              "loss_falls": True, "torch": "2", "seconds": 1.0,
              "llama": {"preset": "tiny-llama", "num_layers": 2, "micro_batch": 1, "tokens_per_s": 5.0,
                        "tflops_per_device": 0.1, "mfu": None, "loss_curve": [float(20 - i) for i in range(20)],
                        "loss_falls": True}}
    module.check_result(dict(result))
    change(result)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        module.check_result(result)
