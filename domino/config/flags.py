"""Megatron-style command-line flags generated from the config dataclasses.

Every dataclass field becomes one flag (``micro_batch_size`` -> ``--micro-batch-size``) whose help is
the field's docstring. Values resolve in three layers: dataclass defaults, then ``--preset NAME``,
then flags given explicitly on the command line. Like Megatron-LM's and DeepSpeed-Domino's parsers, ours never
accept an abbreviated flag (``--seq 32`` is an error, not ``--seq-length 32``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import typing
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from domino.config import legacy_flags, preset_store
from domino.config.layout import LAYERS_PER_VIRTUAL_STAGE_FLAG, virtual_stages_from_layers
from domino.config.field_docs import field_docs, flag_name
from domino.config.schema import DominoConfig
from domino.config.validate import ConfigError, advisories, resolve_domino_chunks, validate

logger = logging.getLogger(__name__)

#: Extra spellings of a field's flag: the deepspeed launcher passes ``--local_rank=N``; Megatron-LM before 2023
#: and DeepSpeed-Domino (``domino/arguments.py``) spell ``--norm-epsilon`` as ``--layernorm-epsilon``.
#: Megatron-LM since ef490839 (2025-02) spells the chunk count --num-virtual-stages-per-pipeline-rank
#: (``megatron/training/arguments.py``); its config field, Megatron-Core's too, is virtual_pipeline_model_parallel_size.
FLAG_ALIASES: Dict[str, tuple] = {"local_rank": ("--local_rank",), "norm_epsilon": ("--layernorm-epsilon",),
                                  "virtual_pipeline_model_parallel_size": ("--num-virtual-stages-per-pipeline-rank",),
                                  # Megatron's spellings (megatron/training/config/training_config.py, d98e8a64).
                                  "override_opt_param_scheduler": ("--override-opt_param-scheduler",),
                                  "use_checkpoint_opt_param_scheduler": ("--use-checkpoint-opt_param-scheduler",)}
#: The namespace attribute of --num-layers-per-virtual-pipeline-stage (no field: it derives one).
LAYERS_PER_VIRTUAL_STAGE = "num_layers_per_virtual_pipeline_stage"
#: Older names of renamed fields, still read from presets and from the configs stored in checkpoints.
RENAMED_FIELDS: Dict[str, str] = {"layernorm_epsilon": "norm_epsilon"}


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` without prefix matching (``allow_abbrev=False``), as Megatron-LM parses.

    Sub-commands made with ``add_subparsers().add_parser`` are of the same class, so the whole ``domino``
    command line rejects abbreviations.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def negated_flag(option: str) -> str:
    """The spelling that sets a boolean flag to False: ``--no-fp16`` for ``--fp16``, ``--load-optim`` for
    Megatron's ``--no-load-optim`` (whose field is ``no_load_optim``, True when the flag is given)."""
    return "--" + option[len("--no-"):] if option.startswith("--no-") else "--no-" + option[2:]


class BooleanFlag(argparse.Action):
    """A boolean flag: each spelling of the field sets True, each :func:`negated_flag` spelling sets False.

    Not ``argparse.BooleanOptionalAction``: its ``__call__`` sets ``not option_string.startswith('--no-')``
    (CPython 3.11 ``Lib/argparse.py``, ``BooleanOptionalAction.__call__``), so Megatron's ``--no-load-optim``
    and ``--no-load-rng`` (fields that mean "skip") parsed to False and were silently ignored.
    """

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        self.spellings: Dict[str, bool] = {}
        for option in option_strings:
            self.spellings[option] = True
            if option.startswith("--"):
                self.spellings[negated_flag(option)] = False
        super().__init__(list(self.spellings), dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, self.spellings[option_string])

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


def _group_classes() -> Dict[str, type]:
    hints = typing.get_type_hints(DominoConfig)
    return {group: hints[group] for group in DominoConfig.GROUPS}


