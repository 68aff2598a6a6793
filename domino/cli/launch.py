"""``domino launch render|submit|check|smoke``: run ``domino pretrain`` as a Kubeflow PyTorchJob or, with ``--api trainjob``,
a Kubeflow Trainer v2 TrainJob, on a cluster or locally (``--backend local``).

The logic lives in :mod:`domino.launch`; this module only maps flags to calls.
"""

from __future__ import annotations

import argparse
import os
import sys

from domino.atomic_files import atomic_write
from domino.launch import naming
from domino.launch.api import BACKENDS, CLEANUP_MODES, DEFAULT_QUEUE_TIMEOUT_S, run_job
from domino.launch.flags import add_spec_flags, spec_from_args
from domino.launch.job_api import DEFAULT_JOB_API, JOB_APIS, job_api
from domino.launch.pretrain_args import resolve_pretrain
from domino.launch.render import to_yaml
from domino.launch.spec import LaunchSpecError


def _render(args: argparse.Namespace) -> int:
    try:
        spec = resolve_pretrain(spec_from_args(args)).spec  # the pods' argv, its layout derived and checked once
        text = to_yaml(job_api(args.api).render(spec, args.run_id or naming.new_run_id(), None))
    except LaunchSpecError as error:
        print(f"domino launch render: error: {error}", file=sys.stderr)
        return 2
    if args.output:
        with atomic_write(args.output, "w") as handle:
            handle.write(text)
    else:
        sys.stdout.write(text)
    return 0


def _submit(args: argparse.Namespace) -> int:
    try:
        spec = spec_from_args(args)
    except LaunchSpecError as error:
        print(f"domino launch submit: error: {error}", file=sys.stderr)
        return 2
    try:
        result = run_job(spec, args.backend, api=args.api, timeout_s=args.timeout,
                         scheduling_timeout_s=args.scheduling_timeout, queue_timeout_s=args.queue_timeout or None,
                         cleanup=args.cleanup, run_id=args.run_id,
                         log=lambda line: print(line, flush=True),
                         workdir=args.workdir)
    except LaunchSpecError as error:
        print(f"domino launch submit: error: {error}", file=sys.stderr)
        return 2
    summary = result.describe(args.tail_lines)
    print(summary, file=sys.stdout if result.succeeded else sys.stderr, flush=True)
    if result.reason.startswith("Interrupted"):
        return 130 if "SIGINT" in result.reason else 143  # 128 + the signal, like a killed process
    return 0 if result.succeeded else 1


def _check(args: argparse.Namespace) -> int:
    from domino.launch.check import ClusterCheck
    from domino.launch.kube_backend import load_api_client

    try:
        spec = spec_from_args(args)
        api = job_api(args.api)
        api.check(spec)
    except LaunchSpecError as error:
        print(f"domino launch check: error: {error}", file=sys.stderr)
        return 2
    from urllib3.exceptions import HTTPError

    try:
        problems = ClusterCheck(api, load_api_client()).run(spec, args.run_id)
    except LaunchSpecError as error:
        print(f"domino launch check: error: {error}", file=sys.stderr)
        return 2
    except HTTPError as error:
        print(f"ApiUnreachable: the Kubernetes API did not answer: {error}", file=sys.stderr)
        return 1
    for line in problems:
        print(line, flush=True)
    if not problems:
        print(f"ok: namespace {spec.namespace} has what a {api.kind} of this spec needs "
              f"(CRD, {'runtime, ' if api.name == 'trainjob' else ''}claim {spec.pvc}"
              f"{', queue ' + spec.queue if spec.queue else ''}, RBAC, controllers, dry runs)")
    return 1 if problems else 0


def _smoke(args: argparse.Namespace) -> int:
    from domino.launch.smoke import Smoke

    try:
        spec = spec_from_args(args)
        steps = Smoke(spec, args.backend, api=args.api, workdir=args.workdir, timeout_s=args.timeout,
                      log=lambda line: print(line, flush=True), tracking_uri=args.tracking_uri,
                      faults=args.faults).run()
    except LaunchSpecError as error:
        print(f"domino launch smoke: error: {error}", file=sys.stderr)
        return 2
    return 1 if any(step.status == "FAIL" for step in steps) else 0


