"""One path through the model: ``GPTModel.forward`` reads embed -> stack -> head, every stack returns the same
shape, and the overlap machinery is applied from outside (the model files import none of it)."""

from __future__ import annotations

import ast
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from domino.model import GPTModel
from domino.model.recompute import RecomputePlan, apply_activation_recompute
from domino.model.stack import StackOutput, SynchronousStack
from domino.overlap.schedule import DominoStack, apply_domino
from model_fixtures import VOCAB, tiny_config

REPO = Path(__file__).resolve().parents[2]


def test_forward_reads_in_one_screen():
    lines, _ = inspect.getsourcelines(GPTModel.forward)
    assert len(lines) <= 40, f"GPTModel.forward is {len(lines)} lines"
    body = "".join(lines)
    assert body.index("stack.embed(") < body.index("stack(hidden") < body.index("self._head(")


def _overlap_imports(path: Path) -> list:
    """Every import of ``domino.overlap`` in ``path``, function-local ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        found += [n for n in names if n == "domino.overlap" or n.startswith("domino.overlap.")]
    return found


def test_model_files_import_no_overlap_code():
    model_files = sorted((REPO / "domino" / "model").glob("*.py"))
    assert len(model_files) > 5
    assert {p.name: _overlap_imports(p) for p in model_files} == {p.name: [] for p in model_files}
    assert _overlap_imports(REPO / "domino" / "overlap" / "schedule.py")  # the check sees an import when there is one


_BUILD = """
import json, sys
import torch
from domino.config import ModelConfig
from domino.model import GPTModel

model = GPTModel(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8), 64)
model(torch.randint(0, 64, (2, 8)), labels=torch.randint(0, 64, (2, 8))).sum().backward()
print(json.dumps(sorted(m for m in sys.modules if m.startswith("domino.overlap"))))
"""


def test_the_model_trains_without_loading_any_overlap_code():
    """One chunk, no sequence parallelism: the model as built runs (and loads) nothing of ``domino.overlap``."""
    out = subprocess.run([sys.executable, "-c", _BUILD], capture_output=True, text=True, check=True, cwd=REPO)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


@pytest.mark.parametrize("chunks, sp, stack", [(1, False, "SynchronousStack"), (2, False, "DominoStack"),
                                               (1, True, "SynchronousStack")])
def test_the_training_recipe_applies_what_the_config_asks_for(chunks, sp, stack):
    """``domino pretrain``'s model builder (at TP=1 sequence parallelism is a no-op)."""
    from domino.config import DominoConfig
    from domino.runtime.mesh import ParallelMesh
    from domino.train.gpt_recipe import GPTRecipe

    config = DominoConfig().replace(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                                    mock_data=True, domino_chunks=chunks, sequence_parallel=sp,
                                    recompute_granularity="full", recompute_method="uniform")
    model = GPTRecipe(config, ParallelMesh.single()).model_builder(config, ParallelMesh.single())
    assert type(model.stack).__name__ == stack
    assert model.stack.units == [(0, 1, True), (1, 2, True)]  # recompute reached the stack that runs


def _outputs(model, tokens):
    stack = model.stack.select(tokens.shape[0], None)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    return stack(stack.embed(tokens, positions), positions, None, None, None)


@pytest.mark.parametrize("post_process", [True, False])
def test_synchronous_recompute_and_domino_stacks_return_one_shape(post_process):
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (4, 8))
    plain = GPTModel(tiny_config(), VOCAB, post_process=post_process)
    recompute = apply_activation_recompute(GPTModel(tiny_config(), VOCAB, post_process=post_process),
                                           RecomputePlan("full", "uniform", 1))
    domino = apply_domino(GPTModel(tiny_config(), VOCAB, post_process=post_process), 2)
    for model in (recompute, domino):
        model.load_state_dict(plain.state_dict())
    results = [_outputs(m, tokens) for m in (plain, recompute, domino)]
    assert all(isinstance(r, StackOutput) for r in results)
    assert recompute.stack.units == [(0, 1, True), (1, 2, True)]
    for r in results[1:]:
        torch.testing.assert_close(r.hidden, results[0].hidden)
    assert results[0].grad_slot is None and results[1].grad_slot is None
    # With an output layer the Domino stack hands it the per-chunk slots of its input gradient.
    assert (results[2].grad_slot is not None) == post_process


def test_domino_falls_back_to_the_stack_it_replaced():
    model = apply_activation_recompute(apply_domino(GPTModel(tiny_config(), VOCAB), 4),
                                       RecomputePlan("full", "block", 1))
    assert isinstance(model.stack, DominoStack) and isinstance(model.stack.fallback, SynchronousStack)
    assert model.stack.select(4, None) is model.stack
    assert model.stack.select(2, None) is model.stack.fallback  # a batch it cannot split
    assert model.stack.select(4, model.new_kv_cache()) is model.stack.fallback  # generation
    assert model.stack.fallback.units == model.stack.units == [(0, 1, True), (1, 2, False)]
    assert apply_domino(GPTModel(tiny_config(), VOCAB), 1).stack.fallback is None  # one chunk: nothing applied
    with pytest.raises(ValueError, match="--domino-chunks must be >= 1"):
        apply_domino(GPTModel(tiny_config(), VOCAB), 0)
