"""Between log intervals an iteration reads no tensor value on the host in domino's code (each read would be a
device sync on a GPU), counted with the probe of ``domino.train.host_syncs`` around real `domino pretrain` runs."""

import json
import subprocess
import sys

import pytest
import torch

from distributed_helpers import free_port
from train_helpers import child_env

from domino.train.host_syncs import HostSyncProbe

ITERS = 6
RUN = ["--preset", "tiny", "--mock-data", "--vocab-size", "512", "--num-workers", "0", "--seed", "7",
       "--train-iters", str(ITERS), "--log-interval", "3", "--eval-iters", "0", "--eval-interval", "0"]
#: The one read the CPU kernel choices keep: the TP=1 loss reads whether any row needs the log-sum-exp fallback
#: (domino/parallel/cross_entropy.py), once per micro-batch; the CUDA choice reads nothing there
#: (tests/model/test_model_kernels.py::test_tp1_loss_without_host_read_equals_the_softmax_shortcut).
KNOWN_ELSEWHERE = ("domino/parallel/cross_entropy.py:", "_loss_from_softmax")
#: The CPU choice of per-document attention (--reset-attention-mask) reads each sample's document lengths on the
#: host, every layer (domino/parallel/document_attention.py: the tensor is in host memory, so the read waits on
#: nothing); the CUDA choice reads its cu_seqlens once a batch.
DOCUMENTS_ON_CPU = "domino/parallel/document_attention.py:"
#: DeepSpeed 0.19.8's ZeRO-1/2 step reads its overflow decision once, and re-checks the norm once per parameter
#: group (two: with and without weight decay) in unscale_and_clip_grads (deepspeed/runtime/zero/stage_1_and_2.py).
DEEPSPEED_ZERO_READS_PER_ITERATION = 3


#: A launcher of the probe with DeepSpeed's CPU fp16 gate and domino's device check opened (fp16 runs on any CPU,
#: slowly, where DeepSpeed refuses it without AVX-512 FP16; tests/train/test_device_decided_steps.py does the same).
FP16_ON_CPU = """import runpy, sys
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
from domino.train import runtime_start
CPU_Accelerator.is_fp16_supported = lambda self: True
runtime_start.check_this_device = lambda config: None
runpy.run_module("domino.cli.host_syncs", run_name="__main__")
"""


def _probed_run(tmp_path, nproc, extra, env=None, fp16_on_cpu=False):
    out = tmp_path / "syncs"
    command = [sys.executable, "-m", "domino.cli.host_syncs", str(out), "pretrain", *RUN, *extra]
    if fp16_on_cpu:
        launcher = tmp_path / "fp16_on_cpu.py"
        launcher.write_text(FP16_ON_CPU)
        command[1:3] = [str(launcher)]
    if nproc > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
                   "127.0.0.1", "--master-port", str(free_port()), *command[1:]]
    proc = subprocess.run(command, env=child_env(env), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((tmp_path / f"syncs.rank{rank}.json").read_text()) for rank in range(nproc)]


def _step_reads(events, owner):
    return [e for e in events if e["phase"] == "step" and e["owner"] == owner]


def test_tp2_domino_iterations_read_nothing_on_the_host(tmp_path):
    # --exit-signal-handler: its SIGTERM flag is all-reduced every step (domino.train.preemption), off the device.
    ranks = _probed_run(tmp_path, 2, ["--tensor-model-parallel-size", "2", "--domino-chunks", "2",
                                      "--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss",
                                      "--exit-signal-handler"])
    for events in ranks:
        ours = _step_reads(events, "domino")
        assert [e for e in ours if not e["where"].startswith(DOCUMENTS_ON_CPU)] == [] and ours, ours
        # The probe sees the interval's reads: the device sums come back once per log interval.
        reads = [e for e in events if e["phase"] == "log" and "interval_stats.py" in e["where"]]
        assert sum(e["count"] for e in reads) == ITERS // 3
        deepspeed = sum(e["count"] for e in _step_reads(events, "deepspeed"))
        assert deepspeed <= DEEPSPEED_ZERO_READS_PER_ITERATION * ITERS


