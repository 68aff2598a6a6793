"""The kernel choice is a value the model holds (given by ``parallelize``), not a process-wide setting: two models
with different choices live in one process, each running its own forms (seen by a ``TorchFunctionMode``, as in
``test_model_norms.py``), and the values agree."""

from __future__ import annotations

import torch

from domino.config import DominoConfig
from domino.model import GPTModel
from domino.parallel.kernels import CPU_KERNELS, PLAIN_KERNELS, apply_kernels
from domino.runtime.mesh import ParallelMesh
from domino.train.gpt_recipe import GPTRecipe
from domino.train.parallelize import parallelize
from model_fixtures import VOCAB, assert_close_rel, random_batch
from test_model_norms import _Calls  # records which of torch's one-op norm and GeLU ran

CONFIG = DominoConfig().replace(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8,
                                hidden_dropout=0.0, attention_dropout=0.0, domino_chunks=2)


def _model(kernels):
    torch.manual_seed(3)  # the same weights for every choice
    return parallelize(GPTModel(CONFIG.model, VOCAB), ParallelMesh.single(), CONFIG, kernels)


def _step(model):
    batch = random_batch(seed=4)
    calls = _Calls()
    with calls:
        losses = model(batch["tokens"], labels=batch["labels"])
        (losses * batch["weights"]).sum().backward()
    return losses.detach(), {n: p.grad for n, p in model.named_parameters()}, calls.seen


def test_two_models_with_different_choices_each_run_their_own_forms():
    plain, device = _model(PLAIN_KERNELS), _model(CPU_KERNELS)
    holders = [m for m in plain.modules() if hasattr(m, "kernels")]
    assert len(holders) > 10 and {m.kernels for m in holders} == {PLAIN_KERNELS}  # norms, linears, attention, ...
    plain_losses, plain_grads, plain_seen = _step(plain)
    losses, grads, seen = _step(device)
    again = _step(_model(PLAIN_KERNELS))  # interleaved: nothing of the other model's choice stayed behind
    assert seen == {"layer_norm", "gelu"}  # torch's norm and GeLU
    assert plain_seen == again[2] == set()  # the textbook formulas
    assert_close_rel(losses, plain_losses, 1e-5, "losses")
    for name, grad in plain_grads.items():
        assert_close_rel(grads[name], grad, 1e-5, f"grad {name}")


def test_none_gives_a_model_its_devices_choice_back():
    model = _model(PLAIN_KERNELS)
    assert not {"layer_norm", "gelu"} & _step(model)[2]
    apply_kernels(model, None)  # the device's own choice again (the CPU's here)
    assert {"layer_norm", "gelu"} <= _step(model)[2]


def test_the_recipe_gives_the_entry_points_choice_to_the_model():
    config = CONFIG.replace(vocab_size=64, mock_data=True)
    mesh = ParallelMesh.single()
    for choice, table in ((None, CPU_KERNELS), (PLAIN_KERNELS, PLAIN_KERNELS)):
        model = GPTRecipe(config, mesh, choice).model_builder(config, mesh)
        assert model.kernels == table and model.layers[0].input_layernorm.kernels == table