def _base_type(hint: Any) -> Any:
    """``Optional[int]`` -> ``int``; other hints unchanged."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and args else hint


def config_field_types() -> Dict[str, Tuple[Any, str]]:
    """``{field: (its type without Optional, its docstring)}`` over every config group (what the kfp
    parameters that stand for config fields are checked against, see ``components/declare.py``)."""
    out = {}
    for cls in _group_classes().values():
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        for f in dataclasses.fields(cls):
            out[f.name] = (_base_type(hints[f.name]), docs.get(f.name, ""))
    return out


def _add_field(group: argparse._ArgumentGroup, f: dataclasses.Field, hint: Any, doc: str, **overrides: Any) -> None:
    """Adds the flag of field ``f``: ``--field-name``, typed by ``hint``, help ``doc``; ``overrides`` (from
    :func:`flag`) replace the derived spellings (``names``) and ``add_argument`` keywords."""
    names = overrides.pop("names", None) or (flag_name(f.name), *FLAG_ALIASES.get(f.name, ()))
    base = _base_type(hint)
    kwargs: Dict[str, Any] = {"dest": f.name, "help": doc}
    if base is bool:
        kwargs["action"] = BooleanFlag
    elif typing.get_origin(base) in (list, List):
        item = typing.get_args(base)[0]
        kwargs.update(nargs="+", type=item, metavar=getattr(item, "__name__", "VALUE").upper())
    else:
        kwargs.update(type=base, metavar=getattr(base, "__name__", "VALUE").upper())
    if "action" in overrides:  # an action of its own (append, store_true) takes only the keywords it is given
        for key in ("nargs", "type", "metavar"):
            kwargs.pop(key, None)
    if "choices" in overrides:  # the help shows the choices where no metavar is given
        kwargs.pop("metavar", None)
    kwargs.update(overrides)
    group.add_argument(*names, **kwargs)


#: The key of a field's metadata that adjusts the flag :func:`add_dataclass_flags` derives from it.
FLAG_METADATA = "flag"


def flag(*names: str, section: Optional[str] = None, exclusive: Optional[str] = None, **kwargs: Any) -> Dict[str, Any]:
    """Field metadata (``field(default=..., metadata=flag(...))``) adjusting the flag derived from the field.

    Args:
        names: The flag's spellings (default: ``--field-name``).
        section: The ``--help`` section that lists the flag.
        exclusive: A name shared by fields of which at most one flag may be given.
        kwargs: ``add_argument`` keywords replacing the derived ones (``type``, ``metavar``, ``choices``,
            ``action``; ``default`` where the flag's value is not yet the field's, e.g. a list of
            ``KEY=VALUE`` strings for a dict).
    """
    where = {key: value for key, value in (("section", section), ("exclusive", exclusive)) if value}
    return {FLAG_METADATA: {**({"names": names} if names else {}), **where, **kwargs}}


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, skip: Iterable[str] = (),
                        sections: Optional[Dict[str, str]] = None) -> None:
    """Adds one flag per field of dataclass ``cls``, so the dataclass stays the one declaration of its knobs.

    Each flag is the field's as :func:`add_config_flags` makes it (``--field-name``, typed by the annotation,
    the docstring below the field as help) with the field's default as its default (stated in the help
    unless the docstring speaks of it; a repeatable flag says so), adjusted by the field's :func:`flag`
    metadata. Fields in ``skip`` get no flag; ``sections`` maps a field to its ``--help`` section (where its
    metadata names none).
    """
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    containers: Dict[Any, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        spec = dict(f.metadata.get(FLAG_METADATA, {}))
        section, exclusive = spec.pop("section", (sections or {}).get(f.name)), spec.pop("exclusive", None)
        spec.setdefault("default", _field_default(f))
        target = parser
        if section:
            if section not in containers:
                containers[section] = parser.add_argument_group(section)
            target = containers[section]
        if exclusive:
            if (section, exclusive) not in containers:
                containers[section, exclusive] = target.add_mutually_exclusive_group()
            target = containers[section, exclusive]
        doc = " ".join(docs.get(f.name, "").split()).replace("%", "%%")  # argparse formats help with %
        default = spec["default"]
        if ("default" not in doc.lower() and default not in (None, False, [], {})
                and spec.get("action") not in ("store_true", "store_false")):
            doc += f" (default: {default})"
        if spec.get("action") == "append":
            doc += " (repeatable)"
        _add_field(target, f, hints[f.name], doc, **spec)


def add_config_flags(parser: argparse.ArgumentParser, groups: Iterable[str] = DominoConfig.GROUPS) -> None:
    """Adds ``--preset`` and one flag per field of the named config groups to ``parser``.

    Flags are added with ``default=argparse.SUPPRESS`` so that :func:`config_from_args` can tell an
    explicit flag from a default and apply presets underneath explicit flags.
    """
    parser.add_argument(
        "--preset",
        default=argparse.SUPPRESS,
        metavar="NAME",
        help=f"Start from a named preset ({', '.join(preset_store.available())}); explicit flags override it.",
    )
    classes = _group_classes()
    for name in groups:
        cls = classes[name]
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        group = parser.add_argument_group(f"{name} ({cls.__doc__.strip()})", argument_default=argparse.SUPPRESS)
        for f in dataclasses.fields(cls):
            _add_field(group, f, hints[f.name], docs.get(f.name, "").replace("%", "%%"))  # argparse formats with %
        if name == "parallel":
            group.add_argument(LAYERS_PER_VIRTUAL_STAGE_FLAG, dest=LAYERS_PER_VIRTUAL_STAGE, type=int, metavar="INT",
                               help="Layers per model chunk of the interleaved schedule (Megatron's spelling): "
                                    "sets --virtual-pipeline-model-parallel-size to num-layers / (PP x this).")
    legacy_flags.add_legacy_flags(parser, groups)


def _owner_of_fields() -> Dict[str, str]:
    owners = {}
    for group, cls in _group_classes().items():
        for f in dataclasses.fields(cls):
            owners[f.name] = group
    return owners


@functools.lru_cache(maxsize=None)
def _field_types() -> Dict[str, Any]:
    return {name: kind for cls in _group_classes().values() for name, kind in typing.get_type_hints(cls).items()}


def _fits(value: Any, kind: Any) -> bool:
    """Whether ``value`` (from JSON) is of the field type ``kind`` (the types schema.py uses): a bool is no
    number, an int is a float, and nothing is converted (``int(2.5)`` would truncate silently)."""
    if typing.get_origin(kind) is typing.Union:
        return any(_fits(value, option) for option in typing.get_args(kind))
    if typing.get_origin(kind) is list:
        return isinstance(value, list) and all(_fits(item, typing.get_args(kind)[0]) for item in value)
    if kind is type(None):
        return value is None
    if kind in (int, float):
        return isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
    return isinstance(value, kind)


def apply_overrides(config: DominoConfig, overrides: Dict[str, Any], source: str) -> DominoConfig:
    """``config`` with flat ``{field: value}`` overrides set; an unknown key, or a value not of its field's type
    (a preset or a checkpoint's config is untyped JSON), is a :class:`ConfigError`."""
    owners = _owner_of_fields()
    fields = {}
    for key, value in overrides.items():
        key = key.replace("-", "_")
        key = RENAMED_FIELDS.get(key, key)
        if key not in owners:
            raise ConfigError(f"{source}: unknown setting '{key}' (no flag {flag_name(key)})")
        kind = _field_types()[key]
        if not _fits(value, kind):
            shown = str(kind).replace("typing.", "").replace("<class '", "").replace("'>", "")
            raise ConfigError(f"{source}: setting '{key}' must be {shown}, got {value!r:.80}")
        fields[key] = value
    return config.replace(**fields)


def config_from_args(
    args: argparse.Namespace, world_size: Optional[int] = None, check: bool = True, for_training: bool = False
) -> DominoConfig:
    """Resolves defaults, the preset and explicit flags into a validated :class:`DominoConfig`."""
    config = DominoConfig()
    values = vars(args)
    preset = values.get("preset")
    if preset is not None:
        config = dataclasses.replace(apply_overrides(config, preset_store.load(preset), f"preset '{preset}'"),
                                     preset=preset)
    owners = _owner_of_fields()
    explicit = {k: v for k, v in values.items() if k in owners}
    renamed, notes = legacy_flags.translate(values, explicit)
    config = apply_overrides(config, {**explicit, **renamed}, "command line")
    if values.get(LAYERS_PER_VIRTUAL_STAGE) is not None:
        config = config.replace(virtual_pipeline_model_parallel_size=virtual_stages_from_layers(
            config, values[LAYERS_PER_VIRTUAL_STAGE], "virtual_pipeline_model_parallel_size" in explicit))
    config, chosen = resolve_domino_chunks(config)
    if check:
        validate(config, world_size=world_size, for_training=for_training)
        if os.environ.get("RANK", "0") == "0":  # one copy of each note, not one per process
            if chosen:
                logger.info("%s", chosen)
            for note in notes:
                logger.warning("%s", note)
            for note in advisories(config):
                logger.warning("%s", note)
    return config


def parse_config(
    argv: Sequence[str], world_size: Optional[int] = None, prog: str = "domino"
) -> DominoConfig:
    """Parses Megatron-style flags into a validated config (for scripts and tests)."""
    parser = ArgumentParser(prog=prog)
    add_config_flags(parser)
    return config_from_args(parser.parse_args(list(argv)), world_size=world_size)


def config_to_dict(config: DominoConfig) -> Dict[str, Any]:
    """The config as nested plain data (for checkpoints, metrics and reports)."""
    return dataclasses.asdict(config)


def config_from_dict(data: Dict[str, Any]) -> DominoConfig:
    """Inverse of :func:`config_to_dict`; unknown keys are rejected with a clear error."""
    config = DominoConfig(preset=data.get("preset"))
    for group in DominoConfig.GROUPS:
        config = apply_overrides(config, data.get(group, {}), f"config group '{group}'")
    return resolve_domino_chunks(config)[0]


def config_to_argv(config: DominoConfig, groups: Iterable[str] = DominoConfig.GROUPS) -> List[str]:
    """Flags that reproduce ``config`` when parsed (fields equal to their defaults are left out)."""
    argv: List[str] = []
    defaults = DominoConfig()
    for group in groups:
        for f in dataclasses.fields(getattr(config, group)):
            value = getattr(getattr(config, group), f.name)
            if value == getattr(getattr(defaults, group), f.name):
                continue
            if isinstance(value, bool):
                argv.append(flag_name(f.name) if value else negated_flag(flag_name(f.name)))
            elif isinstance(value, list):
                argv += [flag_name(f.name), *map(str, value)]
            elif value is not None:
                argv += [flag_name(f.name), str(value)]
    return argv
