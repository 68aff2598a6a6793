"""Scripted TrainJob lives for the fake cluster, as Kubeflow Trainer v2.3.0 and JobSet v0.12.0 report them.

The awkward parts of the real API, kept here on purpose: a TrainJob has no Created and no Running
condition (only ``status.jobsStatus`` shows the JobSet's Jobs starting); Complete and Failed carry the
JobSet's reason and message (``AllJobsCompleted`` / ``FailedJobs``, jobset ``pkg/constants``); the pods
are the ``node`` Job's indexed pods with a random name suffix and a container named ``node``; a pod
refused at admission shows only as a ``FailedCreate`` event on the Job ``<job>-node-0``.
"""

from __future__ import annotations

import time

from domino.launch import JobSpec
from launch_scenarios import _ids, break_watch_and_history, preempt_then_readmit

COMPLETE = ("Complete", "AllJobsCompleted", "jobset completed successfully")


def spec(**overrides) -> JobSpec:
    base = dict(name="gpt", image="registry.example/domino:1", nodes=2, nproc_per_node=2, gpus_per_node=2,
                pretrain_args=["--preset", "tiny"])
    base.update(overrides)
    return JobSpec(**base)


def start_running(c, job, log_lines=("step 1 loss 10.8",)):
    """JobSet created (jobsStatus) -> node pods scheduled -> running; returns the rank-0 pod's name."""
    ns, name = _ids(job)
    time.sleep(0.05)
    c.set_trainjob_status(ns, name)
    master = c.add_node_pod(ns, name, 0)
    c.add_node_pod(ns, name, 1)
    time.sleep(0.1)
    c.add_node_pod(ns, name, 1, "Running", {"running": {"startedAt": "now"}})  # rank 1 first: order is free
    c.add_node_pod(ns, name, 0, "Running", {"running": {"startedAt": "now"}})
    c.set_trainjob_status(ns, name, active=1, ready=1)
    c.log(master, *log_lines)
    return master


def succeed(c, job):
    ns, name = _ids(job)
    master = start_running(c, job)
    time.sleep(0.2)
    c.log(master, "step 2 loss 9.1", "saved checkpoint iteration 2")
    for index in (0, 1):
        c.add_node_pod(ns, name, index, "Succeeded", {"terminated": {"exitCode": 0, "reason": "Completed"}})
    c.close_log(master)
    c.set_trainjob_status(ns, name, succeeded=1, condition=COMPLETE)


def fail(c, job):
    """Node 1 fails for good (the node Job reaches its backoffLimit): the JobSet fails, and so the TrainJob."""
    ns, name = _ids(job)
    master = start_running(c, job)
    worker = c.add_node_pod(ns, name, 1, "Failed", {"terminated": {"exitCode": 1, "reason": "Error"}})
    c.log(worker, "RuntimeError: CUDA error: an illegal memory access was encountered")
    c.log(master, "RuntimeError: [gloo] Connection closed by peer")
    c.add_node_pod(ns, name, 0, "Failed", {"terminated": {"exitCode": 1, "reason": "Error"}})
    c.close_log(master)
    c.set_trainjob_status(ns, name, failed=1, condition=(
        "Failed", "FailedJobs", f"jobset failed due to one or more job failures (first failed job: {name}-node-0)"))


def run_forever(c, job):
    start_running(c, job)


def queued_then_admitted(c, job, wait_s=1.5):
    """Kueue holds the TrainJob suspended (the JobSet too), then admits it and clears spec.suspend."""
    ns, name = _ids(job)
    assert job["spec"]["suspend"] is True
    time.sleep(0.05)
    c.set_trainjob_suspend(ns, name, True)
    c.set_trainjob_status(ns, name, suspended=1)
    time.sleep(wait_s)
    c.set_trainjob_suspend(ns, name, False)
    succeed(c, job)


def preempted_then_readmitted(c, job):
    """A TrainJob preempted while it runs (``spec.suspend``; the JobSet suspends its Jobs, whose pods are
    deleted), then re-admitted."""
    ns, name = _ids(job)
    preempt_then_readmit(c, job, c.set_trainjob_suspend, start_running, succeed,
                         while_suspended=lambda: c.set_trainjob_status(ns, name, suspended=1))


def queued_forever(c, job):
    ns, name = _ids(job)
    time.sleep(0.05)
    c.set_trainjob_suspend(ns, name, True)
    c.set_trainjob_status(ns, name, suspended=1)


def stay_pending(c, job):
    """The pods are created but never scheduled: the node Job counts as active (a pending pod is active),
    never ready."""
    ns, name = _ids(job)
    time.sleep(0.05)
    unsched = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]
    for index in (0, 1):
        pod = c.add_node_pod(ns, name, index, conditions=unsched)
        c.add_event(ns, pod, "FailedScheduling", "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")
    c.set_trainjob_status(ns, name, active=1)


def pods_refused(c, job):
    """Admission refuses the node pods: the Job has no active pod, the Job controller reports FailedCreate
    on the Job (kubernetes pkg/controller/job: "Error creating: ...")."""
    ns, name = _ids(job)
    time.sleep(0.05)
    c.set_trainjob_status(ns, name)
    c.add_event(ns, f"{name}-node-0", "FailedCreate", f'Error creating: pods "{name}-node-0-0-x7k2p" is forbidden: '
                'exceeded quota: domino-quota, requested: requests.nvidia.com/gpu=2, used: 0, limited: 0')


def deadline_exceeded(c, job):
    """Running past spec.activeDeadlineSeconds: the controller marks the TrainJob Failed and deletes the JobSet
    (trainjob_controller.go ``reconcileDeadline``)."""
    ns, name = _ids(job)
    start_running(c, job)
    time.sleep(0.3)
    c.set_trainjob_status(ns, name, condition=("Failed", "DeadlineExceeded", "TrainJob exceeded its active deadline"))


def disconnect_then_410(c, job):
    """Running, then the watch breaks and history is compacted while the job completes."""
    ns, name = _ids(job)
    master = start_running(c, job)
    break_watch_and_history(c)
    c.log(master, "finished while the watch was down")
    c.add_node_pod(ns, name, 0, "Succeeded", {"terminated": {"exitCode": 0}})
    c.close_log(master)
    c.set_trainjob_status(ns, name, succeeded=1, condition=COMPLETE)


def restart_then_succeed(c, job):
    """Node 0's container fails once and restarts in place (the pods' OnFailure): the node Job is not ready
    meanwhile; the restarted container resumes and the job completes."""
    ns, name = _ids(job)
    master = start_running(c, job, ("attempt 1 step 1",))
    time.sleep(0.2)
    c.log(master, "NCCL error: connection reset")
    c.add_node_pod(ns, name, 0, "Running", {"terminated": {"exitCode": 137}})
    c.close_log(master)
    c.set_trainjob_status(ns, name, active=1, ready=0)
    time.sleep(0.3)
    c.close_log(master, False)
    c.add_node_pod(ns, name, 0, "Running", {"running": {"startedAt": "later"}}, restarts=1)
    c.set_trainjob_status(ns, name, active=1, ready=1)
    c.log(master, "resumed from iteration 1", "attempt 2 done")
    time.sleep(0.2)
    c.add_node_pod(ns, name, 0, "Succeeded", {"terminated": {"exitCode": 0}}, restarts=1)
    c.close_log(master)
    c.set_trainjob_status(ns, name, succeeded=1, condition=COMPLETE)
