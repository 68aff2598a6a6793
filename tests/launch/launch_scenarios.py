"""Scripted job lives for the fake cluster (each runs in a thread after the job is created)."""

from __future__ import annotations

import time

from domino.launch import JobSpec, naming
from domino.launch.job_api import job_api
from domino.launch.kube_backend import JobLauncher


def spec(**overrides) -> JobSpec:
    base = dict(name="gpt", image="registry.example/domino:1", nodes=2, nproc_per_node=2, gpus_per_node=2,
                pvc="domino-data", pretrain_args=["--preset", "tiny"])
    base.update(overrides)
    return JobSpec(**base)


def launcher(server, lines: list, api: str = "pytorchjob", **overrides) -> JobLauncher:
    opts = dict(poll_s=0.05, watch_timeout_s=2.0, request_timeout_s=5.0, log_grace_s=3.0)
    opts.update(overrides)
    return JobLauncher(job_api(api), api_client=server.api_client(), log=lines.append, **opts)


def _ids(job):
    return job["metadata"]["namespace"], job["metadata"]["name"]


def start_running(c, job, log_lines=("step 1 loss 10.8",)):
    """Created -> pods scheduled -> Running, with some master output; returns the master pod's name."""
    ns, name = _ids(job)
    time.sleep(0.05)
    c.set_condition(ns, name, "Created", "PyTorchJobCreated", f"PyTorchJob {name} is created.")
    master = c.add_pod(ns, name, "master", 0)
    c.add_pod(ns, name, "worker", 0)
    time.sleep(0.1)
    c.add_pod(ns, name, "master", 0, "Running", {"running": {"startedAt": "now"}})
    c.add_pod(ns, name, "worker", 0, "Running", {"running": {"startedAt": "now"}})
    c.set_condition(ns, name, "Running", "PyTorchJobRunning", f"PyTorchJob {name} is running.")
    c.log(master, *log_lines)
    return master


def succeed(c, job, log_lines=("step 2 loss 9.1", "saved checkpoint iteration 2")):
    ns, name = _ids(job)
    master = start_running(c, job)
    time.sleep(0.2)
    c.log(master, *log_lines)
    c.add_pod(ns, name, "master", 0, "Succeeded", {"terminated": {"exitCode": 0, "reason": "Completed"}})
    c.close_log(master)
    c.set_condition(ns, name, "Succeeded", "PyTorchJobSucceeded", f"PyTorchJob {name} is successfully completed.")


def fail(c, job):
    ns, name = _ids(job)
    master = start_running(c, job)
    time.sleep(0.1)
    c.log(master, "Traceback (most recent call last):", "RuntimeError: CUDA out of memory")
    c.add_pod(ns, name, "master", 0, "Failed", {"terminated": {"exitCode": 1, "reason": "Error"}})
    c.close_log(master)
    c.set_condition(ns, name, "Failed", "PyTorchJobFailed",
                    f"PyTorchJob {name} is failed because 1 Master replica(s) failed.")


def restart_then_succeed(c, job):
    """The master container fails once (Restarting), the restarted container resumes and succeeds."""
    ns, name = _ids(job)
    master = start_running(c, job, ("attempt 1 step 1",))
    time.sleep(0.2)
    c.log(master, "NCCL error: connection reset")
    c.add_pod(ns, name, "master", 0, "Running", {"terminated": {"exitCode": 137}}, restarts=0)
    c.close_log(master)
    c.set_condition(ns, name, "Restarting", "PyTorchJobRestarting", "PyTorchJob master is restarting.")
    time.sleep(0.3)
    c.close_log(master, False)
    c.add_pod(ns, name, "master", 0, "Running", {"running": {"startedAt": "later"}}, restarts=1)
    c.set_condition(ns, name, "Running", "PyTorchJobRunning", "running again")
    c.log(master, "resumed from iteration 1", "attempt 2 done")
    time.sleep(0.2)
    c.add_pod(ns, name, "master", 0, "Succeeded", {"terminated": {"exitCode": 0}}, restarts=1)
    c.close_log(master)
    c.set_condition(ns, name, "Succeeded", "PyTorchJobSucceeded", "done")


def stay_pending(c, job):
    """Pods never schedule: GPUs are short and the worker's image cannot be pulled."""
    ns, name = _ids(job)
    time.sleep(0.05)
    c.set_condition(ns, name, "Created", "PyTorchJobCreated", "created")
    unsched = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]
    master = c.add_pod(ns, name, "master", 0, conditions=unsched)
    worker = c.add_pod(ns, name, "worker", 0, state={"waiting": {
        "reason": "ImagePullBackOff", "message": 'Back-off pulling image "registry.example/domino:1"'}})
    c.add_event(ns, master, "FailedScheduling", "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")
    c.add_event(ns, worker, "Failed", 'Failed to pull image "registry.example/domino:1": not found')
    c.add_event(ns, worker, "Scheduled", "Successfully assigned", etype="Normal")


def run_forever(c, job):
    start_running(c, job)


