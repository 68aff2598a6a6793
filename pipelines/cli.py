"""Handlers of ``domino pipeline ...`` (argument parsing lives in ``domino/cli/pipeline.py``).

Each handler takes the parsed namespace and returns an exit code; bad input (parameters, cron, paths)
is reported as one ``error:`` line naming the flag, with exit code 2, before anything is sent or run.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Dict, List, Optional

from pipelines.params import check_training_config, markdown_table, parse_param_args, pipeline_parameters


def _params(args: argparse.Namespace) -> Dict[str, Any]:
    values = parse_param_args(args.param or [])
    check_training_config(values)
    return values


def compile_command(args: argparse.Namespace) -> int:
    """``domino pipeline compile``: regenerates ``components/kfp_functions.py`` from the component
    declarations, then writes the compiled pipeline YAML."""
    import importlib

    from components import declare, kfp_functions
    from domino.launch.spec import Toleration, parse_key_values
    from pipelines.gpt_pretrain import COMPILED_PATH, StepPlacement, compile_pipeline

    declare.write(kfp_functions.__file__)
    importlib.reload(kfp_functions)  # the components build from the module's new functions

    placement = StepPlacement(
        node_selector=parse_key_values(args.step_node_selector or [], "--step-node-selector"),
        tolerations=[_toleration_kwargs(Toleration.parse(t)) for t in args.step_toleration or []],
        eval_gpus=args.eval_gpus, mlflow_credentials=args.mlflow_credentials,
    )
    if args.eval_gpus < 0:
        raise ValueError(f"--eval-gpus: must be >= 0, got {args.eval_gpus}")
    path = compile_pipeline(args.output or COMPILED_PATH, image=args.image, placement=placement,
                            preprocess_parallelism=args.preprocess_parallelism)
    print(f"compiled pipeline to {path}")
    return 0


def _toleration_kwargs(toleration: Any) -> Dict[str, str]:
    data = toleration.to_dict()
    return {k: v for k, v in data.items() if v != ""}


def run_command(args: argparse.Namespace) -> int:
    """``domino pipeline run``: the whole pipeline locally (kfp.local + the local launcher backend), with the
    demo's settings (or the pipeline's defaults with ``--quick``) under the ``--param`` values.

    Without a ``mlflow_tracking_uri`` parameter the run tracks to ``$MLFLOW_TRACKING_URI`` when it is set
    (MLflow's own convention, as ``domino pretrain`` and ``domino evaluate`` read it)."""
    import os

    from domino.tracking import TRACKING_URI_ENV
    from pipelines.local_run import DEMO_PARAMS, QUICK_PARAMS, run_local

    profile = QUICK_PARAMS if getattr(args, "quick", False) else DEMO_PARAMS
    given = parse_param_args(args.param or [])
    if "mlflow_tracking_uri" not in given and os.environ.get(TRACKING_URI_ENV):
        given["mlflow_tracking_uri"] = os.environ[TRACKING_URI_ENV]
    values = {**profile, **given}
    check_training_config(values)
    run_local(args.output_dir, values)
    return 0


def submit_command(args: argparse.Namespace) -> int:
    """``domino pipeline submit``: one run on a Kubeflow Pipelines server."""
    from pipelines.kfp_client import make_client, submit, token_from

    params = _params(args)
    client = make_client(args.host, args.namespace, token_from(args.host, args.token_file))
    done = submit(client, params, namespace=args.namespace, experiment=args.experiment, run_name=args.run_name,
                  package=args.package, service_account=args.service_account)
    print(f"submitted run {done.id} (experiment {done.experiment_id or args.experiment})")
    return 0


def schedule_command(args: argparse.Namespace) -> int:
    """``domino pipeline schedule``: a recurring run (max_concurrency=1, no catch-up)."""
    from pipelines.cron import validate_cron
    from pipelines.kfp_client import make_client, schedule, token_from

    cron = validate_cron(args.cron)
    params = _params(args)
    client = make_client(args.host, args.namespace, token_from(args.host, args.token_file))
    done = schedule(client, cron, params, name=args.name, namespace=args.namespace, experiment=args.experiment,
                    package=args.package, service_account=args.service_account, enabled=not args.disabled)
    print(f"created recurring run {done.id} '{done.name}' ({cron}; max_concurrency=1, no catch-up) "
          f"in experiment {done.experiment_id}")
    return 0


def schedules_list_command(args: argparse.Namespace) -> int:
    """``domino pipeline schedules list``."""
    from pipelines.kfp_client import list_schedules, make_client, token_from

    rows = list_schedules(make_client(args.host, args.namespace, token_from(args.host, args.token_file)), args.namespace, args.experiment)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    _print_table(rows, ["id", "name", "schedule", "status", "max_concurrency", "no_catchup"])
    return 0


def schedules_delete_command(args: argparse.Namespace) -> int:
    """``domino pipeline schedules delete ID``."""
    from pipelines.kfp_client import delete_schedule, make_client, token_from

    delete_schedule(make_client(args.host, args.namespace, token_from(args.host, args.token_file)), args.id)
    print(f"deleted recurring run {args.id}")
    return 0


def params_command(args: argparse.Namespace) -> int:
    """``domino pipeline params``: the run parameters with types, defaults and descriptions."""
    rows = [{"name": p.name, "type": p.type, "default": json.dumps(p.default), "description": p.description}
            for p in pipeline_parameters().values()]
    if args.json:
        print(json.dumps(rows, indent=2))
    elif getattr(args, "markdown", False):
        print(markdown_table(), end="")
    else:
        _print_table(rows, ["name", "type", "default", "description"])
    return 0


def _print_table(rows: List[Dict[str, Any]], columns: List[str]) -> None:
    if not rows:
        print("(none)")
        return
    widths = {c: max(len(c), *(len(str(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns).rstrip())
    for row in rows:
        print("  ".join(str(row.get(c)).ljust(widths[c]) for c in columns).rstrip())


def guarded(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Wraps a handler: bad input (any ``ValueError``: parameters, cron, job settings, config) prints one
    ``error:`` line and exits 2; a failed local step (``RuntimeError`` from kfp.local) exits 1."""

    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except ValueError as error:
            print(f"domino pipeline: error: {error}", file=sys.stderr)
            return 2
        except RuntimeError as error:
            print(f"domino pipeline: failed: {error}", file=sys.stderr)
            return 1
        except Exception as error:  # noqa: BLE001 - only the server errors below are turned into messages
            message = _server_error(error, getattr(args, "host", None))
            if message is None:
                raise
            print(f"domino pipeline: failed: {message}", file=sys.stderr)
            return 1

    return run


def _server_error(error: Exception, host: Optional[str]) -> Optional[str]:
    """One line for an unreachable or refusing Kubeflow Pipelines server, else ``None``."""
    import urllib3
    from kfp_server_api.exceptions import ApiException

    if isinstance(error, urllib3.exceptions.HTTPError):
        reason = getattr(error, "reason", None) or error
        return f"cannot reach Kubeflow Pipelines at {host}: {reason}"
    if isinstance(error, ApiException):
        return f"Kubeflow Pipelines at {host} answered {error.status} {error.reason}: {str(error.body)[:300]}"
    return None
