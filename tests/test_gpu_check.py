"""benchmarks/gpu_check.sh --dry-run: the GPU check runs end to end on CPU (tiny presets), retries out-of-memory
at half the micro-batch, and prints valid JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmark_helpers import load_benchmark

REPO = Path(__file__).resolve().parents[1]


def _gpu_check_module():
    return load_benchmark("gpu_check")


def test_dry_run_prints_one_valid_json_object_retries_out_of_memory_and_the_loss_falls(tmp_path):
    """The CPU rehearsal of the device check: every stage, the out-of-memory retry (the main stage's first step
    raises torch.cuda.OutOfMemoryError: it runs again at half the micro-batch), the sync count, the JSON file
    in $OUT."""
    env = dict(os.environ, PYTHON=sys.executable, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", OUT=str(tmp_path),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--dry-run", "--simulate-oom", "main"],
                          cwd="/", env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)  # stdout holds the JSON object and nothing else
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == result
    assert "time budget 420 s" in proc.stderr
    assert result["alloc_conf"] == "expandable_segments:True" and result["errors"] == {}
    smoke = json.loads((tmp_path / "smoke.json").read_text())  # the smoke stage ran first, kept on its own
    assert smoke["ok"] and smoke["result"]["all_reduce"] == {**smoke["result"]["all_reduce"], "backend": "gloo",
                                                             "correct": True}
    assert result["smoke"] == smoke["result"] and smoke["result"]["gemm_bf16_tflops"] > 0
    assert {p.name for p in tmp_path.glob("*.json")} == {
        "smoke.json", "search.json", "main.json", "chunks_2.json", "llama.json", "cp_2.json", "gpu_check.json"}
    cp_2 = result["cp_2"]  # the ring at CP 2 through the CPU's fused blocks, equal to unsplit SDPA
    assert cp_2["kind"] == cp_2["expected_kind"] == "cpu_flash" and cp_2["max_rel_error"] < 1e-4
    assert cp_2["dropout_finite"] and cp_2["dropout_changes_output"]
    _gpu_check_module().check_result(result)
    assert result["dry_run"] is True and result["device"] == "cpu" and result["precision"] == "bf16"
    assert result["micro_batch"] == {"largest_that_fits": 4, "tried": {"1": True, "2": True, "4": True},
                                     "measured": 2}
    assert [(r["stage"], r["micro_batch"]) for r in result["oom_retries"]] == [("main", 4)]
    assert result["skipped"] == {} and set(result["tokens_per_s"]) == {"chunks_1", "chunks_2"}
    assert result["loss_falls"] and result["loss_curve"][-1] < result["loss_curve"][0]
    # bf16 ZeRO 1 at TP=1 on CPU: the one read is the CPU loss's fallback check (the CUDA choice has none).
    assert result["syncs_per_iteration"] <= 1.0
    assert all("cross_entropy.py" in site for site in result["syncs"]["where"]), result["syncs"]
    llama = result["llama"]
    assert llama["preset"] == "tiny-llama" and llama["tokens_per_s"] > 0
    assert llama["loss_falls"] and llama["loss_curve"][-1] < llama["loss_curve"][0]


def test_a_stage_failing_after_another_finished_keeps_the_first_ones_result(tmp_path):
    """The LLaMA stage raises after the main stage wrote its JSON: main.json stays, llama.json holds the error in
    one line, the combined result carries both, and the exit status says a stage failed (4)."""
    env = dict(os.environ, PYTHON=sys.executable, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", OUT=str(tmp_path),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--dry-run", "--stages",
                           "main,llama", "--simulate-error", "llama"],
                          cwd="/", env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 4, proc.stderr[-4000:]
    main = json.loads((tmp_path / "main.json").read_text())
    assert main["ok"] and len(main["result"]["losses"]) == 20 and main["result"]["micro_batch"] == 1
    llama = json.loads((tmp_path / "llama.json").read_text())
    assert llama == {**llama, "stage": "llama", "ok": False,
                     "error": "RuntimeError: simulated error in stage llama (--simulate-error)"}
    result = json.loads(proc.stdout)
    assert result["llama"] == {"error": llama["error"]} and result["errors"] == {"llama": llama["error"]}
    assert result["skipped"] == {"search": "not in --stages", "chunks_2": "micro-batch 1 cannot be split into 2 chunks",
                                 "cp_2": "not in --stages"}
    _gpu_check_module().check_result(result)
    assert "stage llama failed" in proc.stderr and not (tmp_path / "smoke.json").exists()


def test_a_stage_past_its_time_box_or_raising_is_reported_in_one_line(tmp_path):
    import time

    stages = load_benchmark("gpu_check_stages")
    assert stages.run_stage("slow", lambda: time.sleep(3), str(tmp_path), 0.2) == (
        False, "StageTimeout: stage slow ran past its 0.2 s time box")
    assert stages.run_stage("exits", lambda: sys.exit("gpu_check: no fit\nmore"), str(tmp_path), 5) == (
        False, "SystemExit: gpu_check: no fit")
    assert stages.run_stage("fine", lambda: {"x": 1}, str(tmp_path), 5) == (True, {"x": 1})
    assert json.loads((tmp_path / "fine.json").read_text())["result"] == {"x": 1}
    assert not json.loads((tmp_path / "slow.json").read_text())["ok"]


def test_a_stage_that_never_fits_is_skipped_and_reported():
    import torch

    module = _gpu_check_module()
    report, tried = {"oom_retries": [], "skipped": {}}, []

    def never_fits(micro_batch):
        tried.append(micro_batch)
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    assert module.with_halving("chunks_2", 6, never_fits, report, minimum=2, even=True) is None
    assert tried == [6, 2]  # halved to an even micro-batch, down to 2
    assert report["skipped"] == {"chunks_2": "out of memory down to micro-batch 2"}
    assert module.with_halving("llama", 4, lambda mb: mb * 10, report) == 40


def test_the_llama_entry_runs_at_tp1_with_its_own_vocabulary():
    module = _gpu_check_module()
    args = module.argparse.Namespace(preset="gpt3-1.3b", llama_preset="llama2-7b", llama_layers=4, vocab_size=50257,
                                     llama_vocab_size=32000)
    config = module._config(args, 1, 1, llama=True)
    assert config.parallel.tensor_model_parallel_size == 1 and config.model.num_layers == 4
    assert module.padded_vocab_size(config.model.vocab_size, config) == 32000  # padded for TP=1, not 8


def _result():
    return {"device": "cpu", "dry_run": True, "preset": "tiny", "precision": "bf16", "tensor_model_parallel_size": 1,
            "seq_length": 64, "padded_vocab_size": 256,
            "micro_batch": {"largest_that_fits": 2, "tried": {"1": True, "2": True}, "measured": 2},
            "tokens_per_s": {"chunks_1": 10.0, "chunks_2": 9.0}, "chunks_2_over_chunks_1": 0.9,
            "tflops_per_device": 0.1, "peak_tflops": None, "mfu": None, "peak_memory_gb": None,
            "peak_reserved_gb": None, "syncs_per_iteration": 0.0, "syncs": {},
            "loss_curve": [float(20 - i) for i in range(20)], "loss_falls": True, "torch": "2", "seconds": 1.0,
            "compile_backend": None, "c_compiler": None, "cudnn_version": None, "oom_retries": [], "skipped": {},
            "errors": {}, "alloc_conf": "expandable_segments:True", "budget_s": 420.0,
            "llama": {"preset": "tiny-llama", "num_layers": 2, "micro_batch": 1, "tokens_per_s": 5.0,
                      "tflops_per_device": 0.1, "mfu": None, "loss_curve": [float(20 - i) for i in range(20)],
                      "loss_falls": True}}


@pytest.mark.parametrize("change, message", [
    (lambda r: r.pop("mfu"), "'mfu' is missing"),
    (lambda r: r.pop("peak_reserved_gb"), "'peak_reserved_gb' is missing"),
    (lambda r: r.update(loss_curve=[1.0] * 3), "'loss_curve' must hold 20 floats"),
    (lambda r: r.update(tokens_per_s={"chunks_1": 0.0}), "'tokens_per_s' must be positive"),
    (lambda r: r.update(peak_memory_gb="12"), "'peak_memory_gb' is str, expected float or NoneType"),
    (lambda r: r["llama"].update(loss_curve=[1.0]), "'llama' must hold a 20-step 'loss_curve'"),
    (lambda r: r["llama"].update(tokens_per_s=0.0), "'llama' tokens_per_s must be positive"),
    (lambda r: r.update(llama={"skipped": "time budget spent"}), "'llama' was skipped but 'skipped' does not say"),
    (lambda r: r.update(llama={"error": "RuntimeError: x"}), "'llama' failed but 'errors' does not say how"),
    (lambda r: r.pop("errors"), "'errors' is missing"),
])
def test_check_result_names_what_is_wrong(change, message):
    module = _gpu_check_module()
    result = _result()
    module.check_result(_result())
    skipped = _result()
    skipped.update(llama={"skipped": "time budget spent"}, skipped={"llama": "time budget spent"})
    module.check_result(skipped)
    change(result)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        module.check_result(result)


def test_device_run_keeps_to_eight_minutes_and_rehearses_on_cpu(tmp_path):
    """benchmarks/device_run.sh: its steps' time boxes (plus timeout's 10 s grace each) stay within 8 minutes,
    and its dry run leaves every stage's JSON and the log in $OUT."""
    import re

    script = (REPO / "benchmarks" / "device_run.sh").read_text()
    boxes = [int(b) for b in re.findall(r"^\s*step \w+ (\d+) ", script, flags=re.M)]
    assert len(boxes) == 3 and sum(boxes) + 10 * len(boxes) <= 480
    env = dict(os.environ, PYTHON=sys.executable, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", OUT=str(tmp_path),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "device_run.sh"), "--dry-run"], cwd="/", env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for stage in ("smoke", "search", "main", "chunks_2", "llama", "cp_2"):
        assert json.loads((tmp_path / f"{stage}.json").read_text())["ok"], stage
    assert json.loads((tmp_path / "gpu_check.json").read_text())["skipped"] == {}
    log = (tmp_path / "device_run.log").read_text()
    assert "device_run: smoke exited 0" in log and "device_run: training exited 0" in log


def test_the_opt_in_compiled_stage_reports_whole_blocks_and_segments(tmp_path):
    """``--stages ...,compiled`` (not in device_run.sh's default): DOMINO_KERNELS=compiled at one chunk and at Domino
    2 on CPU (real inductor), beside the eager rates at the same micro-batch; unnamed, it leaves no trace."""
    env = dict(os.environ, PYTHON=sys.executable, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", OUT=str(tmp_path),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--dry-run", "--stages",
                           "search,main,chunks_2,compiled"], cwd="/", env=env, capture_output=True, text=True,
                          timeout=300)
    result = json.loads(proc.stdout)
    assert result["errors"] == {} and "compiled" not in result["skipped"], proc.stderr[-4000:]
    compiled = result["compiled"]
    assert compiled["compile_blocks"] == "inductor" and compiled["micro_batch"] == result["micro_batch"]["measured"]
    assert set(compiled["tokens_per_s"]) == set(compiled["first_step_s"]) == set(compiled["over_eager"]) == {
        "chunks_1", "chunks_2"}
    assert all(v > 0 for v in compiled["over_eager"].values())
    assert json.loads((tmp_path / "compiled.json").read_text())["ok"]
    _gpu_check_module().check_result(result)
    _gpu_check_module().check_result({k: v for k, v in result.items() if k != "compiled"})
