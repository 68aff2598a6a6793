"""A counting probe for host reads of tensor values (each one a device sync on a GPU), measurable on CPU.

On a GPU every ``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``, ``.cpu()`` or boolean-mask index waits
for the device queue to drain, so a training step that does one per micro-batch leaves the GPU idle while
Python catches up. CUDA's own detector (``torch.cuda.set_sync_debug_mode``) needs a GPU; this probe counts
the Python-level reads that cause those syncs on any device, by wrapping the ``torch.Tensor`` methods that
read values, and attributes each read to the first caller outside torch (domino, deepspeed or other) and to
the phase of the training loop it happened in (``step``: inside an iteration; ``log``/``evaluate``/``save``:
the interval work; ``setup``: before the loop).

It also counts explicit waits for the device: ``torch.cuda.synchronize`` and the ``synchronize`` of
DeepSpeed's accelerators (``deepspeed/accelerator/*_accelerator.py``; the CPU one is a no-op, so on CPU this is
the only way to see, say, DeepSpeed's ThroughputTimer synchronising twice per micro-batch). CUDA's own
detector, ``torch.cuda.set_sync_debug_mode("warn")``, does not see those (it warns from inside the ops that
synchronise), which is why ``benchmarks/gpu_check.py`` wraps them with :func:`explicit_synchronizes` as well.

It sees what Python asks for, not what a kernel does internally (e.g. ``torch.nonzero`` inside an op written
in C++), nor copies of Python numbers to a device; on a GPU, ``torch.cuda.set_sync_debug_mode("warn")`` sees
those too.

Run a probed ``domino pretrain`` (alone or under torchrun; each rank writes ``OUT.rank<R>.json``)::

    python -m domino.cli.host_syncs OUT pretrain --preset tiny --mock-data ...
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib
import json
import os
import sys
import traceback
import types
import warnings
from typing import Callable, Dict, Iterator, List, Optional

import torch

#: ``torch.Tensor`` methods that copy a value to the host (all of them synchronise a CUDA tensor).
READ_METHODS = ("item", "tolist", "numpy", "cpu", "nonzero", "__float__", "__int__", "__bool__", "__index__")
#: Methods of the training loop (``domino.train.pretrain._Trainer``) that name a phase, innermost wins.
PHASES = {"_log": "log", "_evaluate": "evaluate", "_save": "save", "_termination_requested": "log",
          "_loader": "setup", "_run": "step"}

_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)


@functools.lru_cache(maxsize=1)
def _domino_dir() -> str:
    """The imported ``domino`` package (run as a script, this file may measure another checkout's)."""
    import domino

    return os.path.dirname(os.path.abspath(domino.__file__))


def _owner(filename: str) -> str:
    if filename.startswith(_domino_dir() + os.sep):
        return "domino"
    if f"{os.sep}deepspeed{os.sep}" in filename:
        return "deepspeed"
    return "other"


def _where(frame) -> str:
    """``package/path.py:line function`` of a frame (paths from the site-packages or repository root)."""
    filename = os.path.abspath(frame.f_code.co_filename)
    for root in (os.path.dirname(_domino_dir()), os.path.dirname(_TORCH_DIR)):
        if filename.startswith(root + os.sep):
            filename = os.path.relpath(filename, root)
            break
    return f"{filename}:{frame.f_lineno} {frame.f_code.co_name}"


def _is_bool_index(index) -> bool:
    """Whether indexing with ``index`` needs the number of True elements (a host read on CUDA)."""
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in items)


class HostSyncProbe:
    """Counts host reads of tensor values while active (a context manager; not thread-safe).

    Attributes:
        events: ``(phase, owner, "file:line function", method)`` -> count.
    """

    def __init__(self) -> None:
        self.events: Dict[tuple, int] = collections.Counter()
        self._saved: Dict[str, Callable] = {}
        self._inside = False

    def _record(self, method: str) -> None:
        if self._inside:  # a read made by a read (e.g. __bool__ calling item) counts once
            return
        frame = sys._getframe(2)
        caller = None
        phase = None
        while frame is not None:
            filename = os.path.abspath(frame.f_code.co_filename)
            if caller is None and filename != _THIS_FILE and not filename.startswith(_TORCH_DIR):
                caller = frame
            name = frame.f_code.co_name
            if phase is None and name in PHASES and filename.endswith(os.path.join("train", "pretrain.py")):
                phase = PHASES[name]
            frame = frame.f_back
        if caller is None:
            return
        self.events[(phase or "setup", _owner(os.path.abspath(caller.f_code.co_filename)), _where(caller),
                     method)] += 1

    def _wrap(self, method: str, original: Callable) -> Callable:
        probe = self

        def wrapper(tensor, *args, **kwargs):
            probe._record(method)
            probe._inside, was_inside = True, probe._inside
            try:
                return original(tensor, *args, **kwargs)
            finally:
                probe._inside = was_inside

        return wrapper

    def _wrap_index(self, method: str, original: Callable) -> Callable:
        probe = self

        def wrapper(tensor, index, *args):
            if not probe._inside and _is_bool_index(index):
                probe._record(method + "[bool mask]")
            return original(tensor, index, *args)

        return wrapper

    def __enter__(self) -> "HostSyncProbe":
        for method in READ_METHODS:
            self._saved[method] = getattr(torch.Tensor, method)
            setattr(torch.Tensor, method, self._wrap(method, self._saved[method]))
        for method in ("__getitem__", "__setitem__"):
            self._saved[method] = getattr(torch.Tensor, method)
            setattr(torch.Tensor, method, self._wrap_index(method, self._saved[method]))
        self._synchronizes = explicit_synchronizes(lambda: self._record("synchronize"), self)
        self._synchronizes.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._synchronizes.__exit__(*exc)
        for method, original in self._saved.items():
            setattr(torch.Tensor, method, original)
        self._saved.clear()

    def count(self, phase: Optional[str] = None, owner: Optional[str] = None) -> int:
        """Reads in ``phase`` by ``owner`` (``None``: any)."""
        return sum(n for (p, o, _, _), n in self.events.items()
                   if (phase is None or p == phase) and (owner is None or o == owner))

    def to_json(self) -> List[dict]:
        """The events as a list of records, most frequent first."""
        return [{"phase": p, "owner": o, "where": w, "method": m, "count": n}
                for (p, o, w, m), n in sorted(self.events.items(), key=lambda kv: -kv[1])]


