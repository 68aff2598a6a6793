"""FP8 (``--fp8-format``, torchao 0.18.0's tensorwise recipe, emulated on CPU): the linears' three GEMMs within
float8's error of fp32, a tiny GPT that learns like its fp32 twin (Domino chunks; TP=2 with sequence
parallelism), runs that fail when the scales are wrong, and the one line where FP8 cannot run."""

from __future__ import annotations

import pytest
import torch

from distributed_helpers import run_distributed
from domino.config import ConfigError, parse_config
from domino.parallel import fp8
from domino.parallel.layers import apply_fp8
from domino.parallel.random import model_parallel_seed
from domino.runtime import state
from model_fixtures import VOCAB, build_model, random_batch, tiny_config


#: float8 e4m3 carries 3 mantissa bits: one rounding is <= 6.25 % relative; a GEMM's output averages them.
GEMM_REL = 0.06
#: The loss after 30 steps of memorising one batch, FP8 against fp32 (measured: 0.6 % e4m3, 1.1 % hybrid).
TRAIN_REL = 0.03


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _broken_scales(monkeypatch):
    """Scales of 1 (no scaling): small tensors fall into float8's subnormals or to zero."""
    monkeypatch.setattr(fp8, "scale", lambda t, dtype: torch.ones((), dtype=torch.float32, device=t.device))


@pytest.mark.parametrize("fmt", fp8.FORMATS)
def test_the_three_gemms_are_within_float8_error_and_fail_without_scales(fmt, monkeypatch):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(32, 64, generator=g) * 1e-3).requires_grad_(True)  # activations well below e4m3's normals
    w = (torch.randn(48, 64, generator=g) * 0.02).requires_grad_(True)
    b = torch.zeros(48, requires_grad=True)
    grad = torch.randn(32, 48, generator=g) * 1e-4
    ref = torch.nn.functional.linear(x, w, b)
    ref.backward(grad)
    expected = (ref.detach(), x.grad.clone(), w.grad.clone())

    def run():
        x.grad = w.grad = b.grad = None
        recipe = fp8.recipe(fmt, torch.device("cpu"))
        y = fp8.linear(x, w, b, recipe)
        y.backward(grad)  # the node keeps its recipe for backward
        return recipe, (y.detach(), x.grad.clone(), w.grad.clone())

    recipe, got = run()
    assert recipe.emulate and recipe.forward_dtype == torch.float8_e4m3fn
    assert recipe.grad_dtype == (torch.float8_e5m2 if fmt == "hybrid" else torch.float8_e4m3fn)
    for name, a, e in zip(("output", "input grad", "weight grad"), got, expected):
        assert _rel(a, e) < GEMM_REL, (name, _rel(a, e))
    _broken_scales(monkeypatch)
    _, broken = run()
    assert max(_rel(a, e) for a, e in zip(broken, expected)) > 0.3


def _memorise_batch(model, fmt, steps):
    """AdamW steps on one fixed batch (the model learns it by heart), its linears given ``fmt``'s recipe; the
    losses."""
    apply_fp8(model, fp8.recipe(fmt, torch.device("cpu")) if fmt else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = random_batch(seed=3, batch=8, seq=8)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = model(batch["tokens"], labels=batch["labels"]).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _memorise(fmt, chunks=2, steps=30):
    torch.manual_seed(7)
    return _memorise_batch(build_model(tiny_config(hidden_size=64, ffn_hidden_size=256), VOCAB, chunks), fmt, steps)


def test_fp8_trains_a_tiny_gpt_with_domino_chunks_like_fp32_and_not_with_wrong_scales(monkeypatch):
    """The fp32 twin is the reference (bf16 on this CPU would only add its own rounding to the comparison)."""
    reference = _memorise(None)
    assert reference[-1] < 0.3 * reference[0]
    for fmt in fp8.FORMATS:
        losses = _memorise(fmt)
        assert abs(losses[-1] - reference[-1]) / reference[-1] < TRAIN_REL, (fmt, losses[-1], reference[-1])
    _broken_scales(monkeypatch)
    broken = _memorise("e4m3")
    assert abs(broken[-1] - reference[-1]) / reference[-1] > 5 * TRAIN_REL


def test_two_models_of_different_numerics_live_in_one_process():
    """The recipe is a value each linear holds (issue 55, item 5): an FP8 model and an fp32 one of the same
    weights, run in turns, each give their own losses and gradients, the fp32 one exactly its twin's."""
    def model(fmt):
        torch.manual_seed(7)
        built = build_model(tiny_config(hidden_size=64, ffn_hidden_size=256), VOCAB, 2)
        return apply_fp8(built, fp8.recipe(fmt, torch.device("cpu")) if fmt else None)

    batch = random_batch(seed=3, batch=8, seq=8)

    def loss_and_grads(m):
        m.zero_grad(set_to_none=True)
        loss = m(batch["tokens"], labels=batch["labels"]).mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in m.parameters()]

    eight, plain, alone = model("e4m3"), model(None), model(None)
    first = loss_and_grads(eight)
    mixed = loss_and_grads(plain)  # between two FP8 steps
    again = loss_and_grads(eight)
    reference = loss_and_grads(alone)
    assert torch.equal(mixed[0], reference[0]) and all(map(torch.equal, mixed[1], reference[1]))
    assert torch.equal(first[0], again[0]) and all(map(torch.equal, first[1], again[1]))
    assert first[0] != mixed[0] and abs(first[0] - mixed[0]) / mixed[0] < TRAIN_REL


