"""The optimizer's state by parameter name, whichever optimizer holds it: what a layout-free checkpoint stores.

For every trainable parameter ``NAME`` (its name in the model's state dict) three fp32 tensors, each this
tensor-parallel rank's whole slice of the parameter, whatever the data-parallel size or ZeRO stage::

    fp32.NAME         the master weight
    exp_avg.NAME      Adam's first moment
    exp_avg_sq.NAME   Adam's second moment

and, shared by all parameters, Adam's step count and the loss scaler's fields (:class:`Scalars`).
:mod:`domino.checkpoint.distributed_io` stores whole slices by their global shape; a ZeRO rank's own fragments of
them (:func:`local_fragments`) are stored as they are by :mod:`domino.checkpoint.fragment_io`, and any layout reads
either.

Two kinds of optimizer hold them (checked against DeepSpeed 0.19.8 and torch 2.13):

* ZeRO stages 1 and 2, and DeepSpeed's ``BF16_Optimizer``: each data-parallel rank owns a fragment of a flat
  fp32 partition; every parameter carries ``_hp_mapping``. DeepSpeed's own accessors,
  ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` (an all-reduce over the parameter's
  data-parallel group) and ``safe_set_full_*`` (each rank copies its fragment out of the full tensor), convert
  between the fragments and the full slice (``deepspeed/utils/tensor_fragment.py``). Adam's state exists only
  after the first step (``_lazy_init_hp_params_optimizer_state``, ``runtime/zero/stage_1_and_2.py``), so
  loading creates it first, as torch's Adam would.
* torch AdamW itself (ZeRO stage 0): in fp32 the parameter is its own master weight; with bf16/fp16 weights
  the optimizer's ``masters`` maps each to its fp32 master (:mod:`domino.optim.mixed_precision`), and its
  ``loss_scaler`` is fp16's. The moments live in ``optimizer.state[master]`` (``torch/optim/adam.py``).

An optimizer offering neither (DeepSpeed's fp16 optimizer without ZeRO, ``FP16_Optimizer``, which runs no longer
build: fp16 at ZeRO 0 is domino's own) would keep the per-rank optimizer files of format 1 (:func:`supports`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from domino.pipeline.stages import stored_name

#: What each parameter's slice is stored as, in this order.
STATE_KEYS = ("fp32", "exp_avg", "exp_avg_sq")

TensorsByName = Dict[str, torch.Tensor]


@dataclass
class Scalars:
    """The optimizer state that is one number per run, not a tensor per parameter (``checkpoint.json``)."""

    step: int = 0
    """Adam's step count (the same for every parameter: domino has no frozen or late-added parameters)."""
    loss_scaler: Dict[str, float] = field(default_factory=dict)
    """The loss scaler's plain fields (``cur_scale``, ``cur_iter``, ``last_overflow_iter``, ...), fp16 only."""

    def to_json(self) -> dict:
        return {"step": self.step, "loss_scaler": dict(self.loss_scaler)}

    @classmethod
    def from_json(cls, data: dict, source: str) -> "Scalars":
        """Reads the ``optimizer`` object of ``checkpoint.json``; ``ValueError`` names ``source`` when malformed."""
        step, scaler = data.get("step"), data.get("loss_scaler", {})
        if not isinstance(step, int) or isinstance(step, bool) or step < 0 or not isinstance(scaler, dict) or not all(
                isinstance(v, (bool, int, float)) for v in scaler.values()):
            raise ValueError(f"{source}: field optimizer must hold a non-negative integer step and a loss_scaler "
                             f"object of numbers, got {str(data)[:120]}")
        return cls(step, scaler)


def _zero_like(training) -> bool:
    return any(hasattr(p, "_hp_mapping") for p in training.module.parameters())


def supports(training) -> bool:
    """Whether this run's optimizer state can be stored by name (ZeRO 1/2, BF16_Optimizer or plain AdamW)."""
    return _zero_like(training) or isinstance(training.inner, torch.optim.Optimizer)


