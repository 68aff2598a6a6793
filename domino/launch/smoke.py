"""``domino launch smoke``: a first-day check of a real cluster, one line per step, each step real.

Steps, in order (``ok``, ``FAIL`` or ``skip`` and what was seen):

1. ``controllers``: the training operator, the Trainer and JobSet (and Kueue with ``--queue``) Deployments
   have an available replica, the operator has domino's template flag
   (:meth:`~domino.launch.check_admission.AdmissionCheck.controllers`);
2. ``dry-run pytorchjob`` / ``dry-run trainjob``: a server-side dry run of each API's rendered job through
   the real webhooks and field validation (Kueue's suspension with ``--queue``);
3. ``pod-security``: a dry run of a PyTorchJob Worker pod in the namespace (Pod Security admission);
4. ``envcheck``: ``domino.launch.envcheck --storage`` on 2 nodes as a job of ``--api``: every process
   initialises ``torch.distributed`` from the controller's environment and all-reduces over gloo;
5. ``storage``: in that job rank 0 wrote a file on the claim and the last rank (the other node) read it
   and answered; on the cluster both must run as the pods' ``runAsUser`` (1000) on two different hosts;
6. ``train``: a tiny ``domino pretrain`` (preset ``tiny``, mock data, 4 iterations) that saves a
   checkpoint, as a job of ``--api``; passes when the job succeeds and its log shows the save; on the local
   backend it serves ``--metrics-port`` and 6b. ``metrics`` scrapes rank 0's ``/metrics`` over HTTP while it
   runs (on the cluster the step is skipped: the scrape is Prometheus', through ``k8s/metrics``);
7. ``pull-time``: the kubelet's ``Pulled`` events of the train job's pods (message ``Successfully pulled
   image "..." in 1m2.5s (... including waiting)``, kubernetes ``pkg/kubelet/images/image_manager.go``)
   against the Worker's wait for its Master and torchrun's rendezvous (``--start-timeout``); not applicable
   on the local backend (no image is pulled);
8. ``egress``: with a tracking server (``--tracking-uri``, default ``$MLFLOW_TRACKING_URI``), a 1-node job whose
   pod (labelled as training pods are, so the namespace's NetworkPolicy applies) GETs ``<uri>/health``, the
   MLflow server's liveness route (mlflow ``server/__init__.py`` ``health``); skipped without one;
9. ``cleanup``: none of the smoke's jobs is left (each is submitted with ``--cleanup always``).

With ``--backend local`` steps 1-3 are skipped (no API server) and the jobs run as local processes with the
controller's environment (:mod:`domino.launch.local_backend`; "nodes" share one host and one UID); with
``--backend cluster`` they run on the cluster, in the spec's namespace, image and claim. With ``--faults``
the fault steps of :mod:`domino.launch.smoke_faults` run after ``train`` (a raising step survived in-process, on
both backends; delete a Worker, delete the Master mid-save, deactivate the Workload, on the cluster only).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import socket
import threading
import urllib.request
from typing import Callable, List, Optional

from domino.launch.api import run_job
from domino.launch.job_api import job_api
from domino.launch.smoke_faults import FaultSteps
from domino.launch.spec import JobSpec
from domino.redact import redact_text, redact_uri

#: The tiny training run: a checkpoint at iteration 2 and 4, CPU-friendly.
TRAIN_ARGS = ["--preset", "tiny", "--mock-data", "--train-iters", "4", "--save-interval", "2", "--num-workers", "0",
              "--eval-iters", "0", "--log-interval", "1"]


def pull_seconds(message: str) -> Optional[float]:
    """The pull time of a kubelet ``Pulled`` event's message (None: the image was already present)."""
    match = re.search(r"Successfully pulled image \S+ in (\S+)", message)
    if not match:
        return None
    return sum(float(value) * GO_UNITS[unit] for value, unit in GO_DURATION.findall(match.group(1)))


