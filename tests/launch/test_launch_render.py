"""Rendering: every variant passes the real CRD schema, the webhook rules and the Pod schema."""

from __future__ import annotations

import copy
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from domino.cli.main import main as domino_main
from domino.launch import JobSpec, LaunchSpecError, Toleration, naming
from domino.launch.render import container_command, render_job
from k8s_schemas import crd_validator, validate_job, webhook_problems

BASE = dict(name="gpt", image="registry.example/domino:1.0", pretrain_args=["--preset", "tiny"])

VARIANTS = {
    "single-node-cpu": dict(),
    "two-node-gpu": dict(nodes=2, nproc_per_node=8, gpus_per_node=8, cpu_request="32", memory_request="256Gi",
                         cpu_limit="48", memory_limit="400Gi"),
    "many-nodes-auto": dict(nodes=64, nproc_per_node="auto", gpus_per_node=8),
    "gpu-nproc": dict(nodes=3, nproc_per_node="gpu", gpus_per_node=4, shm_size=None),
    "scheduling": dict(nodes=2, node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                       tolerations=[Toleration.parse("nvidia.com/gpu:NoSchedule"),
                                    Toleration.parse("dedicated=training:NoExecute")],
                       priority_class="training-high", image_pull_secrets=["regcred"],
                       service_account="domino-trainer", image_pull_policy="Always"),
    "policies": dict(restart_policy="ExitCode", backoff_limit=0, active_deadline_seconds=7200,
                     ttl_seconds_after_finished=600, clean_pod_policy="All"),
    "no-ttl": dict(backoff_limit=None, ttl_seconds_after_finished=None, clean_pod_policy="None"),
    "meta": dict(env={"NCCL_DEBUG": "INFO", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"},
                 labels={"team": "nlp", "example.com/cost-center": "42"},
                 annotations={"example.com/note": "anything: goes here"}, owner="alice"),
    "secrets": dict(env={"NCCL_DEBUG": "INFO"}, secret_env={"HF_TOKEN": "hf-credentials:token",
                                                            "WANDB_API_KEY": "wandb.team-a:api-key"},
                    env_from_secrets=["mlflow-credentials"]),
    "command": dict(command=["torchrun", "-m", "domino.launch.envcheck", "--out", "/mnt/domino/envcheck"]),
    "custom-storage": dict(pvc="shared-rwx", mount_path="/data", checkpoint_dir="/data/ckpt/gpt"),
    "long-name": dict(name="a" * 40, nodes=1000),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant_validates_against_crd_webhook_and_pod_schema(variant):
    spec = JobSpec(**{**BASE, **VARIANTS[variant]})
    job = render_job(spec, run_id="0f8fad5b-d9cb-469f-a165-70867728950e")
    validate_job(job)


def test_pod_security_and_volumes_follow_the_contract():
    spec = JobSpec(**{**BASE, "nodes": 2, "gpus_per_node": 2, "nproc_per_node": 2})
    job = render_job(spec, run_id="r1")
    for rtype, count in (("Master", 1), ("Worker", 1)):
        rs = job["spec"]["pytorchReplicaSpecs"][rtype]
        assert rs["replicas"] == count and rs["restartPolicy"] == "OnFailure"
        pod = rs["template"]["spec"]
        (container,) = pod["containers"]
        assert container["name"] == "pytorch"
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["runAsNonRoot"] is True and sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] > 0
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes[mounts["/mnt/domino"]]["persistentVolumeClaim"] == {"claimName": "domino-data"}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert container["command"][:9] == [*["python", "-m", "domino.launch.signal_relay", "--grace-period-s", "180"], "torchrun", "-m", "domino", "pretrain"]
        assert pod["automountServiceAccountToken"] is False
    assert job["spec"]["nprocPerNode"] == "2"
    assert job["metadata"]["labels"][naming.RUN_ID_LABEL] == "r1"
    assert job["metadata"]["annotations"][naming.RUN_ID_ANNOTATION] == "r1"


def test_save_and_load_point_at_one_directory_on_the_pvc_unless_given():
    spec = JobSpec(**BASE)
    cmd = container_command(spec, "gpt-r1")
    assert cmd[cmd.index("--save") + 1] == cmd[cmd.index("--load") + 1] == "/mnt/domino/checkpoints/gpt-r1"
    spec = JobSpec(**{**BASE, "pretrain_args": ["--preset", "tiny", "--load=/mnt/domino/base"]})
    cmd = container_command(spec, "gpt-r1")
    assert "--load" not in cmd and "--load=/mnt/domino/base" in cmd and "--save" in cmd
    # A --save of one's own: --load follows it (a restart resumes it), not the job's empty default folder.
    for given in (["--save", "/mnt/domino/mine"], ["--save=/mnt/domino/mine"]):
        cmd = container_command(JobSpec(**{**BASE, "pretrain_args": ["--preset", "tiny", *given]}), "gpt-r1")
        assert cmd[cmd.index("--load") + 1] == "/mnt/domino/mine"
        assert "/mnt/domino/checkpoints/gpt-r1" not in cmd


def test_validators_reject_what_the_cluster_would_reject():
    """The checks themselves can fail: broken objects are caught by each layer."""
    job = render_job(JobSpec(**BASE), run_id="r1")
    bad = copy.deepcopy(job)
    bad["spec"]["runPolicy"]["cleanPodPolicy"] = 3
    assert list(crd_validator().iter_errors(bad))
    bad = copy.deepcopy(job)
    bad["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["name"] = "trainer"
    assert webhook_problems(bad)
    bad = copy.deepcopy(job)
    bad["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = 2
    assert webhook_problems(bad)
    bad = copy.deepcopy(job)
    bad["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_job(bad)


@pytest.mark.parametrize("field,value,flag", [
    ("name", "GPT", "--name"), ("name", "1gpt", "--name"), ("nodes", 0, "--nodes"),
    ("nproc_per_node", "many", "--nproc-per-node"), ("gpus_per_node", -1, "--gpus-per-node"),
    ("memory_limit", "lots", "--memory-limit"), ("restart_policy", "Always", "--restart-policy"),
    ("clean_pod_policy", "Some", "--clean-pod-policy"), ("mount_path", "relative", "--mount-path"),
    ("env", {"1BAD": "x"}, "--env"), ("labels", {"team": "a b"}, "--label"),
    ("tolerations", [Toleration("k", "v", "Sometimes")], "--toleration"), ("pvc", "Bad_Name", "--pvc"),
])
def test_invalid_specs_name_the_flag(field, value, flag):
    with pytest.raises(LaunchSpecError, match=flag):
        JobSpec(**{**BASE, field: value}).validate()


def test_more_processes_than_gpus_is_rejected():
    with pytest.raises(LaunchSpecError, match="--nproc-per-node: 4 processes per node but only 2 GPUs"):
        JobSpec(**{**BASE, "nproc_per_node": 4, "gpus_per_node": 2}).validate()


@settings(max_examples=200, deadline=None)
@given(base=st.from_regex(r"[a-z][a-z0-9-]{0,39}", fullmatch=True).filter(lambda s: not s.endswith("-")),
       run_id=st.text(min_size=1, max_size=80), nodes=st.integers(1, 100000))
def test_job_names_are_dns1035_fit_pod_suffixes_and_are_stable(base, run_id, nodes):
    name = naming.job_name(base, run_id, nodes)
    assert naming.job_name(base, run_id, nodes) == name
    assert len(name) + naming.pod_suffix_length(nodes) <= 63
    assert webhook_problems({"metadata": {"name": name}, "spec": {"pytorchReplicaSpecs": {
        "Master": {"replicas": 1, "template": {"spec": {"containers": [{"name": "pytorch"}]}}}}}}) == []
    value = naming.label_value(run_id)
    assert len(value) <= 63 and (value == "" or (value[0].isalnum() and value[-1].isalnum()))


def test_different_runs_get_different_names():
    names = {naming.job_name("gpt", f"9f1c2b7e-1234-4abc-9def-{i:012d}", 8) for i in range(1000)}
    assert len(names) == 1000


def test_cli_render_prints_the_job(capsys):
    with pytest.raises(SystemExit) as exit_info:
        domino_main(["launch", "render", "--name", "gpt", "--image", "img:1", "--nodes", "2", "--nproc-per-node",
                     "2", "--gpus-per-node", "2", "--pvc", "shared", "--run-id", "abc", "--toleration",
                     "nvidia.com/gpu:NoSchedule", "--env", "NCCL_DEBUG=WARN", "--", "--preset", "tiny",
                     "--train-iters", "4", "--mock-data"])
    assert exit_info.value.code == 0
    job = yaml.safe_load(capsys.readouterr().out)
    validate_job(job)
    assert job["metadata"]["name"] == "gpt-abc"
    master = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert master["containers"][0]["command"][9:14] == ["--preset", "tiny", "--train-iters", "4", "--mock-data"]
    assert master["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def test_cli_render_rejects_bad_flags_before_rendering(capsys):
    with pytest.raises(SystemExit) as exit_info:
        domino_main(["launch", "render", "--name", "gpt", "--image", "img:1", "--env", "NOEQUALS"])
    assert exit_info.value.code == 2
    assert "--env: expected KEY=VALUE" in capsys.readouterr().err


def test_rendering_imports_neither_torch_nor_kubernetes():
    code = ("import sys; from domino.cli.main import build_parser; build_parser(); "
            "from domino.launch.render import render_job; from domino.launch import JobSpec; "
            "render_job(JobSpec(name='a', image='b'), 'r'); "
            "bad = [m for m in ('torch', 'kubernetes') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code.replace("from domino.cli.main import build_parser; build_parser(); ",
                                                       "")], check=True)


def test_pretrain_args_are_checked_for_the_jobs_world_size():
    from domino.launch.pretrain_args import resolve_pretrain

    ok = JobSpec(name="gpt", image="i", nodes=2, nproc_per_node=2,
                 pretrain_args=["--preset", "tiny", "--tensor-model-parallel-size", "2", "--train-iters", "4",
                                "--data-path", "/mnt/domino/data/x_text_document"])
    resolve_pretrain(ok)
    with pytest.raises(LaunchSpecError, match="world size 3 is not divisible by --tensor-model-parallel-size 2"):
        resolve_pretrain(JobSpec(**{**ok.__dict__, "nodes": 3, "nproc_per_node": 1}))
    with pytest.raises(LaunchSpecError, match="unrecognized arguments: --trian-iters"):
        resolve_pretrain(JobSpec(**{**ok.__dict__, "pretrain_args": ["--mock-data", "--trian-iters", "4"]}))
    with pytest.raises(LaunchSpecError, match="no training data"):
        resolve_pretrain(JobSpec(**{**ok.__dict__, "pretrain_args": ["--train-iters", "4"]}))
    resolve_pretrain(JobSpec(**{**ok.__dict__, "command": ["sleep", "1"], "pretrain_args": ["--what"]}))


def test_gpu_memory_gb_refuses_a_layout_the_estimate_says_cannot_fit(capsys):
    """GPT-3 6.7B at TP 1 x DP 8, ZeRO 1 with micro-batches of 16 needs ~72 GiB of activations on top of ~34 GiB of
    weights, gradients and optimizer shard: no 80 GB GPU takes it; micro-batch 8 does with ZeRO 2 (at ZeRO 1, bf16's
    BF16_Optimizer keeps an fp32 gradient buffer of all 6.7B parameters on every rank: 25 GiB, domino/config/
    deepspeed_memory.py), and so does the preset's own layout. The refusal carries the numbers and the best layout
    that fits."""
    flags = ["launch", "render", "--name", "gpt", "--image", "img:1", "--nproc-per-node", "8", "--gpus-per-node",
             "8", "--run-id", "abc", "--gpu-memory-gb", "80", "--", "--preset", "gpt3-6.7b", "--train-iters", "4",
             "--mock-data", "--vocab-size", "50257"]
    with pytest.raises(SystemExit) as exit_info:
        domino_main(flags[:-8] + ["--", "--preset", "gpt3-6.7b", "--tensor-model-parallel-size", "1",
                                  "--zero-stage", "1", "--micro-batch-size", "16", "--train-iters", "4",
                                  "--mock-data"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--gpu-memory-gb 80: the estimate (domino estimate) is" in err and "GiB per GPU, over 90% of 80 GiB" in err
    assert "TP 1 x DP 8, ZeRO 1, micro-batch 16" in err and "weights 12.40" in err and "activations 72.38" in err
    assert "the best layout that fits: TP 1 x DP 8, ZeRO 2, micro-batch 8" in err
    with pytest.raises(SystemExit) as exit_info:
        domino_main(flags)
    assert exit_info.value.code == 0, capsys.readouterr().err
    with pytest.raises(LaunchSpecError, match="--gpu-memory-gb: must be > 0"):
        JobSpec(**{**BASE, "gpu_memory_gb": 0.0}).validate()


def test_pipeline_layouts_are_checked_against_the_pods_and_the_gpus_memory(capsys):
    """world = TP x PP x DP over nodes x processes per node: 3 pods of 4 processes cannot hold 8 stages; a 52B GPT in
    fp32 at TP 8 x PP 2 on 2 pods of 8 GPUs fits 80 GB GPUs (its fuller, first stage 61 GiB) and not 40 GB ones.
    Each refusal is one line, before any object exists."""
    job = ["launch", "render", "--name", "gpt", "--image", "img:1", "--run-id", "abc"]
    run = ["--mock-data", "--train-iters", "4"]
    with pytest.raises(SystemExit) as exit_info:
        domino_main([*job, "--nodes", "3", "--nproc-per-node", "4", "--", "--preset", "tiny",
                     "--pipeline-model-parallel-size", "8", *run])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "(world size 12): world size 12 is not divisible by --tensor-model-parallel-size 1 x " \
                              "--pipeline-model-parallel-size 8" in err[0]
    big = ["--num-layers", "64", "--hidden-size", "8192", "--num-attention-heads", "64", "--seq-length", "2048",
           "--vocab-size", "50257", "--global-batch-size", "64", "--micro-batch-size", "1",
           "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "2", "--sequence-parallel", *run]
    gpus = ["--nodes", "2", "--nproc-per-node", "8", "--gpus-per-node", "8"]
    with pytest.raises(SystemExit) as exit_info:
        domino_main([*job, *gpus, "--gpu-memory-gb", "40", "--", *big])
    assert exit_info.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]  # not the start-up notes
    assert len(err) == 1 and "--gpu-memory-gb 40: the estimate (domino estimate) is 61.4 GiB per GPU" in err[0]
    assert "TP 8 x PP 2 x DP 1, ZeRO 0, micro-batch 1, recompute none, SP on" in err[0]
    assert "on stage 0 of 2, 64 micro-batches, bubble 1.5%" in err[0]
    with pytest.raises(SystemExit) as exit_info:
        domino_main([*job, *gpus, "--gpu-memory-gb", "80", "--", *big])
    assert exit_info.value.code == 0, capsys.readouterr().err


def test_run_job_rejects_bad_args_before_any_backend_work(tmp_path):
    from domino.launch import run_job

    with pytest.raises(LaunchSpecError, match="--train-iters"):
        run_job(JobSpec(name="gpt", image="i", pretrain_args=["--mock-data"]), "local", workdir=str(tmp_path))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="--cleanup"):
        run_job(JobSpec(name="gpt", image="i", command=["true"]), "local", cleanup="sometimes")
    with pytest.raises(ValueError, match="backend"):
        run_job(JobSpec(name="gpt", image="i", command=["true"]), "slurm")


def _qos_class(pod_spec) -> str:
    """The pod's QoS class by the Kubernetes rule ("Pod Quality of Service Classes"): BestEffort when no
    container has a CPU or memory request or limit; Guaranteed when every container's CPU and memory
    requests equal their limits; Burstable otherwise."""
    res = [c.get("resources") or {} for c in pod_spec["containers"]]
    keys = ("cpu", "memory")
    if not any(k in r.get(kind, {}) for r in res for kind in ("requests", "limits") for k in keys):
        return "BestEffort"
    if all(r.get("limits", {}).get(k) and r.get("requests", {}).get(k, r["limits"][k]) == r["limits"][k]
           for r in res for k in keys):
        return "Guaranteed"
    return "Burstable"


def test_defaults_pass_the_restart_grace_requests_and_network_rules():
    """A 4-node x 8-GPU job with no policy flags: restarts scale with nodes, room to save on SIGTERM,
    GPU pods are not BestEffort, no Istio sidecar, and the GPU environment Domino's overlap needs."""
    job = render_job(JobSpec(**{**BASE, "nodes": 4, "nproc_per_node": 8, "gpus_per_node": 8}), run_id="r1")
    validate_job(job)
    policy = job["spec"]["runPolicy"]
    assert policy["backoffLimit"] >= 4 and policy["backoffLimit"] == 12  # 3 faults x 4 pods
    for rtype in ("Master", "Worker"):
        rs = job["spec"]["pytorchReplicaSpecs"][rtype]
        assert rs["restartPolicy"] == "OnFailure"
        pod = rs["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] >= 120
        (container,) = pod["containers"]
        assert container["resources"]["requests"] == {"cpu": "32", "memory": "128Gi", "nvidia.com/gpu": "8"}
        assert _qos_class(pod) == "Burstable"
        assert rs["template"]["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
        assert rs["template"]["metadata"]["labels"]["sidecar.istio.io/inject"] == "false"
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and env["NCCL_DEBUG"] == "WARN"
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert {"/tmp", "/home/domino", "/dev/shm"} <= mounts
    # The rule the check enforces can fail: a GPU-only pod is BestEffort.
    assert _qos_class({"containers": [{"resources": {"limits": {"nvidia.com/gpu": "8"}}}]}) == "BestEffort"
    # Overrides win; CPU pods get smaller requests and no GPU environment.
    job = render_job(JobSpec(**{**BASE, "nodes": 2, "nproc_per_node": 2, "cpu_request": "3", "backoff_limit": 1,
                                "termination_grace_period_s": 600, "env": {"NCCL_DEBUG": "INFO"}}), run_id="r1")
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["requests"] == {"cpu": "3", "memory": "4Gi"}
    assert job["spec"]["runPolicy"]["backoffLimit"] == 1 and pod["terminationGracePeriodSeconds"] == 600
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    assert env.keys() == {"DOMINO_JOB_NAME", "NCCL_DEBUG", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "PET_RDZV_CONF"}
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "540"  # torchrun's SIGKILL comes 60 s before the kubelet's


def test_queue_labels_the_job_for_kueue_and_leaves_suspending_it_to_kueue():
    job = render_job(JobSpec(**{**BASE, "nodes": 2, "queue": "team-gpus"}), run_id="r1")
    validate_job(job)
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-gpus"
    assert "suspend" not in job["spec"]["runPolicy"]  # Kueue's webhook sets it (tests/launch/test_launch_kueue.py)
    assert "schedulingPolicy" not in job["spec"]["runPolicy"]
    plain = render_job(JobSpec(**BASE), run_id="r1")
    assert "suspend" not in plain["spec"]["runPolicy"] and "kueue.x-k8s.io/queue-name" not in plain["metadata"]["labels"]
    gang = render_job(JobSpec(**{**BASE, "nodes": 4, "queue": "q", "priority_class": "high",
                                 "scheduling_policy": True}), run_id="r1")
    validate_job(gang)
    assert gang["spec"]["runPolicy"]["schedulingPolicy"] == {"minAvailable": 4, "queue": "q", "priorityClass": "high"}
    with pytest.raises(LaunchSpecError, match="--queue"):
        JobSpec(**{**BASE, "queue": "Not A Queue"}).validate()


def test_namespace_defaults_to_the_launching_pods(monkeypatch):
    monkeypatch.setenv("POD_NAMESPACE", "kubeflow-user-alice")
    assert JobSpec(**BASE).namespace == "kubeflow-user-alice"
    assert JobSpec(**{**BASE, "namespace": "other"}).namespace == "other"
    monkeypatch.delenv("POD_NAMESPACE")
    assert JobSpec(**BASE).namespace == "domino"


def test_gpu_pods_tolerate_the_nvidia_gpu_taint_by_default_for_both_apis():
    from domino.launch.trainjob import render_trainjob

    def tolerations(job):
        if job["kind"] == "PyTorchJob":
            return [r["template"]["spec"].get("tolerations") for r in job["spec"]["pytorchReplicaSpecs"].values()]
        patch = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
        return [patch["template"]["spec"]["template"]["spec"].get("tolerations")]

    gpu = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    for render in (render_job, render_trainjob):
        four_by_eight = dict(name="gpt", image="i", nodes=4, nproc_per_node=8, gpus_per_node=8)
        assert all(t == [gpu] for t in tolerations(render(JobSpec(**four_by_eight), run_id="r")))
        assert tolerations(render(JobSpec(name="gpt", image="i", nodes=2), run_id="r")) in ([None, None], [None])
        off = render(JobSpec(**four_by_eight, gpu_toleration=False), run_id="r")
        assert all(t is None for t in tolerations(off))
        own = Toleration(key="nvidia.com/gpu", value="a100", effect="NoExecute")
        mine = render(JobSpec(**four_by_eight, tolerations=[own]), run_id="r")
        assert all(t == [own.to_dict()] for t in tolerations(mine))  # yours replaces the default


def test_secrets_reach_the_container_as_references_never_as_values(capsys):
    """What the API server validates (the Pod schema) and what the kubelet resolves: secretKeyRef / envFrom."""
    with pytest.raises(SystemExit) as exit_info:
        domino_main(["launch", "render", "--name", "gpt", "--image", "registry.example/domino:1",
                     "--env", "NCCL_DEBUG=INFO", "--env-secret", "HF_TOKEN=hf-credentials:token",
                     "--env-from-secret", "mlflow-credentials", "--", "--preset", "tiny", "--train-iters", "4",
                     "--mock-data"])
    assert exit_info.value.code == 0
    job = yaml.safe_load(capsys.readouterr().out)
    validate_job(job)
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        (container,) = replica["template"]["spec"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env["HF_TOKEN"] == {"name": "HF_TOKEN",
                                   "valueFrom": {"secretKeyRef": {"name": "hf-credentials", "key": "token"}}}
        assert env["NCCL_DEBUG"] == {"name": "NCCL_DEBUG", "value": "INFO"}
        assert container["envFrom"] == [{"secretRef": {"name": "mlflow-credentials"}}]


@pytest.mark.parametrize("field, value, message", [
    ("secret_env", {"HF_TOKEN": "hf-credentials:"}, "expected SECRET:KEY"),
    ("secret_env", {"HF_TOKEN": "Bad_Name:token"}, "expected SECRET:KEY"),
    ("secret_env", {"1X": "s:k"}, "not a valid environment variable name"),
    ("env_from_secrets", ["Not_A_Name"], "not a valid Secret name"),
])
def test_bad_secret_references_name_the_flag(field, value, message):
    with pytest.raises(LaunchSpecError, match=message):
        JobSpec(**{**BASE, field: value}).validate()
    with pytest.raises(LaunchSpecError, match="also given a literal value"):
        JobSpec(**{**BASE, "env": {"HF_TOKEN": "x"}, "secret_env": {"HF_TOKEN": "s:k"}}).validate()