def trainable(training) -> Iterator[Tuple[str, torch.nn.Parameter]]:
    """The parameters the optimizer updates, by state-dict name, in the model's order (the same on every rank of a
    pipeline stage); a last pipeline stage's copy of the tied embeddings goes by the embeddings' name (its state
    is theirs: :func:`domino.pipeline.stages.stored_name`)."""
    return ((stored_name(name, p), p) for name, p in training.module.named_parameters() if p.requires_grad)


def _base_optimizer(training) -> torch.optim.Optimizer:
    """The torch optimizer doing the update: ZeRO's and BF16_Optimizer's inner one, or the plain AdamW."""
    return training.inner.optimizer if _zero_like(training) else training.inner


def _step_count(optimizer: torch.optim.Optimizer) -> int:
    for entry in optimizer.state.values():
        if "step" in entry:
            return int(entry["step"])  # one host read per save
    return 0  # no step taken yet (or every one skipped before the optimizer ever ran)


def loss_scaler_fields(scaler) -> Dict[str, float]:
    """A loss scaler's numbers by field name (``{}`` for None): DeepSpeed's keep Python numbers, domino's device
    scaler 0-d tensors (:mod:`domino.optim.device_loss_scale`), read here once per save. Assigning them back by
    name restores either kind."""
    fields: Dict[str, float] = {}
    for key, value in (vars(scaler).items() if scaler is not None else ()):
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            value = value.item()
        if isinstance(value, (bool, int, float)):
            fields[key] = value
    return fields


def _loss_scaler(training) -> Optional[object]:
    """The optimizer's own loss scaler (domino's ZeRO 0 fp16) or its DeepSpeed wrapper's, else None."""
    return getattr(training, "loss_scaler", None) or getattr(training.inner, "loss_scaler", None)


def _master(training, param: torch.nn.Parameter) -> torch.Tensor:
    """The fp32 tensor torch's optimizer steps for ``param``: its master (16-bit weights), else itself."""
    masters = getattr(training, "masters", None)
    return masters[param] if masters else param


def _loss_scaler_fields(training) -> Dict[str, float]:
    return loss_scaler_fields(_loss_scaler(training))


def _link_stepped_groups(training) -> Dict[int, bool]:
    """Points every parameter's fragment at Adam's moments; returns, by ``id(param)``, whether it has any.

    DeepSpeed 0.19.8's ZeRO links the fragments once, after stepping the first parameter group only
    (``stage_1_and_2.py``: ``_optimizer_step(group_no)`` runs ``_lazy_init_hp_params_optimizer_state`` after each
    group's step, and the first call marks all groups linked), so the parameters of domino's second group (biases
    and norms) never see their moments through ``safe_get_full_optimizer_state``. Linking again once every group
    has its state mends that; BF16_Optimizer steps all groups at once and links them all anyway.
    """
    zero = training.inner
    base = zero.optimizer
    groups = getattr(zero, "bit16_groups", None) or zero.bf16_groups
    stepped = [all("exp_avg" in base.state.get(p, {}) for p in group["params"]) for group in base.param_groups]
    if all(stepped):
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()
    return {id(p): stepped[i] for i, group in enumerate(groups) for p in group}


