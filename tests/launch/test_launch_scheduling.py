"""The scheduling timeout stands still while pods pull their image or wait for a node scale-up, as the pods'
events tell (kubelet ``Pulling``/``Pulled``, cluster autoscaler ``TriggeredScaleUp``/``NotTriggerScaleUp``; see
domino/launch/deadlines.py for the sources), and says so when it fires. Against the local API server."""

from __future__ import annotations

import time

import pytest

import launch_scenarios as sc
from fake_kube import FakeKubeServer

IMAGE = "registry.example/domino:1"
UNSCHEDULED = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]


@pytest.fixture
def server():
    with FakeKubeServer() as srv:
        yield srv


def _pending(c, job, **pod):
    ns, name = sc._ids(job)
    time.sleep(0.05)
    c.set_condition(ns, name, "Created", "PyTorchJobCreated", "created")
    return ns, name, [c.add_pod(ns, name, "master", 0, **pod), c.add_pod(ns, name, "worker", 0, **pod)]


def pull_then_run(c, job, pull_s=4.0):
    """Both pods scheduled, the kubelets pull the (multi-GB) image for longer than the scheduling timeout."""
    ns, name, pods = _pending(c, job)
    for pod in pods:
        c.add_event(ns, pod, "Scheduled", f"Successfully assigned {ns}/{pod} to gpu-node", etype="Normal")
        c.add_event(ns, pod, "Pulling", f'Pulling image "{IMAGE}"', etype="Normal")
    time.sleep(pull_s)
    for pod in pods:
        c.add_event(ns, pod, "Pulled", f'Successfully pulled image "{IMAGE}" in 4.1s (4.1s including waiting)',
                    etype="Normal")
    sc.succeed(c, job)


def scale_up_then_run(c, job, wait_s=4.0):
    ns, name, pods = _pending(c, job, conditions=UNSCHEDULED)
    for pod in pods:
        c.add_event(ns, pod, "FailedScheduling", UNSCHEDULED[0]["message"])
        c.add_event(ns, pod, "TriggeredScaleUp", "pod triggered scale-up: [{gpu-pool 0->2 (max: 8)}]", etype="Normal")
    time.sleep(wait_s)
    sc.succeed(c, job)


def scale_up_forever(c, job):
    scale_up_then_run(c, job, wait_s=3600)


def no_scale_up(c, job):
    ns, name, pods = _pending(c, job, conditions=UNSCHEDULED)
    for pod in pods:
        c.add_event(ns, pod, "TriggeredScaleUp", "pod triggered scale-up: [{gpu-pool 0->2 (max: 8)}]", etype="Normal")
        c.add_event(ns, pod, "NotTriggerScaleUp", "pod didn't trigger scale-up: 1 max node group size reached",
                    etype="Normal")


def test_image_pulls_do_not_count_against_the_scheduling_timeout(server):
    server.cluster.on_create = pull_then_run
    lines = []
    result = sc.launcher(server, lines).run(sc.spec(), run_id="run-p", scheduling_timeout_s=1.5, timeout_s=60)
    assert result.succeeded, result.reason
    assert any(f"scheduling clock paused: pod gpt-run-p-master-0 is pulling image {IMAGE}" in line for line in lines)


def test_a_scale_up_does_not_count_against_the_scheduling_timeout(server):
    server.cluster.on_create = scale_up_then_run
    lines = []
    result = sc.launcher(server, lines).run(sc.spec(), run_id="run-s", scheduling_timeout_s=1.5, timeout_s=60)
    assert result.succeeded, result.reason
    assert any("scheduling clock paused: pod gpt-run-s-worker-0 waits for a new node: pod triggered scale-up"
               in line for line in lines)


def test_the_pauses_are_bounded_and_the_reason_says_what_the_clock_stood_still_for(server):
    server.cluster.on_create = scale_up_forever
    result = sc.launcher(server, [], max_pause_s=3.0).run(sc.spec(), run_id="run-f", scheduling_timeout_s=1.5,
                                                           timeout_s=60)
    assert result.reason.startswith("SchedulingTimeout: the job was still Created (not Running) after 1.5 s "
                                    "(not counting 3 s of waiting for a node scale-up): "), result.reason
    assert "event on gpt-run-f-master-0: TriggeredScaleUp: pod triggered scale-up" in result.reason
    assert server.cluster.deleted == ["gpt-run-f"]


def test_a_scale_up_the_autoscaler_gave_up_on_fires_on_time_with_its_reason(server):
    server.cluster.on_create = no_scale_up
    start = time.monotonic()
    result = sc.launcher(server, []).run(sc.spec(), run_id="run-n", scheduling_timeout_s=1.5, timeout_s=60)
    assert time.monotonic() - start < 15
    assert result.reason.startswith("SchedulingTimeout: the job was still Created (not Running) after 1.5 s: ")
    assert "NotTriggerScaleUp: pod didn't trigger scale-up: 1 max node group size reached" in result.reason


def test_a_failed_pull_is_not_a_wait(server):
    server.cluster.on_create = sc.stay_pending  # ImagePullBackOff and a Failed pull: no pause
    result = sc.launcher(server, []).run(sc.spec(), run_id="run-b", scheduling_timeout_s=1.5, timeout_s=60,
                                         cleanup="always")
    assert result.reason.startswith("SchedulingTimeout: the job was still Created (not Running) after 1.5 s: ")
