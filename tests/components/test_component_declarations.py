"""Every component parameter is declared once: the kfp signatures, the pipeline's parameters and the
training flags all derive from the settings dataclasses, and the training knobs are the config schema's."""

import dataclasses
import inspect
import typing
from dataclasses import dataclass

import pytest

from components import declare, kfp_component, kfp_functions
from components.declare import NOT_SET, config_field, settings_parameters
from domino.config.flags import config_field_types
from pipelines.gpt_pretrain import PIPELINE_DEFAULTS, WIRED, build_pipeline

KFP_TYPES = {str: "String", int: "Integer", float: "Float", bool: "Boolean"}
#: The two config parameters whose kfp default is a value rather than "not given": the pipeline's default
#: run is 20 steps of TP 2 over its two processes (components/pretrain/settings.py says why).
GIVEN_DEFAULTS = {"train_iters": 20, "tensor_model_parallel_size": 2}


def _built(component):
    return kfp_component(getattr(kfp_functions, component.function), "img:1")


def test_the_generated_functions_are_fresh():
    with open(kfp_functions.__file__, encoding="utf-8") as handle:
        committed = handle.read()
    assert committed == declare.render(), (
        "components/kfp_functions.py is stale: run `domino pipeline compile` and commit the result")


@pytest.mark.parametrize("component", declare.declarations(), ids=lambda c: c.function)
def test_each_kfp_signature_is_its_declaration(component):
    """The function kfp reads (and ships) takes exactly the wired inputs and the declared parameters, and kfp
    compiles them with the declared types, defaults and descriptions."""
    signature = inspect.signature(getattr(kfp_functions, component.function))
    params = component.parameters()
    assert list(signature.parameters) == [i.name for i in component.inputs] + [p.name for p in params]
    inputs = _built(component).component_spec.inputs
    for p in params:
        assert signature.parameters[p.name].annotation is p.kind, p.name
        assert inputs[p.name].type == KFP_TYPES[p.kind], p.name
        assert inputs[p.name].description == p.doc, p.name
        if p.required:
            assert inputs[p.name].default is None, p.name
        else:
            assert inputs[p.name].default == p.default, p.name


def test_kfp_parameters_named_like_config_fields_are_the_config_fields():
    """Same name, same type, same description as domino/config/schema.py; default "not given" (NOT_SET, so
    the preset decides) unless the pipeline's default run names a value."""
    schema = config_field_types()
    seen = set()
    for component in declare.declarations():
        inputs = _built(component).component_spec.inputs
        for p in component.parameters():
            if p.name not in schema:
                assert not p.config, p.name
                continue
            seen.add(p.name)
            kind, doc = schema[p.name]
            assert p.config, f"{component.function}.{p.name} shadows the config field: declare it with config_field()"
            assert p.kind is kind and inputs[p.name].type == KFP_TYPES[kind], p.name
            assert inputs[p.name].description.startswith(" ".join(doc.split())), p.name
            expected = GIVEN_DEFAULTS.get(p.name, NOT_SET[kind])
            if component.function == "train_tokenizer":
                expected = "gpt2"  # passed on as it is: domino's default written out
            assert inputs[p.name].default == expected, p.name
    assert {"tensor_model_parallel_size", "domino_chunks", "zero_stage", "micro_batch_size", "global_batch_size",
            "lr", "train_iters", "split", "tokenizer", "save_interval", "eval_interval", "eval_iters",
            "log_interval"} <= seen


def test_the_pipeline_parameters_are_the_components_unwired_parameters():
    pipeline = build_pipeline("img:1").component_spec.inputs
    expected = {}
    for component in declare.declarations():
        for p in component.parameters():
            if p.name not in WIRED.get(component.function, ()):
                expected.setdefault(p.name, p)
    assert list(pipeline) == list(expected)
    for name, p in expected.items():
        assert pipeline[name].type == KFP_TYPES[p.kind], name
        assert pipeline[name].description == p.doc, name
        default = {**PIPELINE_DEFAULTS, "image": "img:1"}.get(name, None if p.required else p.default)
        assert pipeline[name].default == default, name


def test_two_declarations_of_one_pipeline_parameter_are_refused(monkeypatch):
    @dataclass(kw_only=True)
    class Other:
        preset: str = "gpt2-125m"
        """Another default for the same name."""

    real = declare.declarations()
    other = declare.Component(function="other", summary="x", settings=Other, run="x:y")
    monkeypatch.setattr(declare, "declarations", lambda: [*real, other])
    with pytest.raises(TypeError, match="pipeline parameter preset: other declares it"):
        build_pipeline("img:1")


def test_a_config_field_of_another_type_or_name_is_refused():
    @dataclass(kw_only=True)
    class WrongType:
        lr: int = config_field()

    @dataclass(kw_only=True)
    class NoSuchField:
        learning_rate: float = config_field()

    with pytest.raises(TypeError, match="WrongType.lr: int, but the config field is float"):
        settings_parameters(WrongType)
    with pytest.raises(TypeError, match="NoSuchField.learning_rate: config_field.. names no field"):
        settings_parameters(NoSuchField)


def test_config_values_leave_out_what_is_not_given():
    from components.pretrain.settings import PretrainSettings

    settings = PretrainSettings(shared_root="/s", run_id="r", zero_stage=0, lr=-1.0, split="", global_batch_size=None)
    values = declare.config_values(settings)
    assert values["zero_stage"] == 0 and values["tensor_model_parallel_size"] == 2 and values["train_iters"] == 20
    assert not {"lr", "split", "global_batch_size", "micro_batch_size"} & set(values)
    hints = typing.get_type_hints(PretrainSettings)
    assert all(hints[f.name] in KFP_TYPES for f in dataclasses.fields(PretrainSettings))


@dataclass(kw_only=True)
class _PlainSettings:
    knob: int = 1
    """A knob."""


@dataclass(kw_only=True)
class _QuotingSettings:
    knob: int = 1
    """A knob whose description holds \"\"\" quotes."""


@pytest.mark.parametrize("where", ["parameter", "summary", "returns"])
def test_a_text_that_would_end_the_generated_docstring_is_refused(where):
    """Every text that goes into the generated function's docstring: a parameter's, the summary, the returns."""
    bad = 'Quotes """ inside.'
    component = declare.Component(function="f", settings=_QuotingSettings if where == "parameter" else _PlainSettings,
                                  run="m:f", summary=bad if where == "summary" else "Does f.",
                                  returns=("str", bad) if where == "returns" else ("None", ""))
    with pytest.raises(ValueError, match="would end the generated docstring"):
        declare.function_source(component)
