"""Command-line flags for a :class:`~domino.launch.spec.JobSpec` (shared by ``render``, ``submit``, ``check`` and
``smoke``), derived from its fields.

Each field is one flag, made by :func:`domino.config.flags.add_dataclass_flags` as the training config's flags
are: ``--field-name``, the field's docstring as help, its default; the field's ``flag(...)`` metadata in
``spec.py`` gives a flag another spelling, its choices or makes it repeatable (``--env KEY=VALUE``).
:func:`spec_from_args` turns the parsed values back into the fields' types.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import typing
from typing import Any, Dict, List, Optional

from domino import images
from domino.config.flags import FLAG_METADATA, add_dataclass_flags, flag_name
from domino.launch.spec import JobSpec, LaunchSpecError, Toleration, default_namespace, parse_key_values

#: Fields with no flag: the pretrain arguments come after ``--``; the UID is the image's.
NO_FLAG = ("pretrain_args", "run_as_user")
#: The ``--help`` section of each field.
SECTIONS: Dict[str, str] = {
    **dict.fromkeys(("name", "image", "namespace", "owner", "command"), "job"),
    **dict.fromkeys(("nodes", "nproc_per_node", "gpus_per_node", "cpu_request", "cpu_limit", "memory_request",
                     "memory_limit", "gpu_memory_gb", "parallel_layout", "shm_size", "rdma_resources"), "resources"),
    **dict.fromkeys(("pvc", "mount_path", "checkpoint_dir"), "storage"),
    **dict.fromkeys(("node_selector", "tolerations", "gpu_toleration", "priority_class", "image_pull_secrets",
                     "image_pull_policy", "service_account", "queue", "scheduling_policy"), "scheduling"),
    **dict.fromkeys(("env", "secret_env", "env_from_secrets", "labels", "annotations"), "metadata"),
    **dict.fromkeys(("restart_policy", "backoff_limit", "termination_grace_period_s", "start_timeout_s",
                     "active_deadline_seconds", "ttl_seconds_after_finished", "clean_pod_policy"), "failure policy"),
}


def add_spec_flags(parser: argparse.ArgumentParser) -> None:
    """Adds one flag per :class:`JobSpec` field and ``--run-id``; ``-- ARGS`` after them are the ``domino
    pretrain`` flags."""
    parser.add_argument("--run-id", default=None,
                        help="Run identifier (default: random); the same id yields the same job name, so a retry "
                             "adopts its own job.")
    add_dataclass_flags(parser, JobSpec, skip=NO_FLAG, sections=SECTIONS)
    parser.add_argument("pretrain_args", nargs=argparse.REMAINDER,
                        help="'--' then the domino pretrain flags, e.g. -- --preset tiny --train-iters 100")


def _flag_of(f: dataclasses.Field) -> str:
    names = f.metadata.get(FLAG_METADATA, {}).get("names")
    return names[0] if names else flag_name(f.name)


def _field_value(f: dataclasses.Field, hint: Any, value: Any) -> Any:
    """The value of field ``f`` from its parsed flag: ``KEY=VALUE`` items into a dict, toleration strings into
    :class:`Toleration`, the ``--command`` string split as a shell would."""
    origin = typing.get_origin(hint)
    if origin in (dict, Dict):
        return parse_key_values(value, _flag_of(f))
    if hint == List[Toleration]:
        return [Toleration.parse(text) for text in value]
    if origin in (list, List):
        return list(value)
    if f.name == "command":
        return shlex.split(value) if value else None
    if f.name == "shm_size":
        return value or None  # --shm-size '': no /dev/shm volume of the job's own
    return value


def spec_from_args(args: argparse.Namespace, pretrain_args: Optional[List[str]] = None) -> JobSpec:
    """Builds (and validates) the :class:`JobSpec` from parsed flags."""
    extra = list(pretrain_args if pretrain_args is not None else (args.pretrain_args or []))
    if extra and extra[0] == "--":
        extra = extra[1:]
    hints = typing.get_type_hints(JobSpec)
    values = {f.name: _field_value(f, hints[f.name], getattr(args, f.name))
              for f in dataclasses.fields(JobSpec) if f.name not in NO_FLAG}
    values["image"] = values["image"] or images.for_gpus(values["gpus_per_node"])
    values["namespace"] = values["namespace"] or default_namespace()
    spec = JobSpec(**values, pretrain_args=extra)
    spec.validate()
    return spec


__all__ = ["LaunchSpecError", "add_spec_flags", "spec_from_args"]