def _tp2_body(rank, world_size, fmt, sp):
    state.initialize_model_parallel(2)
    model_parallel_seed(3, state.current_mesh().tp.rank)
    model = build_model(tiny_config(hidden_size=64, ffn_hidden_size=256, seq_length=8), VOCAB, 2,
                        sequence_parallel=sp)
    return _memorise_batch(model, fmt, 20)


def test_tp2_domino_with_sequence_parallelism_trains_in_fp8_like_fp32():
    """Scales per shard at TP=2 (each rank's weight shard, input and output gradient its own), Domino's two
    chunks and SP's all-gathers and reduce-scatters: the loss follows the fp32 run's on every rank."""
    reference = run_distributed(_tp2_body, 2, None, True)
    got = run_distributed(_tp2_body, 2, "hybrid", True)
    assert got[0] == got[1] and reference[0][-1] < 0.5 * reference[0][0]
    assert abs(got[0][-1] - reference[0][-1]) / reference[0][-1] < TRAIN_REL * 2, (got[0][-1], reference[0][-1])


def test_where_fp8_cannot_run_one_line_says_so(monkeypatch):
    with pytest.raises(ConfigError, match=r"^--fp8-format must be e4m3 or hybrid, got 'e5m2'$"):
        parse_config(["--fp8-format", "e5m2"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError) as error:
        fp8.recipe("hybrid", torch.device("cuda", 0))
    assert str(error.value) == ("--fp8-format hybrid: NVIDIA A100-SXM4-80GB (compute capability 8.0) has no FP8 "
                                "tensor cores (needs 8.9+: Ada, Hopper, Blackwell); train in --bf16 there")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8.recipe("e4m3", torch.device("cuda", 0)).emulate is False  # H100/H200: real FP8 GEMMs
    assert not hasattr(fp8, "_ACTIVE")  # recipe() decides; the linears hold what parallelize gives them


def test_the_mfu_line_and_estimate_take_the_fp8_peak(monkeypatch):
    import subprocess
    import sys

    from domino.train import throughput

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert throughput.detect_peak_tflops() == 989.0 and throughput.detect_peak_tflops(fp8=True) == 1979.0
    proc = subprocess.run([sys.executable, "-m", "domino", "estimate", "--preset", "gpt3-1.3b", "--gpus", "8",
                           "--fp8-format", "hybrid"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "at MFU 0.4 of 1979 TFLOP/s per GPU" in proc.stdout


def test_parallelize_gives_every_layer_linear_the_runs_recipe():
    from domino.model import GPTModel
    from domino.parallel.layers import ColumnParallelLinear, RowParallelLinear
    from domino.runtime.mesh import ParallelMesh
    from domino.train.parallelize import parallelize

    config = parse_config(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                           "--fp8-format", "hybrid"])
    model = parallelize(GPTModel(config.model, VOCAB), ParallelMesh.single(), config)
    linears = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert len(linears) == 8 and {m.fp8 for m in linears} == {fp8.recipe("hybrid", torch.device("cpu"))}