def _synchronize_owners() -> List[tuple]:
    """``(owner object, attribute)`` of every explicit device wait to wrap: torch.cuda's and DeepSpeed's
    accelerator classes' (those that import here)."""
    owners = [(torch.cuda, "synchronize")]
    for module, name in (("deepspeed.accelerator.cuda_accelerator", "CUDA_Accelerator"),
                         ("deepspeed.accelerator.cpu_accelerator", "CPU_Accelerator")):
        try:
            owners.append((getattr(importlib.import_module(module), name), "synchronize"))
        except Exception:  # DeepSpeed absent, or an accelerator that cannot import on this machine
            continue
    return owners


@contextlib.contextmanager
def explicit_synchronizes(record: Callable[[], None], guard=None) -> Iterator[None]:
    """Calls ``record()`` before every explicit device wait (``torch.cuda.synchronize``, DeepSpeed's
    ``accelerator.synchronize()``) made inside the block; a wait made by a wait (DeepSpeed's CUDA accelerator
    calls torch's) is recorded once. ``guard``: an object whose ``_inside`` flag marks a recorded call in
    progress (the probe's), so reads made inside a wait are not counted again."""
    state = guard if guard is not None else types.SimpleNamespace(_inside=False)
    saved = []

    def wrap(original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if not state._inside:
                record()
            state._inside, was_inside = True, state._inside
            try:
                return original(*args, **kwargs)
            finally:
                state._inside = was_inside

        return wrapper

    for owner, attribute in _synchronize_owners():
        original = owner.__dict__[attribute] if isinstance(owner, type) else getattr(owner, attribute)
        saved.append((owner, attribute, original))
        setattr(owner, attribute, wrap(original))
    try:
        yield
    finally:
        for owner, attribute, original in reversed(saved):
            setattr(owner, attribute, original)


def _caller() -> str:
    """``file:line`` of the innermost frame outside torch and this file."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_TORCH_DIR) and os.path.abspath(frame.filename) != _THIS_FILE:
            return f"{os.path.relpath(frame.filename)}:{frame.lineno}"
    return "?"


def syncs_per_step(step: Callable[[], object], steps: int) -> Dict[str, object]:
    """Runs ``step()`` ``steps`` times and counts the device syncs it makes, with their sites.

    On CUDA: the warnings of ``torch.cuda.set_sync_debug_mode("warn")`` (syncs inside ops, value reads
    included) plus the explicit synchronize calls that mode does not see (:func:`explicit_synchronizes`).
    Elsewhere: the host reads and synchronize calls of :class:`HostSyncProbe`.

    Returns:
        ``{"per_iteration": float, "where": {site: per iteration}, "method": str}``.
    """
    where: collections.Counter = collections.Counter()
    if not torch.cuda.is_available():
        with HostSyncProbe() as probe:
            for _ in range(steps):
                step()
        for event in probe.to_json():
            where[f"{event['where']} ({event['method']})"] += event["count"]
        method = "host-read probe (CPU)"
    else:
        explicit: collections.Counter = collections.Counter()
        with warnings.catch_warnings(record=True) as caught, explicit_synchronizes(
                lambda: explicit.update([_caller()])):
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(steps):
                    step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for w in caught:
            if "synchroniz" in str(w.message).lower():
                where[f"{os.path.relpath(w.filename)}:{w.lineno}"] += 1
        for site, n in explicit.items():
            where[f"{site} (synchronize)"] += n
        method = "torch.cuda.set_sync_debug_mode('warn') + explicit synchronize calls"
    return {"per_iteration": sum(where.values()) / steps,
            "where": {k: v / steps for k, v in where.most_common(12)}, "method": method}


def run_probed(out: str, entry: Callable[[List[str]], object], args: List[str]) -> int:
    """Runs ``entry(args)`` (the ``domino`` CLI's ``main``, see ``domino/cli/host_syncs.py``) under the probe
    and writes this rank's counts to ``OUT.rank<R>.json``; returns the entry's exit status."""
    code = 0
    with HostSyncProbe() as probe:
        try:
            entry(args)
        except SystemExit as done:  # the CLI always exits with its verb's status
            code = done.code
    with open(f"{out}.rank{os.environ.get('RANK', '0')}.json", "w") as f:
        json.dump(probe.to_json(), f, indent=1)
    return code or 0