def copy_to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A synchronous fp32 copy on the CPU, sharing no memory with ``tensor`` (the next step updates it in place)."""
    return tensor.detach().to("cpu", torch.float32, copy=True)


def gather(training, keep: Callable[[int], bool] = lambda index: True,
           to_host: Callable[[torch.Tensor], torch.Tensor] = copy_to_cpu) -> Tuple[TensorsByName, Scalars]:
    """The optimizer state of the parameters this rank keeps, each as its whole TP-local slices, on the host.

    Collective over each data-parallel group: with ZeRO every rank of the group takes part in every parameter's
    gathering (its fragments are summed over the group), and every rank could keep the result. ``keep(index)``
    (the parameter's position in :func:`trainable`) chooses which to keep, so the replicas of a group can share
    the writing and each hold only its share on the host. ``to_host`` makes each kept fp32 host copy (an
    asynchronous save passes one into pinned memory that does not wait for the device).

    A snapshot calls it only for an optimizer holding whole slices (torch's AdamW at ZeRO 0); under ZeRO it takes
    :func:`local_fragments`, and the gathering path stays as the independent reader of what an optimizer holds
    (the resume tests' probe) and as ``benchmarks/snapshot.py``'s baseline.
    """
    optimizer, tensors = _base_optimizer(training), {}
    zero = _zero_like(training)
    stepped = _link_stepped_groups(training) if zero else {}
    if zero:  # DeepSpeed's own accessors of its fragments (a torch optimizer holds whole tensors)
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    for index, (name, param) in enumerate(trainable(training)):
        if zero:
            values = [safe_get_full_fp32_param(param)]
            for key in STATE_KEYS[1:]:
                # A group never stepped has no moments yet: zeros, as torch's Adam creates them. The choice is the
                # same on every rank of the group (they step together), so the all-reduce inside is matched.
                values.append(safe_get_full_optimizer_state(param, key) if stepped[id(param)]
                              else torch.zeros_like(param, dtype=torch.float32))
        else:
            master = _master(training, param)
            entry = optimizer.state.get(master, {})
            values = [master.detach()] + [entry.get(key, torch.zeros_like(master)) for key in STATE_KEYS[1:]]
        if keep(index):
            for key, value in zip(STATE_KEYS, values):
                tensors[f"{key}.{name}"] = to_host(value.detach().to(torch.float32))
    return tensors, Scalars(_step_count(optimizer), _loss_scaler_fields(training))


@dataclass(frozen=True)
class Fragment:
    """The part of one parameter's state a ZeRO rank holds: elements ``[start, start + len(data))`` of its TP-local
    slice (of shape ``shape``) flattened, as a 1-D fp32 host copy."""

    data: torch.Tensor
    start: int
    shape: Tuple[int, ...]


def holds_fragments(training) -> bool:
    """Whether each data-parallel rank holds only fragments of the state (ZeRO 1/2, BF16_Optimizer)."""
    return _zero_like(training)


def local_fragments(training, to_host: Callable[[torch.Tensor], torch.Tensor] = copy_to_cpu
                    ) -> Tuple[Dict[str, Fragment], Scalars]:
    """This rank's own fragments of the optimizer state (ZeRO runs: :func:`holds_fragments`), by ``KEY.NAME``, each
    copied to the host by ``to_host``; nothing is collective.

    Where :func:`gather` all-reduces every parameter's three tensors over its data-parallel group (DeepSpeed's
    ``safe_get_full_*``), a rank here copies the flat fragments DeepSpeed's ``_hp_mapping`` points at (its fp32
    partition and Adam's moments, ``deepspeed/utils/tensor_fragment.py``) and their place in the parameter
    (``lp_fragment_address``): what ``get_full_hp_param`` would scatter into its all-reduce buffer. A parameter
    with no elements in this rank's partition has no fragment here, nor has a last pipeline stage's copy of the
    tied embeddings (its stage's partition cuts it elsewhere than the first stage's, whose fragments are kept).
    """
    stepped = _link_stepped_groups(training)
    fragments: Dict[str, Fragment] = {}
    for name, param in training.module.named_parameters():
        mapping = getattr(param, "_hp_mapping", None)
        if not param.requires_grad or mapping is None or mapping.lp_fragment_address.numel == 0:
            continue
        if stored_name(name, param) != name:
            continue  # a last stage's tied copy: the first stage's embeddings write this state (cut otherwise)
        start, numel = mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel
        for key in STATE_KEYS:
            if key == "fp32" or stepped[id(param)]:
                value = to_host(mapping.get_hp_fragment(None if key == "fp32" else key).detach().reshape(-1))
            else:  # a group never stepped: zero moments, as torch's Adam creates them
                value = torch.zeros(numel, dtype=torch.float32)
            fragments[f"{key}.{name}"] = Fragment(value, start, tuple(param.shape))
    return fragments, Scalars(_step_count(_base_optimizer(training)), _loss_scaler_fields(training))


def empty_like_state(training, names: Optional[Iterable[str]] = None) -> TensorsByName:
    """CPU fp32 tensors of the shapes :func:`gather` returns (for the parameters ``names``, default all), to be
    filled by a checkpoint read."""
    wanted = None if names is None else set(names)
    return {f"{key}.{name}": torch.zeros(param.shape, dtype=torch.float32)
            for name, param in trainable(training) if wanted is None or name in wanted for key in STATE_KEYS}


def batches(training, max_bytes: int) -> List[List[str]]:
    """The trainable parameters' names in consecutive groups of at most ``max_bytes`` of state (or one parameter),
    the same on every rank of the run (the same model order and TP-local shapes), so each group is one collective
    read whose host memory stays bounded."""
    groups: List[List[str]] = [[]]
    size = 0
    for name, param in trainable(training):
        nbytes = len(STATE_KEYS) * param.numel() * 4
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return [g for g in groups if g]


def _fresh_step(group: dict, param: torch.Tensor, step: int) -> torch.Tensor:
    """A step tensor as torch's Adam creates it (``torch/optim/adam.py`` ``_init_group``: on the parameter's
    device for fused or capturable groups, else a CPU scalar)."""
    if group.get("fused") or group.get("capturable"):
        return torch.full((), float(step), dtype=torch.float32, device=param.device)
    return torch.tensor(float(step), dtype=torch.float32)


def _create_state(optimizer: torch.optim.Optimizer, step: int) -> None:
    """Gives every parameter of ``optimizer`` Adam's state (zero moments) at ``step``, replacing what it had."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            optimizer.state[param] = {"step": _fresh_step(group, param, step),
                                      "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                                      "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format)}