def free_port() -> int:
    """A TCP port nothing listens on now (the local metrics endpoint)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
#: What rank 0 of ``envcheck --storage`` prints (domino.launch.envcheck ``_storage``).
STORED = re.compile(r"storage: written on (\S+) as uid (\d+) \(file owner (\d+)\), read on (\S+) as uid (\d+)")
#: A Go duration as the kubelet's Pulled event prints it (``time.Duration.String``: 1h2m3.5s, 850ms).
GO_DURATION = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s|µs|us|ns)")
GO_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "µs": 1e-6, "us": 1e-6, "ns": 1e-9}
SAVED = "saved checkpoint"  # what domino.checkpoint.checkpointing logs after a save
#: The egress probe: a GET of the tracking server's /health from a training pod, its answer printed. It is given
#: the URI without secrets (a pod's command is read by whoever may list pods) and drops the userinfo and query
#: left of them: /health needs no credentials (``_UNPROTECTED_PATH_PREFIXES`` in ``mlflow/server/auth/__init__.py``,
#: mlflow 3.18.0).
PROBE = ("import sys, urllib.parse, urllib.request; u = urllib.parse.urlsplit(sys.argv[1]); "
         "url = u._replace(netloc=u.netloc.rpartition('@')[2], path=u.path.rstrip('/') + '/health', query='', "
         "fragment='').geturl(); answer = urllib.request.urlopen(url, timeout=20); "
         "print('egress', answer.status, answer.read(64).decode(errors='replace'))")


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


class Smoke(FaultSteps):
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
        faults: also run the fault steps (:mod:`domino.launch.smoke_faults`).
    """

    def __init__(self, spec: JobSpec, backend: str = "cluster", api: str = "pytorchjob", api_client=None,
                 workdir: Optional[str] = None, timeout_s: float = 900.0, log: Callable[[str], None] = print,
                 tracking_uri: Optional[str] = None, faults: bool = False) -> None:
        self.spec, self.backend, self.api, self.workdir, self.timeout_s, self.log = (
            spec, backend, api, workdir, timeout_s, log)
        self.api_client, self.tracking_uri, self.with_faults = api_client, tracking_uri, faults
        self.jobs: List[str] = []
        self.steps: List[Step] = []

    def _step(self, name: str, status: str, detail: str) -> None:
        step = Step(name, status, redact_text(detail))  # a job's last lines may quote the tracking URI
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
                                   command=["torchrun", "-m", "domino.launch.envcheck", "--out", out, "--storage"])
        lines = self._job("envcheck", spec)
        if lines is None:
            self._step("storage", "skip", "the envcheck job failed")
            return
        self._step("envcheck", "ok", f"2 nodes of a {job_api(self.api).kind} initialised torch.distributed "
                   f"from the controller's environment and all-reduced (reports in {out})")
        self.storage(lines)

    def storage(self, lines: List[str]) -> None:
        """Step 5 from the envcheck job's log."""
        match = next((m for m in map(STORED.search, lines) if m), None)
        if match is None:
            self._step("storage", "FAIL", "the envcheck log has no 'storage:' line (rank 0 never read the answer)")
            return
        wrote_on, wrote_uid, owner, read_on, read_uid = match.groups()
        seen = f"a file on the claim written on {wrote_on} as uid {wrote_uid}, read on {read_on} as uid {read_uid}"
        if self.backend != "cluster":
            self._step("storage", "ok", f"{seen} (one host with --backend local)")
            return
        user = str(self.spec.run_as_user)
        problems = [f"the {what} ran as uid {uid}, not the pods' runAsUser {user}"
                    for what, uid in (("writer", wrote_uid), ("reader", read_uid)) if uid != user]
        problems += [f"the probe is owned by uid {owner}, not {user} (a root-squashing export? docs/cluster.md, "
                     "Storage)"] if owner != user else []
        problems += [f"both ranks ran on {wrote_on}: not a cross-node check"] if wrote_on == read_on else []
        self._step("storage", "FAIL" if problems else "ok", "; ".join(problems) or seen)

    def train(self) -> None:
        args, scraped = list(TRAIN_ARGS), []
        serve = self.backend != "cluster" and importlib.util.find_spec("prometheus_client") is not None
        if serve:
            port = free_port()
            args += ["--metrics-port", str(port)]
            done = threading.Event()
            scraper = threading.Thread(target=self._scrape, args=(port, done, scraped), daemon=True)
            scraper.start()
        spec = dataclasses.replace(self.spec, name=f"{self.spec.name}-train", command=None, pretrain_args=args)
        lines = self._job("train", spec)
        if serve:
            done.set()
            scraper.join()
        if lines is None:
            self._step("metrics", "skip", "the train job failed")
            self.pull_time(spec)  # a pull over the wait is a likely reason
            return
        saves = [line for line in lines if SAVED in line]
        if saves:
            self._step("train", "ok", f"4 iterations of the tiny preset, {len(saves)} checkpoint save(s): "
                       f"{saves[-1].split(SAVED, 1)[1].strip()}")
        else:
            self._step("train", "FAIL", "the job succeeded but its log shows no checkpoint save")
        if self.backend == "cluster":
            self._step("metrics", "skip", "rank 0's /metrics is Prometheus' to scrape in the cluster (k8s/metrics)")
        elif not serve:
            self._step("metrics", "skip", "no prometheus_client here (pip install 'domino[metrics]')")
        elif scraped:
            self._step("metrics", "ok", f"rank 0's /metrics answered over HTTP: {scraped[-1]}")
        else:
            self._step("metrics", "FAIL", "rank 0's /metrics never answered with domino_iteration while training")
        self.pull_time(spec)

    @staticmethod
    def _scrape(port: int, done: threading.Event, scraped: List[str]) -> None:
        """GETs ``/metrics`` every 0.1 s until the job ends; keeps the last ``domino_iteration`` line seen."""
        while not done.wait(0.1):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as answer:
                    text = answer.read().decode()
            except OSError:
                continue  # not serving yet, or already gone
            scraped += [line for line in text.splitlines() if line.startswith("domino_iteration ")]

    def pull_time(self, spec: JobSpec) -> None:
        """Step 7: the slowest image pull of the train job's pods against ``--start-timeout``."""
        if self.backend != "cluster":
            self._step("pull-time", "skip", "not applicable with --backend local (no image is pulled)")
            return
        from kubernetes import client

        name = job_api(self.api).render(spec, "smoke", None)["metadata"]["name"]
        events = client.CoreV1Api(self._client()).list_namespaced_event(self.spec.namespace).items
        pulls = [(seconds, event.involved_object.name) for event in events
                 if event.reason == "Pulled" and (event.involved_object.name or "").startswith(name)
                 for seconds in [pull_seconds(event.message or "")] if seconds is not None]
        if not pulls:
            self._step("pull-time", "ok", f"no pod of {name} pulled its image (already on every node)")
            return
        slowest, pod = max(pulls)
        limit = self.spec.start_timeout_s
        self._step("pull-time", "FAIL" if slowest >= limit else "ok", f"slowest pull {slowest:.1f} s ({pod}) "
                   f"{'is over' if slowest >= limit else 'within'} the Worker's wait and the rendezvous timeout "
                   f"(--start-timeout {limit} s)" + (": raise --start-timeout or pre-pull (k8s/prepull)"
                                                      if slowest >= limit else ""))

    def egress(self) -> None:
        if not self.tracking_uri:
            self._step("egress", "skip", "no tracking server (--tracking-uri, or MLFLOW_TRACKING_URI)")
            return
        spec = dataclasses.replace(self.spec, name=f"{self.spec.name}-egress", nodes=1, pretrain_args=[],
                                   command=["python", "-c", PROBE, redact_uri(self.tracking_uri)])
        lines = self._job("egress", spec)
        if lines is not None:
            answer = next((line for line in lines if line.startswith("egress ")), "")
            reached = redact_uri(self.tracking_uri)
            self._step("egress", "ok", f"a training pod reached {reached} ({answer or 'answered'})")

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
        if self.with_faults:
            self.faults()
        self.egress()
        self.cleanup()
        return self.steps


__all__ = ["Smoke", "Step", "TRAIN_ARGS", "pull_seconds"]