PP2 = ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "2", "--global-batch-size", "4"]


FP16 = ["--fp16", "--initial-loss-scale", "256"]


@pytest.mark.parametrize("precision,layout,zero", [
    (["--bf16"], ["--tensor-model-parallel-size", "2", "--domino-chunks", "2"], "1"),
    (["--bf16"], PP2, "1"),
    (["--bf16"], [*PP2, "--overlap-grad-reduce"], "1"),  # the buckets launched from the backward read nothing either
    # fp16 stages: the loss scale multiplies the last stage's loss and divides the norm as a device tensor, and
    # the ZeRO step agrees the overflow over the stages on the device (domino.train.pipeline_step, zero_step).
    (FP16, PP2, "1"),
    # fp16 stages at ZeRO 0 (domino's MixedPrecisionAdamW, its loss scale on the device), with and without the
    # data-parallel buckets launched from the backward.
    (FP16, PP2, "0"),
    (FP16, [*PP2, "--overlap-grad-reduce"], "0"),
])
def test_half_precision_tp2_domino_and_stages_read_and_wait_for_nothing(tmp_path, precision, layout, zero):
    """bf16 ZeRO 1 (DeepSpeed's BF16_Optimizer) at TP=2 with Domino, and in two pipeline stages (fp16 at ZeRO 1,
    DeepSpeed's ZeRO optimizer with domino's device-decided step, and at ZeRO 0, domino's own): no host read and
    no explicit synchronize inside iterations on any rank, by any owner. DeepSpeed's own step read overflow and the
    clip decision (2 per iteration) and its ThroughputTimer synchronised twice per micro-batch;
    domino.optim.bf16_step and the engine's config remove both; the staged step (domino.train.pipeline_step)
    scales, reduces, clips and agrees on a skip with tensors only."""
    ranks = _probed_run(tmp_path, 2, [*precision, "--zero-stage", zero, *layout, "--vocab-size", "256"],
                        fp16_on_cpu="--fp16" in precision)
    for events in ranks:
        step = [e for e in events if e["phase"] == "step"]
        # torch's pipeline schedule makes and reads its stages' one-time warm-up vote in its first step only
        # (torch 2.13 distributed/pipelining: stage.py `_warmup_forward_vote` `torch.tensor([my_vote], device=)`,
        # schedules.py `_warmup_p2p` `result.item()`), seen from domino's call. At TP 1 the last stage's loss keeps
        # the CPU kernel choice's read (KNOWN_ELSEWHERE).
        assert [e for e in step if not (e["where"].startswith("domino/pipeline/schedule.py:")
                                        and e["method"] in ("item", "torch.tensor->device") and e["count"] == 1)
                and not e["where"].startswith(KNOWN_ELSEWHERE)] == [], step
        # The interval's numbers still come back once per log interval (and the gradient norm with them).
        assert sum(e["count"] for e in events if e["phase"] == "log" and "interval_stats.py" in e["where"]) \
            == ITERS // 3


def test_bf16_zero2_dp2_iterations_read_and_copy_nothing(tmp_path):
    """bf16 ZeRO 2 at DP=2 (DeepSpeed's ZeRO optimizer): neither a host read nor a device tensor made from a
    Python number inside iterations. DeepSpeed's get_grad_norm_direct built ``torch.tensor(-1.0, device=...)``
    once per parameter group (2 per iteration); domino.optim.zero_step's norm builds none. The plain kernels
    take the loss's CUDA formula, so the CPU choice's one read per micro-batch (KNOWN_ELSEWHERE) is not there."""
    ranks = _probed_run(tmp_path, 2, ["--bf16", "--zero-stage", "2", "--vocab-size", "256"],
                        env={"DOMINO_KERNELS": "plain"})
    for events in ranks:
        assert [e for e in events if e["phase"] == "step"] == []
        assert sum(e["count"] for e in events if e["phase"] == "log" and "interval_stats.py" in e["where"]) \
            == ITERS // 3


