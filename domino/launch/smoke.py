"""``domino launch smoke``: a first-day check of a real cluster, one line per step, each step real.

Steps, in order (``ok``, ``FAIL`` or ``skip`` and what was seen):

1. ``controllers``: the training operator, the Trainer and JobSet (and Kueue with ``--queue``) Deployments
   have an available replica, the operator has domino's template flag
   (:meth:`~domino.launch.check_admission.AdmissionCheck.controllers`);
2. ``dry-run pytorchjob`` / ``dry-run trainjob``: a server-side dry run of each API's rendered job through
   the real webhooks and field validation (Kueue's suspension with ``--queue``);
3. ``pod-security``: a dry run of a PyTorchJob Worker pod in the namespace (Pod Security admission);
4. ``envcheck``: ``domino.launch.envcheck`` on 2 nodes as a job of ``--api``: every process initialises
   ``torch.distributed`` from the controller's environment and all-reduces over gloo;
5. ``train``: a tiny ``domino pretrain`` (preset ``tiny``, mock data, 4 iterations) that saves a
   checkpoint, as a job of ``--api``; passes when the job succeeds and its log shows the save;
6. ``egress``: with a tracking server (``--tracking-uri``, default ``$MLFLOW_TRACKING_URI``), a 1-node job whose
   pod (labelled as training pods are, so the namespace's NetworkPolicy applies) GETs ``<uri>/health``, the
   MLflow server's liveness route (mlflow ``server/__init__.py`` ``health``); skipped without one;
7. ``cleanup``: none of the smoke's jobs is left (each is submitted with ``--cleanup always``).

With ``--backend local`` steps 1-3 are skipped (no API server) and 4-5 run as local processes with the
controller's environment (:mod:`domino.launch.local_backend`); with ``--backend cluster`` they run on the
cluster, in the spec's namespace, image and claim. Faults, cross-node storage, pull times and ``/metrics`` are
not automated here (docs/cluster.md, "Smoke test", says what is left to do by hand).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional

from domino.launch.api import run_job
from domino.launch.job_api import job_api
from domino.launch.spec import JobSpec

#: The tiny training run: a checkpoint at iteration 2 and 4, CPU-friendly.
TRAIN_ARGS = ["--preset", "tiny", "--mock-data", "--train-iters", "4", "--save-interval", "2", "--num-workers", "0",
              "--eval-iters", "0", "--log-interval", "1"]
SAVED = "saved checkpoint"  # what domino.checkpoint.checkpointing logs after a save
#: The egress probe: a GET of the tracking server's /health from a training pod, its answer printed.
PROBE = ("import sys, urllib.request; answer = urllib.request.urlopen(sys.argv[1].rstrip('/') + '/health', "
         "timeout=20); print('egress', answer.status, answer.read(64).decode(errors='replace'))")


@dataclasses.dataclass
class Step:
    """One step's outcome."""

    name: str
    """The step (``controllers``, ``dry-run pytorchjob``, ...)."""
    status: str
    """``ok``, ``FAIL`` or ``skip``."""
    detail: str
    """What was seen, one line."""

    def line(self) -> str:
        return f"{self.status:<4} {self.name}: {self.detail}"