def break_watch_and_history(c) -> None:
    """Once the launcher watches: forget the history (410 Gone from any version seen) and cut the watch."""
    c.wait_for(lambda: sum(1 for r in c.requests if r[2] == "watch") >= 1)
    time.sleep(0.2)
    c.compact()
    c.cut_watches()
    time.sleep(0.3)


def plant(server, api: str, spec_: JobSpec, run_id: str, name_of_run: str):
    """Stores run ``run_id``'s job under the name run ``name_of_run`` would use (a pre-existing job)."""
    body = job_api(api).render(spec_, run_id)
    body["metadata"]["name"] = naming.job_name(spec_.name, name_of_run, spec_.nodes)
    return server.cluster.add_job(body)


def disconnect_then_410(c, job):
    """Running, then the watch breaks and history is compacted while the job finishes."""
    ns, name = _ids(job)
    master = start_running(c, job)
    break_watch_and_history(c)
    c.log(master, "finished while the watch was down")
    c.add_pod(ns, name, "master", 0, "Succeeded", {"terminated": {"exitCode": 0}})
    c.close_log(master)
    c.set_condition(ns, name, "Succeeded", "PyTorchJobSucceeded", "done")


def workers_refused(c, job):
    """Pod Security refuses the Worker pods (the operator's init container): only the Master runs, the
    job shows Running, and the operator records FailedCreatePod events on the job (its pod_control.go:
    reason FailedCreatePod, message "Error creating: <the API server's error>")."""
    ns, name = _ids(job)
    time.sleep(0.05)
    c.set_condition(ns, name, "Created", "PyTorchJobCreated", "created")
    master = c.add_pod(ns, name, "master", 0, "Running", {"running": {"startedAt": "now"}})
    c.set_condition(ns, name, "Running", "PyTorchJobRunning", f"PyTorchJob {name} is running.")
    c.log(master, "waiting for the rendezvous")
    c.add_event(ns, name, "FailedCreatePod", f'Error creating: pods "{name}-worker-0" is forbidden: violates '
                'PodSecurity "restricted:latest": allowPrivilegeEscalation != false (container "init-pytorch" must '
                'set securityContext.allowPrivilegeEscalation=false), unrestricted capabilities (container '
                '"init-pytorch" must set securityContext.capabilities.drop=["ALL"])')


def queued_then_admitted(c, job, wait_s=1.5):
    """Kueue holds the job suspended (longer than the scheduling timeout), then admits it."""
    ns, name = _ids(job)
    assert job["spec"]["runPolicy"]["suspend"] is True
    time.sleep(0.05)
    c.set_condition(ns, name, "Created", "PyTorchJobCreated", "created")
    c.set_suspend(ns, name, True)
    time.sleep(wait_s)
    c.set_suspend(ns, name, False)
    succeed(c, job)


def preempt_then_readmit(c, job, set_suspend, start, finish, while_suspended=lambda: None, run_s=1.3, wait_s=0.7):
    """Admitted at once, runs for ``run_s``, then Kueue preempts it (kueue v0.19.2 jobframework: the job is
    suspended) and its controller deletes the pods; after ``wait_s`` Kueue re-admits it, and ``finish`` runs
    the new pods to the end. ``set_suspend``, ``start`` and ``finish`` are the job API's."""
    ns, name = _ids(job)
    set_suspend(ns, name, False)
    master = start(c, job, ("iteration 1/8",))
    time.sleep(run_s)
    c.log(master, "SIGTERM: saving at iteration 4 and exiting")
    c.close_log(master)
    set_suspend(ns, name, True)
    c.delete_pods(ns, name)
    while_suspended()
    time.sleep(wait_s)
    set_suspend(ns, name, False)
    c.close_log(master, False)
    finish(c, job)


def preempted_then_readmitted(c, job):
    """A PyTorchJob preempted while it runs (runPolicy.suspend; the operator marks it Suspended, not Running,
    and deletes its pods: training-operator v1.9.0 ``common/job.go``), then re-admitted."""
    preempt_then_readmit(c, job, c.set_suspend, start_running, succeed)


def queued_forever(c, job):
    ns, name = _ids(job)
    time.sleep(0.05)
    c.set_suspend(ns, name, True)


def worker_fails(c, job):
    """The Worker's container fails (the Master only sees the lost peer): both pods' logs matter."""
    ns, name = _ids(job)
    master = start_running(c, job)
    worker = f"{name}-worker-0"
    c.log(worker, "worker step 1", "RuntimeError: CUDA error: an illegal memory access was encountered")
    c.add_pod(ns, name, "worker", 0, "Failed", {"terminated": {"exitCode": 1, "reason": "Error"}})
    c.log(master, "RuntimeError: [gloo] Connection closed by peer")
    c.add_pod(ns, name, "master", 0, "Failed", {"terminated": {"exitCode": 1, "reason": "Error"}})
    c.close_log(master)
    c.set_condition(ns, name, "Failed", "PyTorchJobFailed", f"PyTorchJob {name} is failed because 1 Worker "
                    "replica(s) failed.")
