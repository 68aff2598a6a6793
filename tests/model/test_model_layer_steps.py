"""The layer's maths has one definition: :meth:`TransformerLayer.steps`, run to its end by the plain forward and
interleaved by the overlapped stacks (#55 item 4)."""

from __future__ import annotations

import ast
import os

import torch

import domino
from domino.model.stack import SynchronousStack
from domino.model.transformer import TransformerLayer
from domino.overlap.schedule import DominoStack
from domino.overlap.sequence_parallel import SequenceParallelStack
from model_fixtures import VOCAB, build_model, tiny_config

ROOT = os.path.dirname(os.path.abspath(domino.__file__))


def _outputs(tokens):
    """Logits of the plain, Domino (2 chunks) and sequence-parallel stacks, same weights (one process: the
    sequence-parallel stack set directly, as :func:`apply_sequence_parallel` leaves TP=1 alone)."""
    out = {}
    stacks = (("plain", SynchronousStack), ("domino", DominoStack), ("sequence parallel", SequenceParallelStack))
    for name, stack in stacks:
        torch.manual_seed(0)
        model = build_model(tiny_config(), VOCAB, chunks=2 if stack is DominoStack else 1)
        if stack is SequenceParallelStack:
            model.stack = SequenceParallelStack(model, model.stack)
        assert type(model.stack) is stack
        out[name] = model(tokens)
    return out


def test_a_change_to_the_layer_steps_reaches_every_stack(monkeypatch):
    """A change made once, in the layer's steps, changes the plain forward and both overlapped stacks alike."""
    tokens = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(0))
    before = _outputs(tokens)
    original = TransformerLayer.steps

    def halved_steps(self, hidden, *args, **kwargs):
        out = yield from original(self, hidden, *args, **kwargs)
        return 0.5 * out  # a change to the layer's maths: every stack must see it

    monkeypatch.setattr(TransformerLayer, "steps", halved_steps)
    after = _outputs(tokens)
    for name in before:
        assert not torch.allclose(after[name], before[name]), f"the {name} stack does not run TransformerLayer.steps"
        torch.testing.assert_close(after[name], after["plain"], rtol=1e-5, atol=1e-5, msg=name)


#: The calls that compose the layer's maths: the attention, the MLP, the norms and the residual adds.
PIECES = ("attention.qkv", "attention.context", "mlp.inner", "mlp.product", "input_layernorm", "finish_norm")


def test_only_the_layer_steps_compose_the_layer_pieces():
    """No other function in ``domino/`` calls the layer's pieces itself: that would be a second copy of its maths."""
    callers = {piece: set() for piece in PIECES}
    for folder, _, files in os.walk(ROOT):
        for name in (n for n in files if n.endswith(".py")):
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                text = f.read()
            if not any(piece.rpartition(".")[2] in text for piece in PIECES):
                continue  # parsing every module would take seconds
            tree = ast.parse(text)
            for function in ast.walk(tree):
                if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(function):
                    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                        called = ast.unparse(node.func)
                        for piece in (p for p in PIECES if called.endswith(p)):
                            callers[piece].add(f"{os.path.relpath(path, ROOT)}:{function.name}")
    # Steps A and E are functions of their own, beside the steps that call them (compiled segments share them).
    own = {"attention.context": "attention_context", "mlp.product": "mlp_output"}
    assert callers == {piece: {f"model/transformer.py:{own.get(piece, 'steps')}"} for piece in PIECES}