def prepare(training, scalars: Scalars) -> None:
    """Gives the optimizer fresh Adam state at the checkpoint's step and the loss scaler its fields; :func:`fill`
    then sets the tensors. Call after the model's weights are loaded (ZeRO's ``refresh_fp32_params`` would
    overwrite the master weights with the rounded model weights otherwise)."""
    _create_state(_base_optimizer(training), scalars.step)
    if _zero_like(training):
        training.inner._hp_optimizer_states_linked = False
        training.inner._lazy_init_hp_params_optimizer_state()  # points each fragment at the new moments
    scaler = _loss_scaler(training)
    if scaler is not None:
        for key, value in scalars.loss_scaler.items():
            if hasattr(scaler, key):
                setattr(scaler, key, value)


def fill(training, tensors: TensorsByName) -> None:
    """Loads the slices :func:`gather` produced (possibly on another layout) for the parameters ``tensors`` holds
    into this run's optimizer, after :func:`prepare`. Nothing here is collective."""
    optimizer, zero = _base_optimizer(training), _zero_like(training)
    if zero:  # DeepSpeed's own accessors of its fragments (a torch optimizer holds whole tensors)
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    with torch.no_grad():
        for name, param in trainable(training):
            if f"fp32.{name}" not in tensors:
                continue
            fp32, exp_avg, exp_avg_sq = (tensors[f"{key}.{name}"].to(param.device) for key in STATE_KEYS)
            if zero:
                safe_set_full_fp32_param(param, fp32)
                safe_set_full_optimizer_state(param, exp_avg, "exp_avg")
                safe_set_full_optimizer_state(param, exp_avg_sq, "exp_avg_sq")
            else:
                master = _master(training, param)  # the 16-bit weights are the checkpoint's already
                master.copy_(fp32)
                optimizer.state[master]["exp_avg"].copy_(exp_avg)
                optimizer.state[master]["exp_avg_sq"].copy_(exp_avg_sq)
