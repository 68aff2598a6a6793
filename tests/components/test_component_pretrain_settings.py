"""The pretrain step's parameters are composed from JobSpec and the training schema: each job knob is a
``job_field`` of the JobSpec field it sets (its type and default, in kfp's encoding), each training knob a
``config_field``, and the pipeline's default run differs from them only where PIPELINE_RUN says."""

import dataclasses
import json
import typing
from dataclasses import dataclass

import pytest

from components.declare import JOB_NONE, NOT_SET, job_field, settings_parameters
from components.pretrain.settings import PIPELINE_RUN, PretrainSettings
from domino.config.flags import config_field_types
from domino.launch.spec import JobSpec

FIELDS = dataclasses.fields(PretrainSettings)
JOB_FIELDS = {f.name: f.metadata["job"] for f in FIELDS if "job" in f.metadata}
SPEC = {f.name: f for f in dataclasses.fields(JobSpec)}


def _spec_default(name):
    f = SPEC[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory in (dict, list) else None


def test_the_job_knobs_have_the_jobspecs_defaults():
    assert len(JOB_FIELDS) >= 24
    kinds = typing.get_type_hints(PretrainSettings)
    for f in FIELDS:
        if f.name not in JOB_FIELDS:
            continue
        if f.name in PIPELINE_RUN:
            assert f.default == PIPELINE_RUN[f.name], f.name
            continue
        expected = _spec_default(JOB_FIELDS[f.name])
        if isinstance(expected, (dict, list)):
            assert json.loads(f.default) == expected, f.name
        elif expected is None:
            assert f.default == JOB_NONE[kinds[f.name]], f.name  # kfp has no None
        else:
            assert f.default == expected, f.name


def test_the_training_knobs_are_the_presets_unless_the_pipeline_run_says():
    schema = config_field_types()
    config = [p for p in settings_parameters(PretrainSettings) if p.config]
    assert len(config) >= 13
    for p in config:  # NOT_SET: not given, the preset (else domino's default) decides
        assert p.default == PIPELINE_RUN.get(p.name, NOT_SET[schema[p.name][0]]), p.name


def test_no_jobspec_field_is_declared_again():
    """A parameter named like a JobSpec field (other than the run's pretrain arguments) sets that field."""
    for f in FIELDS:
        if f.name in SPEC:
            assert JOB_FIELDS.get(f.name) == f.name, f"{f.name}: declare it with job_field({f.name!r})"
    # The overrides are few and each one is a parameter of this step.
    assert set(PIPELINE_RUN) <= {f.name for f in FIELDS}


def test_a_job_field_of_another_type_is_refused():
    @dataclass(kw_only=True)
    class WrongType:
        nodes: str = job_field("nodes", "1")
        """Pods."""

    with pytest.raises(TypeError, match="WrongType.nodes: str, but JobSpec.nodes travels as int"):
        settings_parameters(WrongType)
