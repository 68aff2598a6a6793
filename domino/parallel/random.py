"""Tensor-parallel-aware random numbers (Megatron's RNG tracker, on CPU or CUDA).

Dropout on tensors that every TP rank holds in full (embeddings, the residual stream) must draw the same
mask on every rank, or the replicas drift apart; dropout on tensors split across ranks (attention
probabilities of this rank's heads) must draw *different* masks, or the ranks repeat one mask over all heads.
So the default generator is seeded identically on all TP ranks, and a second, named state seeded per TP rank
is swapped in with ``get_rng_tracker().fork()`` around the split regions.

``get_rng_state()`` / ``set_rng_state()`` capture everything random (python, numpy, torch CPU, CUDA, and the
tracker's named states) for checkpoints, so a resumed run draws the same numbers as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import random
from typing import Any, Dict, Iterator

import numpy as np
import torch


MODEL_PARALLEL_RNG = "model-parallel-rng"
"""Name of the tracker state used inside tensor-parallel regions."""

_TP_SEED_OFFSET = 2718  # Megatron's offset, so the TP stream never coincides with the default stream


def _device_get_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()


def _device_set_state(new_state: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(new_state)
    else:
        torch.set_rng_state(new_state)


class RNGStatesTracker:
    """Named generator states that can be swapped in for the device's default generator."""

    def __init__(self) -> None:
        self._states: Dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        """Forgets every named state."""
        self._states = {}

    def add(self, name: str, seed: int) -> None:
        """Creates the state ``name`` seeded with ``seed``.

        Raises:
            ValueError: when ``name`` already exists.
        """
        if name in self._states:
            raise ValueError(f"RNG state {name!r} already exists")
        saved = _device_get_state()
        if torch.cuda.is_available():
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self._states[name] = _device_get_state()
        _device_set_state(saved)

    def get_states(self) -> Dict[str, torch.Tensor]:
        """A copy of all named states."""
        return {name: s.clone() for name, s in self._states.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        """Replaces all named states (e.g. from a checkpoint)."""
        self._states = {name: s.clone() for name, s in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Runs the block with the named state as the device's default generator, then restores it.

        Raises:
            KeyError: when ``name`` was never added (call :func:`model_parallel_seed` first).
        """
        if name not in self._states:
            raise KeyError(f"RNG state {name!r} is not set; call domino.parallel.random.model_parallel_seed(seed)")
        saved = _device_get_state()
        _device_set_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = _device_get_state()
            _device_set_state(saved)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker."""
    return _TRACKER


def model_parallel_seed(seed: int, tp_rank: int = 0, cp_rank: int = 0, tp_size: int = 1) -> None:
    """Seeds every generator for training.

    The default generators (python, numpy, torch, CUDA) get ``seed`` on every TP rank, so replicated tensors
    see identical randomness; the tracker's TP state gets ``seed + 2718 + tp_rank`` (``tp_rank``: this process's
    place in its TP group, ``ParallelMesh.tp.rank``), Megatron's rule, plus ``tp_size x cp_rank`` on context-parallel
    rank ``cp_rank`` > 0: those ranks hold other tokens (and, exchanged over heads, other heads' whole sequence), so
    their split regions must draw other masks too (the TP state drives only dropout; weights initialise from the
    default generators, the same on every CP rank). Callers that want different data-parallel replicas to differ
    add their DP rank to ``seed`` themselves.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + tp_rank + tp_size * cp_rank)


#: Whether the process runs inside :func:`tp_region_rng`'s fork (the TP stream is current).
_in_tp_region = False


@contextlib.contextmanager
def tp_region_rng(active: bool = True) -> Iterator[None]:
    """``fork()`` of the TP state when it exists and ``active``; otherwise a no-op context.

    Lets modules without dropout (or processes that never seeded the tracker, e.g. inference) run unchanged.
    Inside another ``tp_region_rng`` a no-op: the TP stream is already current, and an inner fork would give the
    outer one back the state it started from (the draws in between repeated next time). While Dynamo traces, a
    no-op too: a graph cannot swap generator states (Dynamo refuses ``torch.get_rng_state``/``set_rng_state``,
    which AOT autograd would drop: torch 2.13 ``torch/_dynamo/trace_rules.py``), so whoever calls a compiled region that
    draws the TP stream's dropout forks around the whole call (:func:`domino.parallel.kernels.run_compiled`; the
    compiled graph seeds its random numbers from the generator current when it runs).
    """
    global _in_tp_region
    if torch.compiler.is_compiling() or _in_tp_region or not active or MODEL_PARALLEL_RNG not in _TRACKER._states:
        yield  # already on the TP stream (a nested fork would put back the state the outer one started from)
        return
    _in_tp_region = True
    try:
        with _TRACKER.fork():
            yield
    finally:
        _in_tp_region = False


def device_rng_state(device: torch.device) -> torch.Tensor:
    """The state of the generator that draws on ``device`` (the CPU's, or that CUDA device's)."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


@contextlib.contextmanager
def replaying_rng(state: torch.Tensor, device: torch.device) -> Iterator[None]:
    """Runs the block with ``device``'s generator at ``state`` (from :func:`device_rng_state`), so that it draws
    again what was drawn from there, then puts the generator back as it was."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if device.type == "cuda":
            torch.cuda.set_rng_state(state, device)
        else:
            torch.set_rng_state(state)
        yield


def get_rng_state() -> Dict[str, Any]:
    """Every random state of this process, for a checkpoint."""
    snapshot: Dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": _TRACKER.get_states(),
    }
    if torch.cuda.is_available():
        snapshot["cuda"] = torch.cuda.get_rng_state_all()
    return snapshot


def set_rng_state(snapshot: Dict[str, Any]) -> None:
    """Restores what :func:`get_rng_state` captured (CUDA states only when both sides have CUDA)."""
    random.setstate(snapshot["python"])
    np.random.set_state(snapshot["numpy"])
    torch.set_rng_state(snapshot["torch"])
    if torch.cuda.is_available() and "cuda" in snapshot:
        torch.cuda.set_rng_state_all(snapshot["cuda"])
    _TRACKER.set_states(snapshot.get("tracker", {}))


def capture_rng_states() -> Dict[str, Any]:
    """What dropout draws from, right now: the CPU and CUDA default generators and the tracker's named states.

    Recompute restores these before re-running a block, so its dropout masks equal the first run's.
    """
    states: Dict[str, Any] = {"cpu": torch.get_rng_state(), "tracker": _TRACKER.get_states()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def restore_rng_states(states: Dict[str, Any]) -> None:
    """Makes the generators continue from ``states`` (from :func:`capture_rng_states`)."""
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])
    _TRACKER.set_states(states["tracker"])
