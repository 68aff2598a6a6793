"""The local backend: replicas as processes with exactly the operator's environment."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from domino.launch import JobSpec, run_job
from domino.launch.local_backend import LocalLauncher, local_command, retryable
from domino.launch.pytorchjob import PyTorchJobApi

replica_env = PyTorchJobApi().node_env

OPERATOR_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "PET_NNODES", "PET_NPROC_PER_NODE",
                 "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT", "PYTHONUNBUFFERED", "NCCL_DEBUG")


def _py(code: str) -> list:
    return ["python", "-c", code]


def test_replica_env_matches_the_operator_table():
    spec = JobSpec(name="gpt", image="i", nodes=3, nproc_per_node=4, env={"NCCL_DEBUG": "INFO"})
    env = replica_env(spec, "gpt-r", 2, 31000)
    assert env == {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "31000", "WORLD_SIZE": "12", "RANK": "2",
                   "PET_NNODES": "3", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "2",
                   "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": "31000", "PYTHONUNBUFFERED": "1",
                   "DOMINO_JOB_NAME": "gpt-r", "NCCL_DEBUG": "INFO", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "162",
                   "PET_RDZV_CONF": "timeout=1200"}
    # WORLD_SIZE counts pods when nprocPerNode is not an integer.
    assert replica_env(JobSpec(name="gpt", image="i", nodes=3, nproc_per_node="auto"), "g", 0, 1)["WORLD_SIZE"] == "3"


def test_torchrun_resolves_to_this_interpreter_and_mount_path_maps_to_workdir():
    spec = JobSpec(name="gpt", image="i", pretrain_args=["--data-path", "/mnt/domino/data/x", "--tag=/mnt/dominoX"])
    cmd = local_command(spec, "gpt-r", "/work/dir")
    assert cmd[:9] == [sys.executable, "-m", "domino.launch.signal_relay", "--grace-period-s", "180", sys.executable,
                       "-m", "torch.distributed.run", "-m"]  # the relay's command too
    assert "/work/dir/data/x" in cmd and "--tag=/mnt/dominoX" in cmd  # only whole path prefixes
    assert cmd[cmd.index("--save") + 1] == "/work/dir/checkpoints/gpt-r"


def test_restart_policy_semantics():
    assert retryable("OnFailure", 1) and retryable("OnFailure", 137)
    assert not retryable("ExitCode", 1) and not retryable("ExitCode", 127)
    assert retryable("ExitCode", 128) and retryable("ExitCode", 143)


def test_each_replica_gets_the_operator_env_in_its_own_process(tmp_path):
    code = ("import json, os; json.dump({k: os.environ.get(k) for k in %r}, "
            "open('/mnt/domino/env-' + os.environ['PET_NODE_RANK'] + '.json', 'w')); print('replica ok')"
            % (OPERATOR_VARS,))
    spec = JobSpec(name="envs", image="i", nodes=3, nproc_per_node=4, env={"NCCL_DEBUG": "INFO"}, command=_py(code))
    lines = []
    result = run_job(spec, "local", run_id="t", workdir=str(tmp_path), log=lines.append)
    assert result.succeeded and result.exit_code == 0 and "replica ok" in result.log_tail
    seen = [json.loads((tmp_path / f"env-{r}.json").read_text()) for r in range(3)]
    port = seen[0]["MASTER_PORT"]
    for rank, env in enumerate(seen):
        assert env == {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "12", "RANK": str(rank),
                       "PET_NNODES": "3", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": str(rank),
                       "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": port, "PYTHONUNBUFFERED": "1",
                       "NCCL_DEBUG": "INFO"}
    assert (tmp_path / "logs" / "envs-t-worker-1.log").exists()


def test_two_nodes_under_torchrun_all_reduce(tmp_path):
    """The multi-node contract for real: 2 replicas x 1 process, torchrun reading PET_*, gloo all-reduce."""
    spec = JobSpec(name="envcheck", image="i", nodes=2, nproc_per_node=1,
                   command=["torchrun", "-m", "domino.launch.envcheck", "--out", "/mnt/domino/envcheck"])
    lines = []
    result = run_job(spec, "local", run_id="t", workdir=str(tmp_path), log=lines.append, timeout_s=120)
    assert result.succeeded, result.describe()
    reports = [json.loads((tmp_path / "envcheck" / f"envcheck-rank{r}.json").read_text()) for r in range(2)]
    for rank, report in enumerate(reports):
        assert report["world_size"] == 2 and report["all_reduce"] == 3.0 == report["expected"]
        env = report["env"]
        assert env["PET_NNODES"] == "2" and env["PET_NPROC_PER_NODE"] == "1"
        assert env["PET_NODE_RANK"] == env["GROUP_RANK"] == str(rank)  # torchrun took its node rank from PET_*
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "2" and env["MASTER_ADDR"] == "127.0.0.1"
        assert env["PET_MASTER_PORT"] == reports[0]["env"]["PET_MASTER_PORT"]
    assert any("envcheck rank 0/2: all_reduce=3" in line for line in lines)


def test_a_failing_replica_fails_the_job_and_stops_the_others(tmp_path):
    code = ("import os, sys, time; r = int(os.environ['RANK']); print('replica', r, flush=True); "
            "open('/mnt/domino/pid-%d' % r, 'w').write(str(os.getpid())); "
            "sys.exit(3) if r == 1 else time.sleep(120)")
    spec = JobSpec(name="bad", image="i", nodes=2, backoff_limit=0, command=_py(code))
    start = time.monotonic()
    result = LocalLauncher(log=lambda _: None, kill_grace_s=2).run(spec, run_id="t", workdir=str(tmp_path))
    assert time.monotonic() - start < 60
    assert not result.succeeded and result.phase == "Failed" and result.exit_code == 3
    assert "replica bad-t-worker-0 exited with code 3" in result.reason
    assert "replica 0" in result.log_tail
    _assert_dead(int((tmp_path / "pid-0").read_text()))


def _assert_dead(pid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.parametrize("policy,code,restarted", [("OnFailure", 3, True), ("ExitCode", 3, False),
                                                   ("ExitCode", 137, True)])
def test_restarts_follow_the_restart_policy(tmp_path, policy, code, restarted):
    script = ("import os, sys; p = '/mnt/domino/attempted'; first = not os.path.exists(p); "
              "open(p, 'a').write('x'); sys.exit(%d if first else 0)" % code)
    # One fault restarts both replicas (the peer fails with it): the default backoffLimit (3 x nodes) allows it.
    spec = JobSpec(name="retry", image="i", nodes=2, restart_policy=policy, command=_py(script))
    lines = []
    result = run_job(spec, "local", run_id="t", workdir=str(tmp_path), log=lines.append)
    assert result.succeeded is restarted
    assert any("Restarting" in line for line in lines) is restarted
    if not restarted:
        assert result.reason.startswith("PermanentFailure") and result.exit_code == code


def test_timeout_and_sigterm_kill_every_replica(tmp_path):
    code = ("import os, time; open('/mnt/domino/pid-' + os.environ['RANK'], 'w').write(str(os.getpid())); "
            "time.sleep(120)")
    spec = JobSpec(name="slow", image="i", nodes=2, command=_py(code))
    result = LocalLauncher(log=lambda _: None, kill_grace_s=2).run(spec, run_id="t", timeout_s=3,
                                                                   workdir=str(tmp_path / "a"))
    assert result.reason.startswith("Timeout: ") and not result.succeeded
    for rank in range(2):
        _assert_dead(int((tmp_path / "a" / f"pid-{rank}").read_text()))

    def cancel_once_running():  # like a cancelled pipeline: SIGTERM while the replicas run
        deadline = time.monotonic() + 60
        while not all((tmp_path / "b" / f"pid-{r}").exists() for r in range(2)) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=cancel_once_running, daemon=True).start()
    result = LocalLauncher(log=lambda _: None, kill_grace_s=2).run(spec, run_id="t", workdir=str(tmp_path / "b"))
    assert result.reason.startswith("Interrupted: ")
    for rank in range(2):
        _assert_dead(int((tmp_path / "b" / f"pid-{rank}").read_text()))
    assert Path(tmp_path / "b" / "logs").is_dir()


def test_on_failure_counts_every_replicas_restart_and_stops_a_crash_loop(tmp_path):
    """A replica that always dies (an OOM loop, exit 137) costs one restart per replica per fault under
    OnFailure, so the default backoffLimit of 3 x nodes ends it; ExitCode would retry it forever."""
    code = ("import os, sys, time; r = int(os.environ['RANK']); "
            "open('/mnt/domino/starts-%d' % r, 'a').write('x'); os._exit(137) if r == 1 else time.sleep(60)")
    spec = JobSpec(name="oom", image="i", nodes=2, command=_py(code))
    lines = []
    result = LocalLauncher(log=lines.append, kill_grace_s=1, restart_delay_s=0.2).run(
        spec, run_id="t", workdir=str(tmp_path), timeout_s=120)
    assert result.reason.startswith("BackoffLimitExceeded: replica oom-t-worker-0 exited with code 137; "
                                    "6 restart(s) reached backoffLimit 6")
    assert [line for line in lines if "Restarting" in line][-1].endswith("(restarts 4, backoffLimit 6)")
    assert len((tmp_path / "starts-1").read_text()) == 3  # two faults survived, the third ends the job


TORCH_PLUGIN_VARS = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT",
                     "JOB_COMPLETION_INDEX", "DOMINO_JOB_NAME", "NCCL_DEBUG")
OPERATOR_ONLY = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


def test_each_trainjob_node_gets_exactly_the_torch_plugins_env(tmp_path, monkeypatch):
    """kubeflow/trainer v2.3.0 torch.go EnforceMLPolicy: PET_* only (no MASTER_ADDR/WORLD_SIZE/RANK, unlike
    the training operator); ``auto`` on a node without GPUs becomes its CPU request rounded up (1500m -> 2)."""
    for name in OPERATOR_ONLY:
        monkeypatch.delenv(name, raising=False)
    code = ("import json, os; json.dump({k: os.environ.get(k) for k in %r}, "
            "open('/mnt/domino/env-' + os.environ['PET_NODE_RANK'] + '.json', 'w')); print('node ok')"
            % (TORCH_PLUGIN_VARS + OPERATOR_ONLY,))
    spec = JobSpec(name="envs", image="i", nodes=3, nproc_per_node="auto", cpu_request="1500m",
                   env={"NCCL_DEBUG": "INFO"}, command=_py(code))
    lines = []
    result = run_job(spec, "local", api="trainjob", run_id="t", workdir=str(tmp_path), log=lines.append)
    assert result.succeeded and "node ok" in result.log_tail, result.describe()
    seen = [json.loads((tmp_path / f"env-{r}.json").read_text()) for r in range(3)]
    port = seen[0]["PET_MASTER_PORT"]
    for rank, env in enumerate(seen):
        assert env == {"PET_NNODES": "3", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": str(rank),
                       "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": port, "JOB_COMPLETION_INDEX": str(rank),
                       "DOMINO_JOB_NAME": "envs-t", "NCCL_DEBUG": "INFO", "MASTER_ADDR": None, "MASTER_PORT": None,
                       "WORLD_SIZE": None, "RANK": None}
    assert (tmp_path / "logs" / "envs-t-node-0-2.log").exists()  # the node pods' host names
    assert lines[0].startswith("local TrainJob envs-t: 3 node(s)")


def test_trainjob_nodes_under_torchrun_all_reduce(tmp_path):
    """The TrainJob multi-node contract for real: 2 nodes x 1 process, torchrun reading only the plugin's PET_*."""
    spec = JobSpec(name="envcheck", image="i", nodes=2, nproc_per_node=1,
                   command=["torchrun", "-m", "domino.launch.envcheck", "--out", "/mnt/domino/envcheck"])
    result = run_job(spec, "local", api="trainjob", run_id="t", workdir=str(tmp_path), log=lambda _: None,
                     timeout_s=120)
    assert result.succeeded, result.describe()
    for rank in range(2):
        report = json.loads((tmp_path / "envcheck" / f"envcheck-rank{rank}.json").read_text())
        assert report["world_size"] == 2 and report["all_reduce"] == 3.0 == report["expected"]
        assert report["env"]["GROUP_RANK"] == report["env"]["PET_NODE_RANK"] == str(rank)


def test_local_trainjob_refuses_what_the_cluster_would(tmp_path):
    from domino.launch import LaunchSpecError

    spec = JobSpec(name="x", image="i", restart_policy="ExitCode", command=_py("pass"))
    with pytest.raises(LaunchSpecError, match="--api trainjob: --restart-policy"):
        run_job(spec, "local", api="trainjob", workdir=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_the_local_backend_refuses_secret_references_it_cannot_resolve(tmp_path):
    from domino.launch.local_backend import LocalLauncher
    from domino.launch.spec import JobSpec, LaunchSpecError

    for extra in ({"secret_env": {"HF_TOKEN": "hf-credentials:token"}}, {"env_from_secrets": ["mlflow-credentials"]}):
        spec = JobSpec(name="gpt", image="img:1", pretrain_args=["--preset", "tiny"], **extra)
        with pytest.raises(LaunchSpecError, match="local backend"):
            LocalLauncher(log=lambda _: None).run(spec, workdir=str(tmp_path))
    assert not (tmp_path / "logs").exists()  # refused before anything started
