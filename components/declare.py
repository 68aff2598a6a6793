"""Every component's parameters, declared once; the kfp functions are generated from the declarations.

A component is declared by a :class:`Component`: its kfp function's name, a typed settings dataclass (one
field with a docstring per parameter; the same class the plain-Python ``step.py`` takes), the inputs the
pipeline wires (artifacts, task outputs) and the glue its body calls. :func:`render` turns the declarations
into ``components/kfp_functions.py``, a real, greppable file (``def pretrain(`` ...), which
``domino pipeline compile`` regenerates beside ``pipelines/gpt_pretrain.yaml`` and a test checks is fresh.

Why a generated file rather than a signature made at import time: kfp 2.17.3 reads a lightweight
component's interface from ``inspect.signature(func)`` (``kfp/dsl/component_factory.py``,
``extract_component_interface``; a ``__signature__`` would do), but ships ``inspect.getsource(func)`` to the
container (``_get_function_source_definition``); there ``kfp/dsl/executor_main.py`` loads that source as a
module and ``kfp/dsl/executor.py`` (``Executor.execute``) passes only the parameters that the loaded
function's own ``inspect.getfullargspec`` annotates. So the parameters must exist as source text. A
containerized component (``target_image``) would import our real module instead, but kfp.local's
``SubprocessRunner``, which the local demo uses, refuses those (``kfp/local/subprocess_task_handler.py``,
``validate_not_containerized_python_component``).

Why sentinels instead of ``Optional[...] = None``: kfp 2.17.3 cannot carry a ``None`` parameter. Under
kfp.local a pipeline parameter defaulting to ``None`` fails in ``kfp/local/executor_output_utils.py``
(``pb2_value_to_python``: "Unknown value type") and an optional integer left unset in
``kfp/local/executor_input_utils.py`` (``int(None)``); a task given ``None`` fails its type check
(``kfp/dsl/pipeline_task.py``). kubeflow/pipelines#13636 (open) adds ``None`` literals. So a config
field the run may leave unset takes :data:`NOT_SET` of its type, and :func:`config_values` turns those
back into "flag not given" in this one place.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import typing
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple, Union

from domino.config.flags import config_field_types
from domino.config.field_docs import field_docs
from domino.launch.spec import JobSpec

#: The value that stands for "not given" (the preset's value, else domino's default) per kfp type.
NOT_SET: Dict[type, Any] = {int: -1, float: -1.0, str: ""}
#: The declared components, in the order the generated file lists them.
COMPONENT_MODULES = ("components.tokenizer.component", "components.preprocess.component",
                     "components.merge.component", "components.pretrain.component",
                     "components.evaluate.component", "components.promote.component",
                     "components.cleanup.component")
_KFP_TYPES = {str: "str", int: "int", float: "float", bool: "bool"}


def config_field(default: Any = None) -> Any:
    """A settings field that is the domino config field of the same name (``domino/config/schema.py``).

    Its type must be the config field's (``Optional`` removed: kfp has no ``None``), its description is the
    config field's docstring, and its default is ``default`` or, when omitted, :data:`NOT_SET` of its type
    ("not given": the preset's value, else domino's default, exactly as when ``domino pretrain`` is run
    without the flag).
    """
    return dataclasses.field(default=default, metadata={"config": True})


#: How a :class:`~domino.launch.JobSpec` value of None travels as a kfp parameter: '' for a name or quantity,
#: -1 for a count, 0.0 for a float (a size, where 0 means none).
JOB_NONE: Dict[type, Any] = {str: "", int: -1, float: 0.0}


def job_kind(name: str) -> type:
    """The kfp type of JobSpec field ``name``: ``Optional`` removed, a dict or list as JSON text, a count or
    a word (``Union[int, str]``) as the count."""
    hint = typing.get_type_hints(JobSpec)[name]
    if typing.get_origin(hint) is Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return str if typing.get_origin(hint) in (dict, list) else hint


def job_default(name: str) -> Any:
    """JobSpec field ``name``'s default as a kfp parameter value (:data:`JOB_NONE` for None, JSON for a dict or
    list); a field without a plain default (required, or computed when the job is made) is "none"."""
    f = next(f for f in dataclasses.fields(JobSpec) if f.name == name)
    value = None
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory in (dict, list):
        value = f.default_factory()
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return JOB_NONE[job_kind(name)] if value is None else value


def job_field(spec_field: str, default: Any = dataclasses.MISSING) -> Any:
    """A settings field that is :class:`~domino.launch.JobSpec` field ``spec_field``, so the job's knobs keep one
    set of defaults.

    Its type must be :func:`job_kind`'s and its default is :func:`job_default`'s, unless ``default`` is given:
    an override the pipeline's default run needs (``components/pretrain/settings.py`` keeps those in one
    place). Its description is the settings field's docstring, which says how kfp carries the value.
    """
    value = job_default(spec_field) if default is dataclasses.MISSING else default
    return dataclasses.field(default=value, metadata={"job": spec_field})


@dataclass(frozen=True)
class Input:
    """An input the pipeline wires (an artifact or another task's output), declared with its kfp annotation."""

    name: str
    annotation: str
    doc: str


@dataclass(frozen=True)
class Parameter:
    """One parameter of a component, as derived from its settings field."""

    name: str
    kind: type
    default: Any
    doc: str
    config: bool

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING


@dataclass(frozen=True)
class Component:
    """One kfp component: its function, its typed settings and the inputs the pipeline wires.

    Attributes:
        function: Name of the kfp function (kfp names the component after it: ``promote_model`` ->
            ``promote-model``).
        summary: The first line of the function's docstring (kfp's component description).
        settings: The dataclass whose fields are the component's parameters.
        run: ``module:function`` that the body calls with every input and parameter as keywords.
        inputs: Wired inputs, listed before the parameters.
        returns: The function's return annotation and its description ('' for None).
    """

    function: str
    summary: str
    settings: type
    run: str
    inputs: Tuple[Input, ...] = ()
    returns: Tuple[str, str] = ("None", "")

    def parameters(self) -> List[Parameter]:
        """The settings fields as parameters (type, default and description resolved)."""
        return settings_parameters(self.settings)


def _docs(cls: type) -> Dict[str, str]:
    docs: Dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            docs.update(field_docs(base))
    return {name: " ".join(doc.split()) for name, doc in docs.items()}


def settings_parameters(cls: type) -> List[Parameter]:
    """The fields of settings dataclass ``cls`` as :class:`Parameter` objects, in declaration order.

    Raises:
        TypeError: a field whose type kfp cannot carry, or a config field that is no config field or has
            another type than the config's.
    """
    hints = typing.get_type_hints(cls)
    docs = _docs(cls)
    config_types = config_field_types()
    out = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if kind not in _KFP_TYPES:
            raise TypeError(f"{cls.__name__}.{f.name}: type {kind} is not a kfp parameter type (str, int, float, bool)")
        is_config = bool(f.metadata.get("config"))
        default, doc = f.default, docs.get(f.name, "")
        if "job" in f.metadata and job_kind(f.metadata["job"]) is not kind:
            raise TypeError(f"{cls.__name__}.{f.name}: {kind.__name__}, but JobSpec.{f.metadata['job']} travels as "
                            f"{job_kind(f.metadata['job']).__name__}")
        if is_config:
            if f.name not in config_types:
                raise TypeError(f"{cls.__name__}.{f.name}: config_field() names no field of domino/config/schema.py")
            if config_types[f.name][0] is not kind:
                raise TypeError(f"{cls.__name__}.{f.name}: {kind.__name__}, but the config field is "
                                f"{config_types[f.name][0].__name__}")
            doc = " ".join(config_types[f.name][1].split())
            if default is None:
                default = NOT_SET[kind]
            doc += f" ({NOT_SET[kind]!r}: not given, the preset's value or domino's default)"
        if not doc:
            raise TypeError(f"{cls.__name__}.{f.name}: no docstring below the field")
        out.append(Parameter(f.name, kind, default, doc, is_config))
    return out


def settings_from_values(cls: type, values: Dict[str, Any]) -> Any:
    """An instance of settings dataclass ``cls`` from keyword values; keys that are no field are ignored."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})


def config_values(settings: Any) -> Dict[str, Any]:
    """``{config field: value}`` of the config fields of ``settings`` that are given (neither None, as Python
    callers write it, nor :data:`NOT_SET`, as kfp passes it)."""
    out = {}
    for p in settings_parameters(type(settings)):
        value = getattr(settings, p.name)
        if p.config and value is not None and value != NOT_SET[p.kind]:
            out[p.name] = value
    return out


def function_source(component: Component) -> str:
    """The source of ``component``'s kfp function: every input and parameter, its docstring, a body that
    calls ``component.run`` with all of them."""
    params = [f"{i.name}: {i.annotation}" for i in component.inputs]
    docs = [(i.name, i.doc) for i in component.inputs]
    for p in component.parameters():
        params.append(f"{p.name}: {_KFP_TYPES[p.kind]}" + ("" if p.required else f" = {p.default!r}"))
        docs.append((p.name, p.doc))
    for name, doc in docs + [("summary", component.summary), ("returns", component.returns[1])]:
        if '"""' in doc or doc.endswith("\\"):
            raise ValueError(f"{component.function}.{name}: its description would end the generated docstring")
    module, function = component.run.split(":")
    lines = [f"def {component.function}(", "    *,", *(f"    {p}," for p in params),
             f") -> {component.returns[0]}:", f'    r"""{component.summary}', "", "    Args:"]
    lines += [f"        {name}: {doc}" for name, doc in docs]
    if component.returns[1]:
        lines += ["", "    Returns:", f"        {component.returns[1]}"]
    lines += ['    """', "    values = dict(locals())",
              f"    from {module} import {function}", "", f"    return {function}(**values)"]
    return "\n".join(lines) + "\n"


def declarations() -> List[Component]:
    """Every declared component (``COMPONENT`` of each module in :data:`COMPONENT_MODULES`)."""
    out: List[Component] = []
    for name in COMPONENT_MODULES:
        module = importlib.import_module(name)
        out += list(getattr(module, "COMPONENTS"))
    return out


HEADER = '''"""The kfp functions of every component. GENERATED from the declarations in components/*/component.py
by components/declare.py (run `domino pipeline compile`); do not edit. kfp ships each function's source to
its container, so the signatures are written out here (see components/declare.py for why)."""

from typing import List

from kfp.dsl import HTML, Artifact, Dataset, Input, Metrics, Model, Output, PipelineTaskFinalStatus
'''


def render() -> str:
    """The text of ``components/kfp_functions.py``."""
    return HEADER + "".join("\n\n" + function_source(c) for c in declarations())


def write(path: str) -> str:
    """Writes :func:`render` to ``path`` atomically and returns the path."""
    from domino.atomic_files import atomic_write_text

    atomic_write_text(path, render())
    return path
