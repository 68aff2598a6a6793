"""``domino pipeline``: compile, run locally, submit and schedule the Kubeflow pipeline.

Thin: the handlers live in ``pipelines.cli`` and are imported only when a pipeline command runs, so the
rest of ``domino`` never imports kfp.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Callable


def _lazy(name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        cli = importlib.import_module("pipelines.cli")
        return cli.guarded(getattr(cli, name))(args)

    return run


def _add_param_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--param", action="append", metavar="NAME=VALUE",
                        help="Set a pipeline parameter (repeatable); `domino pipeline params` lists them.")


def _add_server_flags(parser: argparse.ArgumentParser, experiment_default: str | None = "domino") -> None:
    parser.add_argument("--host", required=True, help="Kubeflow Pipelines API endpoint, e.g. http://localhost:8080.")
    parser.add_argument("--namespace", help="Kubeflow profile namespace (multi-user deployments); also the "
                        "training job's namespace unless --param namespace=... is given.")
    parser.add_argument("--experiment", default=experiment_default, help="Experiment name.")
    parser.add_argument("--token-file", help="File holding a bearer token for the API (default: $KFP_TOKEN, else "
                        "none). Never sent over plain http to a non-local host.")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``domino pipeline {compile,run,submit,schedule,schedules,params}``."""
    parser = subparsers.add_parser("pipeline", help="Compile, run locally, submit or schedule the training pipeline.",
                                   description=__doc__.splitlines()[0])
    verbs = parser.add_subparsers(dest="pipeline_command", metavar="SUBCOMMAND", required=True)

    p = verbs.add_parser("compile", help="Write the compiled pipeline YAML.")
    p.add_argument("--output", help="Output file (default: pipelines/gpt_pretrain.yaml).")
    p.add_argument("--image", help="Image of every step and of the training job (default: the domino images of this version in "
                        "$DOMINO_IMAGE_REPOSITORY, see domino/images.py).")
    p.add_argument("--step-node-selector", action="append", metavar="KEY=VALUE",
                   help="Node selector of the step pods (repeatable).")
    p.add_argument("--step-toleration", action="append", metavar="KEY[=VALUE][:EFFECT]",
                   help="Toleration of the step pods (repeatable).")
    p.add_argument("--eval-gpus", type=int, default=0, help="GPUs for the evaluate step (default: 0, CPU).")
    p.add_argument("--mlflow-credentials", action="store_true",
                   help="Steps read MLFLOW_TRACKING_USERNAME/PASSWORD/TOKEN from the Secret domino-mlflow.")
    p.add_argument("--preprocess-parallelism", type=int, default=0, metavar="N",
                   help="most preprocess tasks of the shard-group ParallelFor running at once (default: 0, one "
                        "per group)")
    p.set_defaults(func=_lazy("compile_command"))

    p = verbs.add_parser("run", help="Run the whole pipeline on this machine (kfp.local, local training job).")
    p.add_argument("--output-dir", default="demo-output", help="Folder for everything the run writes.")
    p.add_argument("--quick", action="store_true",
                   help="A ~30 s plumbing run with the pipeline's defaults (tiny model, GPT-2 tokenizer, 20 "
                        "iterations) instead of the demo that learns Shakespeare in about 5 minutes.")
    _add_param_flag(p)
    p.set_defaults(func=_lazy("run_command"))

    p = verbs.add_parser("submit", help="Start one run on a Kubeflow Pipelines server.")
    _add_server_flags(p)
    p.add_argument("--run-name", help="Display name of the run.")
    p.add_argument("--package", help="Submit this compiled pipeline file instead of compiling the checkout's.")
    p.add_argument("--service-account", help="Service account of the run's pods (needs rights on PyTorchJobs).")
    _add_param_flag(p)
    p.set_defaults(func=_lazy("submit_command"))

    p = verbs.add_parser("schedule", help="Create a recurring run (max_concurrency=1, no catch-up).")
    _add_server_flags(p)
    p.add_argument("--cron", required=True, help="6-field cron, seconds first, e.g. '0 0 3 * * 0' (Sundays 03:00).")
    p.add_argument("--name", default="gpt-pretrain-schedule", help="Display name of the recurring run.")
    p.add_argument("--package", help="Schedule this compiled pipeline file instead of compiling the checkout's.")
    p.add_argument("--service-account", help="Service account of the runs' pods.")
    p.add_argument("--disabled", action="store_true", help="Create the recurring run disabled.")
    _add_param_flag(p)
    p.set_defaults(func=_lazy("schedule_command"))

    p = verbs.add_parser("schedules", help="List or delete recurring runs.")
    actions = p.add_subparsers(dest="schedules_command", metavar="ACTION", required=True)
    q = actions.add_parser("list", help="List recurring runs.")
    _add_server_flags(q, experiment_default=None)
    q.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
    q.set_defaults(func=_lazy("schedules_list_command"))
    q = actions.add_parser("delete", help="Delete a recurring run.")
    _add_server_flags(q, experiment_default=None)
    q.add_argument("id", help="Recurring run id (see `schedules list`).")
    q.set_defaults(func=_lazy("schedules_delete_command"))

    p = verbs.add_parser("params", help="List the pipeline's run parameters.")
    p.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
    p.add_argument("--markdown", action="store_true", help="Print the Markdown table of docs/pipeline.md.")
    p.set_defaults(func=_lazy("params_command"))