class Smoke:
    """Runs the steps of the module docstring.

    Args:
        spec: the job settings (name prefix, namespace, image, claim, nodes' resources); its command and
            pretrain arguments are replaced per step.
        backend: ``cluster`` or ``local``.
        api: the job API of the envcheck and train steps.
        api_client: a ``kubernetes`` ApiClient (cluster backend; default: in-cluster or kubeconfig).
        workdir: the local backend's stand-in for the claim.
        tracking_uri: the tracking server the egress step reaches (None: the step is skipped).
        timeout_s: the limit of each job.
        log: receives each step's line as it ends (job logs are kept out of it).
    """

    def __init__(self, spec: JobSpec, backend: str = "cluster", api: str = "pytorchjob", api_client=None,
                 workdir: Optional[str] = None, timeout_s: float = 900.0, log: Callable[[str], None] = print,
                 tracking_uri: Optional[str] = None) -> None:
        self.spec, self.backend, self.api, self.workdir, self.timeout_s, self.log = (
            spec, backend, api, workdir, timeout_s, log)
        self.api_client, self.tracking_uri = api_client, tracking_uri
        self.jobs: List[str] = []
        self.steps: List[Step] = []

    def _step(self, name: str, status: str, detail: str) -> None:
        step = Step(name, status, detail)
        self.steps.append(step)
        self.log(step.line())

    def _client(self):
        if self.api_client is None:
            from domino.launch.kube_backend import load_api_client

            self.api_client = load_api_client()
        return self.api_client

    def admission(self) -> None:
        """Steps 1-3."""
        names = ["controllers", "dry-run pytorchjob", "dry-run trainjob", "pod-security"]
        if self.backend != "cluster":
            for name in names:
                self._step(name, "skip", "no API server with --backend local")
            return
        from domino.launch.check_admission import AdmissionCheck

        checks = {api: AdmissionCheck(job_api(api), self._client()) for api in ("pytorchjob", "trainjob")}
        down = checks["pytorchjob"].controllers(self.spec)
        down += [p for p in checks["trainjob"].controllers(self.spec) if p not in down]  # Kueue once
        self._step("controllers", "FAIL" if down else "ok", "; ".join(down) or "every controller has an available "
                   "replica; the operator has the template flag")
        refused: List[str] = []
        for api, check in checks.items():
            body = job_api(api).render(self.spec, "smoke", None)
            problems = check.dry_run_job(self.spec, body)
            self._step(f"dry-run {api}", "FAIL" if problems else "ok", "; ".join(problems) or
                       "admitted by the webhooks and strict field validation" +
                       (", suspended by Kueue" if self.spec.queue else ""))
            if api == "pytorchjob":
                refused = check.dry_run_pod(self.spec, body)
        self._step("pod-security", "FAIL" if refused else "ok", "; ".join(refused) or
                   f"a Worker pod is admitted in namespace {self.spec.namespace}")

    def _job(self, step: str, spec: JobSpec) -> Optional[List[str]]:
        """Runs one job to its end; its log lines, or None after logging the step FAILed."""
        lines: List[str] = []
        self.jobs.append(spec.name)
        result = run_job(spec, self.backend, api=self.api, timeout_s=self.timeout_s, cleanup="always",
                         run_id="smoke", log=lines.append, workdir=self.workdir,
                         api_client=self._client() if self.backend == "cluster" else None)
        if not result.succeeded:
            tail = " | ".join((result.log_tail or lines)[-3:])
            self._step(step, "FAIL", f"{result.reason}" + (f" (last lines: {tail})" if tail else ""))
            return None
        return lines

    def envcheck(self) -> None:
        out = f"{self.spec.mount_path.rstrip('/')}/smoke/envcheck"
        spec = dataclasses.replace(self.spec, name=f"{self.spec.name}-envcheck", nodes=2, pretrain_args=[],
                                   command=["torchrun", "-m", "domino.launch.envcheck", "--out", out])
        if self._job("envcheck", spec) is not None:
            self._step("envcheck", "ok", f"2 nodes of a {job_api(self.api).kind} initialised torch.distributed "
                       f"from the controller's environment and all-reduced (reports in {out})")

    def train(self) -> None:
        spec = dataclasses.replace(self.spec, name=f"{self.spec.name}-train", command=None,
                                   pretrain_args=list(TRAIN_ARGS))
        lines = self._job("train", spec)
        if lines is None:
            return
        saves = [line for line in lines if SAVED in line]
        if saves:
            self._step("train", "ok", f"4 iterations of the tiny preset, {len(saves)} checkpoint save(s): "
                       f"{saves[-1].split(SAVED, 1)[1].strip()}")
        else:
            self._step("train", "FAIL", "the job succeeded but its log shows no checkpoint save")

    def egress(self) -> None:
        if not self.tracking_uri:
            self._step("egress", "skip", "no tracking server (--tracking-uri, or MLFLOW_TRACKING_URI)")
            return
        spec = dataclasses.replace(self.spec, name=f"{self.spec.name}-egress", nodes=1, pretrain_args=[],
                                   command=["python", "-c", PROBE, self.tracking_uri])
        lines = self._job("egress", spec)
        if lines is not None:
            answer = next((line for line in lines if line.startswith("egress ")), "")
            self._step("egress", "ok", f"a training pod reached {self.tracking_uri} ({answer or 'answered'})")

    def cleanup(self) -> None:
        if self.backend != "cluster":
            self._step("cleanup", "ok", "the local processes ended with their jobs")
            return
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        api, custom, left = job_api(self.api), client.CustomObjectsApi(self._client()), []
        for base in self.jobs:
            name = job_api(self.api).render(dataclasses.replace(self.spec, name=base), "smoke", None)["metadata"]["name"]
            try:
                custom.get_namespaced_custom_object(api.group, api.version, self.spec.namespace, api.plural, name)
                left.append(name)
            except ApiException as error:
                if error.status != 404:
                    left.append(f"{name} ({error.status})")
        self._step("cleanup", "FAIL" if left else "ok", f"left behind: {', '.join(left)}" if left else
                   f"no smoke job left in namespace {self.spec.namespace}")

    def run(self) -> List[Step]:
        """All steps; the outcome of each."""
        self.admission()
        self.envcheck()
        self.train()
        self.egress()
        self.cleanup()
        return self.steps


__all__ = ["Smoke", "Step", "TRAIN_ARGS"]
