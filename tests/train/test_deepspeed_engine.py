"""domino's engine subclass (domino.optim.deepspeed_engine) builds its optimizer subclasses exactly as DeepSpeed's
engine builds its own classes, and is built exactly as ``deepspeed.initialize`` builds DeepSpeed's engine: each
call is compared with the DeepSpeed 0.19.8 source it copies (``runtime/engine.py``, ``deepspeed/__init__.py``), so
a DeepSpeed release that adds, drops or changes an argument fails here rather than training differently."""

import ast
import inspect
import textwrap

import pytest
import torch


def _calls(function, callee):
    """The calls to ``callee`` (a name) in ``function``'s source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == callee]


def _arguments(call):
    """A call's positional arguments and ``{keyword: expression}``, as source text."""
    return [ast.unparse(a) for a in call.args], {k.arg: ast.unparse(k.value) for k in call.keywords}


def _the_call(function, callee):
    calls = _calls(function, callee)
    assert len(calls) == 1, (function.__qualname__, callee, len(calls))
    return calls[0]


@pytest.mark.parametrize("method, theirs, ours", [
    ("_configure_bf16_optimizer", "BF16_Optimizer", "DeviceDecidedBF16Optimizer"),
    ("_configure_zero_optimizer", "Stage1And2ZeroOptimizer", "DeviceDecidedZeroOptimizer"),
])
def test_the_optimizer_subclasses_get_deepspeeds_own_arguments(method, theirs, ours):
    from deepspeed.runtime.engine import DeepSpeedEngine

    from domino.optim.deepspeed_engine import DominoDeepSpeedEngine

    deepspeed_args = _arguments(_the_call(getattr(DeepSpeedEngine, method), theirs))
    assert _arguments(_the_call(getattr(DominoDeepSpeedEngine, method), ours)) == deepspeed_args
    assert len(deepspeed_args[1]) > 5  # the comparison saw the real call


@pytest.mark.parametrize("cls_path, theirs, left_at_default", [
    ("deepspeed.runtime.bf16_optimizer.BF16_Optimizer", "BF16_Optimizer", {"norm_type": 2}),
    ("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer", "Stage1And2ZeroOptimizer", {"verbose": True}),
])
def test_deepspeed_passes_every_constructor_parameter_but_known_defaults(cls_path, theirs, left_at_default):
    """A parameter DeepSpeed's constructor gains is one the engine's call (and ours) must be checked for; the ones
    it leaves at their defaults are known (``norm_type`` 2 is the 2-norm the device-decided bf16 step computes)."""
    import importlib

    from deepspeed.runtime.engine import DeepSpeedEngine

    module, _, name = cls_path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    parameters = inspect.signature(cls.__init__).parameters
    method = "_configure_bf16_optimizer" if name == "BF16_Optimizer" else "_configure_zero_optimizer"
    positional, keywords = _arguments(_the_call(getattr(DeepSpeedEngine, method), theirs))
    passed = set(list(parameters)[1:1 + len(positional)]) | set(keywords)
    unpassed = {p: parameters[p].default for p in list(parameters)[1:] if p not in passed}
    assert unpassed == left_at_default


#: What deepspeed.initialize calls, in order, on its path for a plain module without hybrid engine.
INITIALIZE_STEPS = ["shutdown_init_context", "init_distributed", "merge_tp_model_init_into_config", "DeepSpeedConfig",
                    "set_optimizer_flags", "restore_init_context", "_configure_python_gc"]


def _called_names(function):
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    calls = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset))
    names = [getattr(c.func, "id", getattr(c.func, "attr", None)) for c in calls]
    return [n for n in names if n in INITIALIZE_STEPS]


def test_initialize_makes_deepspeeds_calls_and_builds_the_engine_with_its_arguments():
    import deepspeed

    from domino.optim import deepspeed_engine

    # Each first occurrence: the pipeline branch repeats DeepSpeedConfig and set_optimizer_flags.
    assert list(dict.fromkeys(_called_names(deepspeed.initialize))) == INITIALIZE_STEPS
    assert _called_names(deepspeed_engine.initialize) == INITIALIZE_STEPS
    engine_calls = _calls(deepspeed.initialize, "DeepSpeedEngine")
    assert len(engine_calls) == 1
    (ours,) = _calls(deepspeed_engine.initialize, "DominoDeepSpeedEngine")
    assert set(_arguments(ours)[1]) == set(_arguments(engine_calls[0])[1])
    config_call = next(c for c in _calls(deepspeed.initialize, "DeepSpeedConfig") if c.keywords)
    assert [k.arg for k in config_call.keywords] == ["mesh_device"]  # ours passes None: no mesh device


def test_the_device_loss_scaler_is_a_new_scaler_with_every_value_of_deepspeeds():
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from domino.optim.deepspeed_subclasses import DeviceLossScaler
    from domino.optim.device_loss_scale import DEVICE_FIELDS

    theirs = DynamicLossScaler(init_scale=2.0**8, scale_window=5, min_scale=1.0, delayed_shift=3,
                               consecutive_hysteresis=True, raise_error_at_min_scale=False)
    theirs.cur_iter, theirs.cur_hysteresis, theirs.last_overflow_iter = 7, 2, 4
    ours = DeviceLossScaler.like(theirs, "cpu")
    assert type(theirs) is DynamicLossScaler and ours is not theirs  # nothing reassigned on DeepSpeed's object
    assert vars(ours).keys() == vars(theirs).keys()
    for name, value in vars(theirs).items():
        mine = getattr(ours, name)
        if name in DEVICE_FIELDS:
            assert isinstance(mine, torch.Tensor) and mine.dtype == DEVICE_FIELDS[name] and mine.item() == value
        else:
            assert mine == value, name
