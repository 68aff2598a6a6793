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

It also counts device tensors made from Python numbers (``torch.tensor``, ``torch.as_tensor``,
``torch.scalar_tensor`` with an explicit ``device``, and ``Tensor.new_tensor``, whose target is the tensor's
device): on a GPU each is a copy from pageable host memory, which the host waits for
(pytorch/pytorch#120996), and ``set_sync_debug_mode`` does not flag it. On a CPU-only machine the device the
training runs on is the CPU, so every explicit ``device`` argument is counted whatever it names (DeepSpeed's
CPU accelerator names its device ``"cpu"``, as code meant for a GPU passes ``"cuda:0"``); with a GPU only
non-CPU targets count. Their method names end in :data:`DEVICE_COPY` (``torch.tensor->device``), so they are
told apart from host reads. ``torch.full``/``fill_`` and arithmetic with a Python scalar are not counted: the
number travels as a kernel argument, no copy is made (``aten/src/ATen/native/Fill.cpp``, torch 2.13).

It sees what Python asks for, not what a kernel does internally (e.g. ``torch.nonzero`` inside an op written
in C++), nor ``.to(device)`` of a host tensor (on a CPU-only machine the same call moves nothing);
on a GPU, ``torch.cuda.set_sync_debug_mode("warn")`` sees the syncs among those.

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
import types
import warnings
from typing import Callable, Dict, Iterator, List, Optional

import torch

#: ``torch.Tensor`` methods that copy a value to the host (all of them synchronise a CUDA tensor).
READ_METHODS = ("item", "tolist", "numpy", "cpu", "nonzero", "__float__", "__int__", "__bool__", "__index__")
#: Suffix of the method name of a device tensor made from Python numbers (a host-to-device copy on a GPU).
DEVICE_COPY = "->device"
#: ``torch`` constructors that copy Python data to the ``device`` they are given.
CONSTRUCTORS = ("tensor", "as_tensor", "scalar_tensor")
#: Methods of the training loop (``domino.train.trainer.Trainer``) that name a phase, innermost wins.
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


def _targets_device(device) -> bool:
    """Whether a constructor's ``device`` argument would be a host-to-device copy (module docstring)."""
    if device is None:
        return False
    return not torch.cuda.is_available() or torch.device(device).type != "cpu"


def is_device_copy(method: str) -> bool:
    """Whether an event's ``method`` is a device tensor made from Python numbers (not a host read)."""
    return method.endswith(DEVICE_COPY)


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
            if phase is None and name in PHASES and filename.endswith(os.path.join("train", "trainer.py")):
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

    def _wrap_constructor(self, name: str, original: Callable, method: bool = False) -> Callable:
        probe = self

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            data = args[1 if method else 0] if len(args) > (1 if method else 0) else kwargs.get("data")
            device = kwargs.get("device")
            if method and device is None and args:
                device = args[0].device  # new_tensor makes its tensor on the tensor's own device
            if not probe._inside and not isinstance(data, torch.Tensor) and _targets_device(device):
                probe._record(name + DEVICE_COPY)
            return original(*args, **kwargs)

        return wrapper

    def __enter__(self) -> "HostSyncProbe":
        for name in CONSTRUCTORS:
            self._saved["torch." + name] = getattr(torch, name)
            setattr(torch, name, self._wrap_constructor("torch." + name, self._saved["torch." + name]))
        self._saved["new_tensor"] = torch.Tensor.new_tensor
        torch.Tensor.new_tensor = self._wrap_constructor("Tensor.new_tensor", self._saved["new_tensor"], True)
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
            setattr(torch, method[len("torch."):], original) if method.startswith("torch.") else setattr(
                torch.Tensor, method, original)
        self._saved.clear()

    def count(self, phase: Optional[str] = None, owner: Optional[str] = None,
              device_copies: Optional[bool] = None) -> int:
        """Events in ``phase`` by ``owner`` (``None``: any); ``device_copies`` True: only device tensors made
        from Python numbers, False: only host reads and synchronizes, None: both."""
        return sum(n for (p, o, _, m), n in self.events.items()
                   if (phase is None or p == phase) and (owner is None or o == owner)
                   and (device_copies is None or is_device_copy(m) == device_copies))

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


#: torch's one-time notice when the sync debug mode is first set: not a sync (it matches "synchroniz").
DEBUG_MODE_NOTICE = "synchronization debug mode is a prototype feature"


def syncs_per_step(step: Callable[[], object], steps: int) -> Dict[str, object]:
    """Runs ``step()`` ``steps`` times and counts the device syncs it makes, with their sites.

    On CUDA: the warnings of ``torch.cuda.set_sync_debug_mode("warn")`` (syncs inside ops, value reads
    included, but not torch's notice that the mode is a prototype) plus the explicit synchronize calls that mode
    does not see. Elsewhere: the host reads and synchronize calls of :class:`HostSyncProbe`. Both: the device
    tensors made from Python numbers (host-to-device copies the host waits for), counted apart.

    Returns:
        ``{"per_iteration": float, "device_copies_per_iteration": float, "where": {site: per iteration},
        "method": str}``.
    """
    where: collections.Counter = collections.Counter()
    copies = 0
    cuda = torch.cuda.is_available()
    with warnings.catch_warnings(record=True) as caught, HostSyncProbe() as probe:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    for event in probe.to_json():
        if is_device_copy(event["method"]):
            copies += event["count"]
        elif cuda and event["method"] != "synchronize":
            continue  # on CUDA the debug mode's warnings count the reads
        where[f"{event['where']} ({event['method']})"] += event["count"]
    if cuda:
        for w in caught:
            message = str(w.message).lower()
            if "synchroniz" in message and DEBUG_MODE_NOTICE not in message:
                where[f"{os.path.relpath(w.filename)}:{w.lineno}"] += 1
    method = ("torch.cuda.set_sync_debug_mode('warn') + explicit synchronize calls" if cuda
              else "host-read probe (CPU)") + " + device tensors from Python numbers"
    return {"per_iteration": (sum(where.values()) - copies) / steps, "device_copies_per_iteration": copies / steps,
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