def _add_api_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api", choices=sorted(JOB_APIS), default=DEFAULT_JOB_API,
                        help="pytorchjob (Kubeflow training operator v1, default) or trainjob (Kubeflow Trainer v2.3; "
                             "needs the k8s/trainer runtime).")


def register(subparsers) -> None:
    """Adds ``domino launch render``, ``submit``, ``check`` and ``smoke``."""
    launch = subparsers.add_parser("launch", help="Run domino pretrain as a PyTorchJob or TrainJob (or locally).",
                                   description=__doc__)
    verbs = launch.add_subparsers(dest="launch_command", metavar="{render,submit,check,smoke}", required=True)

    render = verbs.add_parser("render", help="Print the job's YAML (a PyTorchJob or a TrainJob).",
                              usage="domino launch render --name NAME [--image IMAGE] [flags] -- [pretrain flags]")
    add_spec_flags(render)
    _add_api_flag(render)
    render.add_argument("--output", "-o", default=None, help="Write the YAML to this file instead of stdout.")
    render.set_defaults(func=_render)

    submit = verbs.add_parser("submit", help="Create the job, stream the master's log, wait for the end.",
                              usage="domino launch submit --name NAME [--image IMAGE] [flags] -- [pretrain flags]")
    add_spec_flags(submit)
    _add_api_flag(submit)
    run = submit.add_argument_group("run")
    run.add_argument("--backend", choices=BACKENDS, default=BACKENDS[0],
                     help="cluster (the Kubernetes API, default) or local (the job's nodes as local processes, "
                          "with the environment the --api controller injects).")
    run.add_argument("--timeout", type=float, default=None, help="Wall-clock limit of the whole job, seconds.")
    run.add_argument("--scheduling-timeout", type=float, default=600.0,
                     help="Fail when the admitted job is not Running, or not all its pods run, after this many "
                          "seconds (default 600).")
    run.add_argument("--queue-timeout", type=float, default=DEFAULT_QUEUE_TIMEOUT_S,
                     help="Fail when a --queue job is still waiting in the queue (suspended) after this many "
                          "seconds, counted from each suspension (queued, or preempted) "
                          f"(default {DEFAULT_QUEUE_TIMEOUT_S:g}; 0: no limit but --timeout).")
    run.add_argument("--cleanup", choices=CLEANUP_MODES, default="on-success",
                     help="Delete the job: always, on-success (also when interrupted or timed out; default), never.")
    run.add_argument("--workdir", default=None, help="local backend: directory standing in for the PVC.")
    run.add_argument("--tail-lines", type=int, default=20, help="Log lines shown with a failure (default 20).")
    submit.set_defaults(func=_submit)

    check = verbs.add_parser("check", help="Ask the cluster whether the job's CRD, runtime, claim, queue and RBAC "
                             "are there; print what is missing, one line each.",
                             usage="domino launch check --name NAME [flags as for submit]")
    add_spec_flags(check)
    _add_api_flag(check)
    check.set_defaults(func=_check)

    smoke = verbs.add_parser("smoke", help="First-day cluster smoke test: controllers, dry runs of both APIs, Pod "
                             "Security, envcheck on 2 nodes, a tiny training run with a checkpoint, egress to the "
                             "tracking server, cleanup; one line per step.", usage="domino launch smoke --name NAME [flags as for submit]")
    add_spec_flags(smoke)
    _add_api_flag(smoke)
    smoke.add_argument("--backend", choices=BACKENDS, default=BACKENDS[0],
                       help="cluster (default) or local (the jobs as local processes; the API steps are skipped).")
    smoke.add_argument("--workdir", default=None, help="local backend: directory standing in for the PVC.")
    smoke.add_argument("--faults", action="store_true",
                       help="Also break tiny training jobs and check they recover: a rank's step raises (the same "
                            "processes restart in-process; both backends); on a cluster, with the k8s/smoke Role: "
                            "delete a Worker pod, delete the Master mid-save (the run resumes), deactivate the "
                            "Workload (with --queue; Kueue re-admits it).")
    smoke.add_argument("--timeout", type=float, default=900.0, help="Limit of each smoke job, seconds (900).")
    smoke.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI"),
                       help="Tracking server a training pod must reach (default $MLFLOW_TRACKING_URI; none: skipped).")
    smoke.set_defaults(func=_smoke)