def test_the_probe_counts_python_numbers_made_device_tensors_and_restores_torch():
    """On a CPU-only machine an explicit ``device`` argument is what would be a host-to-device copy on a GPU;
    tensors from tensors, host tensors without a device, and fills are not copies."""
    t = torch.ones(2)
    originals = (torch.tensor, torch.as_tensor, torch.scalar_tensor, torch.Tensor.new_tensor)
    with HostSyncProbe() as probe:
        torch.tensor(-1.0, device=t.device)
        torch.as_tensor([1.0, 2.0], device="cpu")
        torch.scalar_tensor(3.0, device=t.device)
        t.new_tensor([4.0])  # the tensor's own device
        torch.tensor(5.0), torch.as_tensor(t, device=t.device), torch.full((2,), 1.0, device=t.device)
    assert (torch.tensor, torch.as_tensor, torch.scalar_tensor, torch.Tensor.new_tensor) == originals
    assert sorted(e["method"] for e in probe.to_json()) == [
        "Tensor.new_tensor->device", "torch.as_tensor->device", "torch.scalar_tensor->device",
        "torch.tensor->device"]
    assert probe.count(device_copies=True) == 4 and probe.count(device_copies=False) == 0


def test_the_probe_counts_explicit_synchronizes_once_and_restores_them():
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    original, accelerator = CPU_Accelerator.synchronize, CPU_Accelerator()
    with HostSyncProbe() as probe:
        accelerator.synchronize()
        accelerator.synchronize()
    assert CPU_Accelerator.synchronize is original and probe.count() == 2
    assert {e["method"] for e in probe.to_json()} == {"synchronize"}


def test_one_process_zero0_skips_on_the_device(tmp_path):
    """ZeRO 0 fp32: domino clips and flags overflow for the fused AdamW; DeepSpeed's engine reads nothing."""
    events, = _probed_run(tmp_path, 1, ["--zero-stage", "0", "--micro-batch-size", "2", "--global-batch-size", "4"])
    ours = _step_reads(events, "domino")
    assert all(KNOWN_ELSEWHERE[0] in e["where"] and KNOWN_ELSEWHERE[1] in e["where"] for e in ours), ours
    assert sum(e["count"] for e in ours) <= 2 * ITERS  # the known read: once per micro-batch (2 per iteration)
    assert _step_reads(events, "deepspeed") == []


def test_the_probe_counts_reads_by_owner_and_restores_torch():
    t = torch.ones(2)
    original = torch.Tensor.item
    with HostSyncProbe() as probe:
        float(t.sum()), t.tolist(), bool(t[0] > 0), t[t > 0]
    assert torch.Tensor.item is original
    methods = sorted(e["method"] for e in probe.to_json())
    assert methods == ["__bool__", "__float__", "__getitem__[bool mask]", "tolist"]
    assert probe.count(owner="other") == 4  # called from this test, outside domino and deepspeed


def test_the_cuda_count_adds_explicit_synchronizes_to_the_debug_modes_warnings(monkeypatch):
    """The CUDA branch of ``syncs_per_step``, rehearsed on CPU: torch's sync debug mode warns from inside
    synchronising ops but not on ``torch.cuda.synchronize()``, so both are counted, each with its site."""
    import warnings

    from domino.train import host_syncs

    modes = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def step():
        warnings.warn("called a synchronizing CUDA operation")  # what the debug mode raises inside an op
        # torch's one-time notice when the mode is set (torch/cuda/__init__.py): not a sync
        warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all "
                      "synchronizing operations")
        torch.cuda.synchronize()
        torch.cuda.synchronize()
        torch.tensor(0.5, device="meta")  # a non-CPU target (meta: no GPU here) counts as a copy
        torch.tensor(0.5, device="cpu")  # with a GPU present, a host tensor is not one

    counted = host_syncs.syncs_per_step(step, 2)
    assert modes == ["warn", "default"]
    assert counted["per_iteration"] == 3.0
    assert counted["device_copies_per_iteration"] == 1.0
    sites = counted["where"]
    assert sum(v for k, v in sites.items() if k.endswith("(synchronize)")) == 2.0
    assert all("test_host_syncs.py" in k for k in sites), sites
