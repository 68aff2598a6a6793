"""Activation recompute that keeps tensor-parallel dropout exact: Megatron's ``tensor_parallel.checkpoint``.

``torch.utils.checkpoint`` restores the default generators before recomputing, but not the TP tracker's named
state that attention dropout draws from (:mod:`domino.parallel.random`), so the recomputed masks would differ.
Megatron-LM therefore ships its own ``CheckpointFunction`` (``megatron/core/tensor_parallel/random.py``): save
every RNG state (CPU, CUDA, tracker) with the inputs, run the function without building a graph, and in backward
restore the states, re-run the function with grad, backpropagate through it, then put the states back as they
were. :func:`checkpoint` is that function.

Domino interleaves the steps of two or more batch chunks, so a layer's dropout draws of one chunk are
interleaved with the other chunks' draws; a single RNG snapshot at the layer's start cannot replay them.
:func:`run_recorded` and :func:`replay` checkpoint a *step program* instead (a generator that yields between
steps, as the overlapped stacks of :mod:`domino.overlap.steps` run it): the forward records the RNG states before
every step, and the recompute restores each one before the same step, so every mask is drawn from the same state
as the first time.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Generator, List

import torch

from domino.parallel.random import capture_rng_states, restore_rng_states


class _CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_function, *args):
        ctx.run_function = run_function
        ctx.rng_states = capture_rng_states()
        ctx.save_for_backward(*args)
        with torch.no_grad():
            return run_function(*args)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [a.detach().requires_grad_(a.requires_grad) for a in ctx.saved_tensors]
        outputs = _rerun(ctx.rng_states, lambda: ctx.run_function(*inputs))
        _backward(outputs, grads)
        return (None, *[x.grad if x.requires_grad else None for x in inputs])


def _rerun(rng_states: Dict[str, Any], run: Callable[[], Any]) -> Any:
    """``run()`` with grad, from ``rng_states``; the generators are left as they were before."""
    now = capture_rng_states()
    restore_rng_states(rng_states)
    try:
        with torch.enable_grad():
            return run()
    finally:
        restore_rng_states(now)


def _backward(outputs, grads) -> None:
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
    pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def checkpoint(function: Callable[..., Any], *args: torch.Tensor) -> Any:
    """``function(*args)`` keeping only ``args`` for backward, which recomputes the rest with the same RNG states.

    Outside autograd (evaluation, ``torch.no_grad``) it simply calls ``function``.

    Args:
        function: takes the tensors ``args`` and returns a tensor or a tuple of tensors; other inputs (masks,
            modules) come from its closure.
        args: tensors; gradients flow to those that require them (and to parameters used inside).
    """
    if not torch.is_grad_enabled():
        return function(*args)
    return _CheckpointFunction.apply(function, *args)


def run_recorded(steps: Generator[None, None, torch.Tensor],
                 record: List[Dict[str, Any]]) -> Generator[None, None, torch.Tensor]:
    """Drives the step program ``steps`` without autograd, yielding where it yields; appends to ``record`` the RNG
    states before each step; returns its result (a tensor without a graph)."""
    while True:
        record.append(capture_rng_states())
        with torch.no_grad():
            try:
                next(steps)
            except StopIteration as done:
                return done.value
        yield


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output, make_steps, record):
        ctx.make_steps, ctx.record = make_steps, record
        ctx.save_for_backward(x)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()

        def rerun():
            steps = ctx.make_steps(x)
            for states in ctx.record:  # one state per step, restored just before it
                restore_rng_states(states)
                try:
                    next(steps)
                except StopIteration as done:
                    return done.value
            raise RuntimeError("the recomputed step program ran more steps than the recorded one")

        _backward(_rerun(ctx.record[0], rerun), (grad,))
        return x.grad, None, None, None


def replay(x: torch.Tensor, output: torch.Tensor, make_steps: Callable[[torch.Tensor], Generator],
           record: List[Dict[str, Any]]) -> torch.Tensor:
    """Attaches ``output`` (computed by ``run_recorded(make_steps(x.detach()), record)``) to the graph of ``x``:
    backward re-runs ``make_steps`` on ``x`` step by step with the recorded RNG states, then backpropagates."""
    return _Replay.apply(x, output, make_steps, record)
