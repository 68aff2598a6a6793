"""The fault steps of ``domino launch smoke --faults``: each runs a tiny training job and, while it trains, breaks
it the way a cluster does, then checks that the controllers and the run recover.

* ``fault: step raises`` (both backends): a 2-node job with ``--inprocess-restart`` whose Worker's rank raises in
  its step 3 (``DOMINO_FAULT_INJECT=raise-in-step@3:1``, :mod:`domino.train.fault_injection`); the same processes
  must form their groups again, resume from the checkpoint of iteration 2 and succeed, with no pod restarted
  (:mod:`domino.train.inprocess`). It rehearses the path a collective error or a bug in one rank takes.

The cluster steps (cluster backend only; with ``--backend local`` there are no pods or Workloads to break):

* ``fault: delete worker``: a Worker pod is deleted once it runs; the job must still succeed. The training
  operator (kubeflow/training-operator v1.9.0 ``pkg/controller.v1/common/pod.go`` ``ReconcilePods``) finds no
  pod for that replica index and ``createNewPod`` makes a new one of the same name (a new uid); the Master's
  torchrun sees its peer go and, under ``restartPolicy: OnFailure``, the kubelet restarts it in place
  (``ExitCode``: the operator recreates the failed pod, a retryable exit code).
* ``fault: delete master mid-save``: with a save every iteration, the Master pod is deleted right after its log
  shows a save (the next save is then under way); the operator recreates it and the run must resume from the
  last durable checkpoint (``resumed from ... at iteration N``, :mod:`domino.checkpoint.resume`) and succeed.
* ``fault: deactivate workload`` (with ``--queue``): the job's Kueue Workload gets ``spec.active: false``; Kueue
  (v0.19.2 ``pkg/controller/core/workload_controller.go``) evicts it with reason ``Deactivated`` and the job
  reconciler suspends the job; then ``spec.active: true``: the Workload is requeued (reason ``Reactivated``),
  re-admitted, the job unsuspended, and it must succeed.

With ``--api trainjob`` the pods belong to the Job controller under the TrainJob's JobSet: the steps check the
same (a new pod of that rank, a resumed run, success), but only the PyTorchJob operator's reaction is
modelled in the tests. Deleting pods and patching Workloads is beyond the launcher's Role: ``k8s/smoke``
grants it (opt-in).
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from typing import Callable, Dict, List, Optional

from domino.launch.api import run_job
from domino.launch.job_api import job_api

#: The fault jobs' training: a checkpoint every iteration, long enough to be broken while it trains.
FAULT_ARGS = ["--preset", "tiny", "--mock-data", "--train-iters", "12", "--save-interval", "1", "--num-workers",
              "0", "--eval-iters", "0", "--log-interval", "1"]
#: The in-process step's training: 2 nodes, a save at 2, 4 and 6; the Worker's rank raises in its step 3.
INPROCESS_ARGS = ["--preset", "tiny", "--mock-data", "--train-iters", "6", "--save-interval", "2", "--num-workers",
                  "0", "--eval-iters", "0", "--log-interval", "1", "--inprocess-restart"]
INPROCESS_FAULT = "raise-in-step@3:1"
#: The variable domino.train.fault_injection reads (named here: launch/ sits below train/ and imports none of it).
FAULT_ENV = "DOMINO_FAULT_INJECT"
#: What rank 0 logs once the groups are formed again (domino.train.inprocess).
FORMED = re.compile(r"in-process restart 1: process groups formed again in ([\d.]+) s")
RESUMED = "resumed from "  # what domino.checkpoint.resume logs when a restart loads a checkpoint
POLL_S = 0.2
#: Appended to a refused delete or patch (indexed by "was it a 403").
ROLE_HINT = ("", " (the fault steps need k8s/smoke's Role: kubectl apply --server-side -k k8s/smoke)")


class FaultError(Exception):
    """A fault could not be injected or its recovery was not seen (the step's FAIL detail)."""


class FaultSteps:
    """The fault steps, mixed into :class:`~domino.launch.smoke.Smoke` (which supplies ``spec``, ``api``,
    ``backend``, ``timeout_s``, ``jobs``, ``_step`` and ``_client``)."""

    def faults(self) -> None:
        self._inprocess_restart()
        names = ("fault: delete worker", "fault: delete master mid-save", "fault: deactivate workload")
        if self.backend != "cluster":
            for name in names:
                self._step(name, "skip", "a cluster fault (no pods or Workloads with --backend local)")
            return
        self._fault(names[0], "fault-worker", self._delete_worker)
        self._fault(names[1], "fault-master", self._delete_master)
        if not self.spec.queue:
            self._step(names[2], "skip", "no --queue: Kueue manages no Workload of the smoke's jobs")
        else:
            self._fault(names[2], "fault-queue", self._deactivate)

    def _inprocess_restart(self) -> None:
        """``fault: step raises``: the injected exception survived by the job's own processes."""
        step = "fault: step raises"
        spec = dataclasses.replace(self.spec, name=f"{self.spec.name}-fault-step", nodes=2, nproc_per_node=1,
                                   command=None, pretrain_args=list(INPROCESS_ARGS),
                                   env={**self.spec.env, FAULT_ENV: INPROCESS_FAULT})
        lines = self._job(step, spec)
        if lines is None:
            return
        formed = next((m for m in map(FORMED.search, lines) if m), None)
        resumed = next((line.split(RESUMED, 1)[1].strip() for line in lines if RESUMED in line), None)
        if formed is None or resumed is None:
            self._step(step, "FAIL", "the job succeeded but rank 0's log shows no in-process restart "
                       f"({'no resume' if formed else 'no groups formed again'}): was it restarted instead?")
            return
        self._step(step, "ok", f"rank 1 raised in its step 3 ({FAULT_ENV}={INPROCESS_FAULT}); the same processes "
                   f"formed their groups again in {formed.group(1)} s, resumed from {resumed} and succeeded")

    def _fault(self, step: str, suffix: str, inject: Callable[[str, threading.Event], str]) -> None:
        """Runs a training job in a thread while ``inject(job name, saved)`` breaks it in this one."""
        spec = dataclasses.replace(self.spec, name=f"{self.spec.name}-{suffix}", command=None,
                                   pretrain_args=list(FAULT_ARGS))
        name = job_api(self.api).render(spec, "smoke", None)["metadata"]["name"]
        self.jobs.append(spec.name)
        lines: List[str] = []
        saved = threading.Event()
        result: Dict[str, object] = {}

        def log(line: str) -> None:
            lines.append(line)
            if "saved checkpoint" in line:
                saved.set()

        def run() -> None:
            result["job"] = run_job(spec, self.backend, api=self.api, timeout_s=self.timeout_s, cleanup="always",
                                    run_id="smoke", log=log, api_client=self._client())

        runner = threading.Thread(target=run, daemon=True)
        runner.start()
        try:
            seen, problem = inject(name, saved), None
        except FaultError as error:
            seen, problem = None, str(error)
        runner.join()
        job = result.get("job")
        if problem:
            self._step(step, "FAIL", problem)
        elif job is None or not job.succeeded:
            tail = " | ".join(((job.log_tail if job else None) or lines)[-3:])
            self._step(step, "FAIL", f"{seen}, but the job did not recover: {job.reason if job else 'no result'}"
                       + (f" (last lines: {tail})" if tail else ""))
        elif step.endswith("mid-save"):
            resumed = next((line for line in lines if RESUMED in line), None)
            self._step(step, "ok" if resumed else "FAIL", f"{seen}; " + (
                f"the run {RESUMED}{resumed.split(RESUMED, 1)[1].strip()} and succeeded" if resumed else
                "the job succeeded but its log shows no resume from a checkpoint"))
        else:
            self._step(step, "ok", f"{seen}; the job succeeded")

    # -- the pods -------------------------------------------------------------------------------------
    def _pods(self, name: str) -> List[dict]:
        from kubernetes import client

        from domino.launch.kube_pods import list_job_pods

        return list_job_pods(client.CoreV1Api(self._client()), self.spec.namespace, job_api(self.api), name, 30.0)

    def _running(self, name: str, role: str) -> dict:
        """The job's ``master`` (node rank 0) or a ``worker`` pod, once it runs."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            pods = self._pods(name)
            master = job_api(self.api).rank0_pod(pods, name)
            picked = [p for p in pods if (p is master) == (role == "master")]
            running = [p for p in picked if (p.get("status") or {}).get("phase") == "Running"]
            if running:
                return running[0]
            time.sleep(POLL_S)
        raise FaultError(f"no {role} pod of {name} ran within {self.timeout_s:.0f} s")

    def _delete_and_see_recreated(self, name: str, pod: dict, role: str) -> str:
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        meta = pod["metadata"]
        try:
            client.CoreV1Api(self._client()).delete_namespaced_pod(meta["name"], self.spec.namespace,
                                                                   _preload_content=False).release_conn()
        except ApiException as error:
            raise FaultError(f"deleting pod {meta['name']}: {error.status} {error.reason}"
                             f"{ROLE_HINT[error.status == 403]}") from None
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            pods = self._pods(name)
            master = job_api(self.api).rank0_pod(pods, name)
            new = [p for p in pods if (p is master) == (role == "master") and p["metadata"]["uid"] != meta["uid"]]
            if new:
                return (f"{meta['name']} deleted while it ran; the controller recreated it "
                        f"({new[0]['metadata']['name']})")
            time.sleep(POLL_S)
        raise FaultError(f"{meta['name']} deleted, but no new {role} pod of {name} in {self.timeout_s:.0f} s")

    def _delete_worker(self, name: str, saved: threading.Event) -> str:
        return self._delete_and_see_recreated(name, self._running(name, "worker"), "worker")

    def _delete_master(self, name: str, saved: threading.Event) -> str:
        pod = self._running(name, "master")
        if not saved.wait(self.timeout_s):
            raise FaultError(f"the Master of {name} logged no checkpoint save within {self.timeout_s:.0f} s")
        return self._delete_and_see_recreated(name, pod, "master") + " after a save, with the next under way"

    # -- Kueue ----------------------------------------------------------------------------------------
    def _workload(self, name: str) -> dict:
        """The job's Workload (Kueue labels it ``kueue.x-k8s.io/job-uid``, jobframework ``constructWorkload``)."""
        from kubernetes import client

        api = job_api(self.api)
        custom = client.CustomObjectsApi(self._client())
        uid = custom.get_namespaced_custom_object(api.group, api.version, self.spec.namespace, api.plural,
                                                  name)["metadata"]["uid"]
        found = custom.list_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", self.spec.namespace, "workloads",
                                                     label_selector=f"kueue.x-k8s.io/job-uid={uid}")["items"]
        if not found:
            raise FaultError(f"no Kueue Workload of {name} (label kueue.x-k8s.io/job-uid={uid})")
        return found[0]

    def _activate(self, workload: str, active: bool) -> None:
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        try:
            client.CustomObjectsApi(self._client()).patch_namespaced_custom_object(
                "kueue.x-k8s.io", "v1beta2", self.spec.namespace, "workloads", workload, {"spec": {"active": active}})
        except ApiException as error:
            raise FaultError(f"patching Workload {workload}: {error.status} {error.reason}"
                             f"{ROLE_HINT[error.status == 403]}") from None

    def _until(self, name: str, what: str, wanted: Callable[[dict], bool]) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if wanted(self._workload(name)):
                return
            time.sleep(POLL_S)
        raise FaultError(f"the Workload of {name} was never {what} within {self.timeout_s:.0f} s")

    def _deactivate(self, name: str, saved: threading.Event) -> str:
        self._running(name, "master")
        workload = self._workload(name)["metadata"]["name"]
        self._activate(workload, False)
        self._until(name, "evicted with reason Deactivated",
                    lambda w: _condition(w, "Evicted") == ("True", "Deactivated"))
        self._activate(workload, True)
        self._until(name, "re-admitted", lambda w: _condition(w, "Admitted")[0] == "True" and
                    _condition(w, "Evicted")[0] != "True")
        return f"Workload {workload} deactivated while the job ran, evicted (Deactivated), reactivated and re-admitted"


def _condition(workload: dict, ctype: str) -> tuple:
    """(status, reason) of a Workload condition; ("", "") when absent."""
    found: Optional[dict] = next((c for c in (workload.get("status") or {}).get("conditions") or []
                                  if c.get("type") == ctype), None)
    return (found.get("status", ""), found.get("reason", "")) if found else ("", "")


__all__ = ["FAULT_ARGS", "FaultError", "FaultSteps"]
