"""The pretrain step's plan: flags, warm start, validation, and the job spec the settings produce."""

import json
import os

import pytest

from components.layout import RunLayout
from components.pretrain.step import (
    PretrainSettings,
    job_spec,
    load_argv,
    parse_overrides,
    pretrain_argv,
)
from components.registry import PromotedModel, promote
from domino.launch.pretrain_args import resolve_pretrain
from domino.launch.render import render_job
from domino.launch.spec import JobSpec, LaunchSpecError


def _flag(argv, name):
    return argv[argv.index(name) + 1]


def check_config(argv, world_size):
    """The config a job of ``world_size`` processes running ``argv`` gets, resolved and checked as the step does."""
    return resolve_pretrain(JobSpec(name="gpt", image="i", nproc_per_node=world_size, pretrain_args=argv)).config


def test_argv_carries_parallelism_training_and_run_paths(tmp_path):
    settings = PretrainSettings(shared_root=str(tmp_path), run_id="run-1", preset="tiny", train_iters=7,
                                tensor_model_parallel_size=2, domino_chunks=2, zero_stage=1, global_batch_size=8, lr=0.01,
                                config_overrides=json.dumps({"num_layers": 3, "bf16": False, "seed": 5}))
    layout = RunLayout(str(tmp_path), "run-1")
    argv = pretrain_argv(settings, "/data/corpus_text_document", layout)
    assert _flag(argv, "--preset") == "tiny"
    assert _flag(argv, "--num-layers") == "3" and "--no-bf16" in argv and _flag(argv, "--seed") == "5"
    assert _flag(argv, "--tensor-model-parallel-size") == "2" and _flag(argv, "--domino-chunks") == "2"
    assert _flag(argv, "--train-iters") == "7" and _flag(argv, "--global-batch-size") == "8"
    assert _flag(argv, "--lr") == "0.01"
    assert _flag(argv, "--data-path") == "/data/corpus_text_document"
    assert _flag(argv, "--save") == layout.checkpoint_dir == os.path.join(str(tmp_path), "runs", "run-1", "checkpoints")
    assert _flag(argv, "--metrics-file") == layout.metrics_file
    assert _flag(argv, "--load") == layout.checkpoint_dir and "--finetune" not in argv
    config = check_config(argv, world_size=2)
    assert config.model.num_layers == 3 and config.parallel.tensor_model_parallel_size == 2


def test_a_config_parameter_not_given_leaves_its_flag_out():
    """Not given (None from Python, NOT_SET from kfp): no flag, so the preset's value or domino's default holds."""
    layout = RunLayout("/mnt/domino", "r")
    for settings in (PretrainSettings(shared_root="/mnt/domino", run_id="r"),
                     PretrainSettings(shared_root="/mnt/domino", run_id="r", lr=-1.0, global_batch_size=-1,
                                      save_interval=-1, zero_stage=-1, split="", domino_chunks=-1)):
        argv = pretrain_argv(settings, "p", layout)
        for flag in ("--lr", "--global-batch-size", "--save-interval", "--zero-stage", "--split", "--domino-chunks",
                     "--micro-batch-size", "--eval-interval", "--tokenizer"):
            assert flag not in argv, flag
        config = check_config(argv, world_size=2)
        assert config.train.lr == 0.003 and config.data.split == "90,5,5"  # the tiny preset's
        assert config.parallel.zero_stage is None and config.parallel.domino_chunks == 2  # domino's choice
    given = pretrain_argv(PretrainSettings(shared_root="/mnt/domino", run_id="r", zero_stage=0, save_interval=0),
                          "p", layout)
    assert _flag(given, "--zero-stage") == "0" and _flag(given, "--save-interval") == "0"  # 0 is a value


def test_overrides_may_not_shadow_pipeline_parameters():
    with pytest.raises(ValueError, match="'tensor_model_parallel_size' is a parameter of its own"):
        parse_overrides('{"tensor_model_parallel_size": 4}')
    with pytest.raises(ValueError, match="'save' is set by the run's layout"):
        parse_overrides('{"save": "/elsewhere"}')
    with pytest.raises(ValueError, match="config_overrides: not JSON"):
        parse_overrides("{num_layers: 4}")
    with pytest.raises(ValueError, match="expected a JSON object"):
        parse_overrides("[1]")


def test_invalid_combinations_fail_before_launch(tmp_path):
    layout = RunLayout(str(tmp_path), "r")
    bad_tp = pretrain_argv(PretrainSettings(shared_root=str(tmp_path), run_id="r", tensor_model_parallel_size=3), "p", layout)
    with pytest.raises(LaunchSpecError, match="world size 2 is not divisible by --tensor-model-parallel-size 3"):
        check_config(bad_tp, world_size=2)
    unknown = pretrain_argv(PretrainSettings(shared_root=str(tmp_path), run_id="r",
                                             config_overrides='{"num_layerz": 2}'), "p", layout)
    with pytest.raises(ValueError, match="num-layerz"):
        check_config(unknown, world_size=2)


def test_warm_start_uses_the_promoted_model_then_resumes_its_own(tmp_path):
    layout = RunLayout(str(tmp_path), "new")
    assert load_argv(True, layout) == ["--load", layout.checkpoint_dir]  # nothing promoted: fresh start
    promote(layout.registry_path, PromotedModel(run_id="old", checkpoint_dir="/ckpt/old", test_ppl=9.0, test_loss=2.2))
    assert load_argv(True, layout) == ["--load", "/ckpt/old", "--finetune"]
    assert load_argv(False, layout) == ["--load", layout.checkpoint_dir]
    # A retried step whose job already saved resumes its own checkpoint, not the promoted weights.
    os.makedirs(os.path.join(layout.checkpoint_dir, "iter_0000004"))
    with open(os.path.join(layout.checkpoint_dir, "iter_0000004", "checkpoint.json"), "w") as handle:
        handle.write("{}")
    with open(os.path.join(layout.checkpoint_dir, "latest"), "w") as handle:
        handle.write("iter_0000004\n")
    assert load_argv(True, layout) == ["--load", layout.checkpoint_dir]


def test_gpu_tolerations_node_selector_and_pvc_reach_the_pytorchjob():
    settings = PretrainSettings(
        shared_root="/mnt/domino", run_id="3f1c2b7e-aaaa-bbbb-cccc-0123456789ab", nodes=2, nproc_per_node=8,
        gpus_per_node=8, tensor_model_parallel_size=8, image="registry.example/domino:1", namespace="team-a",
        pvc_name="shared-rwx", memory_limit="512Gi", node_selector='{"nvidia.com/gpu.product": "H100"}',
        tolerations='["nvidia.com/gpu:NoSchedule", {"key": "dedicated", "value": "ml", "effect": "NoExecute"}]',
    )
    argv = pretrain_argv(settings, "/mnt/domino/runs/x/data/corpus_text_document",
                         RunLayout(settings.shared_root, settings.run_id))
    spec = job_spec(settings, argv)
    job = render_job(spec, settings.run_id)
    assert job["metadata"]["namespace"] == "team-a"
    assert job["spec"]["nprocPerNode"] == "8"
    assert job["spec"]["pytorchReplicaSpecs"]["Master"]["restartPolicy"] == "OnFailure"  # docs/cluster.md "Restarts"
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "registry.example/domino:1"
    assert container["resources"]["limits"]["nvidia.com/gpu"] in (8, "8")
    assert container["resources"]["limits"]["memory"] == "512Gi"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "H100"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoExecute"} in pod["tolerations"]
    claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert claims == ["shared-rwx"]
    assert any(m["mountPath"] == "/mnt/domino" for m in container["volumeMounts"])
    command = " ".join(container["command"] + container.get("args", []))
    assert "--tensor-model-parallel-size 8" in command and "--data-path /mnt/domino/runs/x/data" in command
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    assert "DS_ACCELERATOR" not in env  # GPUs: DeepSpeed picks CUDA itself


def test_cpu_job_tells_deepspeed_to_use_the_cpu_and_bad_json_is_named():
    settings = PretrainSettings(shared_root="/mnt/domino", run_id="r")
    assert job_spec(settings, []).env == {"DS_ACCELERATOR": "cpu"}
    with pytest.raises(ValueError, match="tolerations: not JSON"):
        job_spec(PretrainSettings(shared_root="/mnt/domino", run_id="r", tolerations="[oops"), [])
    with pytest.raises(ValueError, match="node_selector: expected a JSON object"):
        job_spec(PretrainSettings(shared_root="/mnt/domino", run_id="r", node_selector="[]"), [])


def test_job_api_trainjob_gives_a_crd_valid_trainjob_and_refusals_come_before_any_work(tmp_path):
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "launch"))
    from components.pretrain.step import run_pretrain
    from domino.launch import LaunchSpecError
    from domino.launch.job_api import job_api
    from k8s_schemas import validate_trainer_object

    settings = PretrainSettings(shared_root="/mnt/domino", run_id="r1", nodes=4, nproc_per_node=8, gpus_per_node=8,
                                tensor_model_parallel_size=8, job_api="trainjob", tolerations='["nvidia.com/gpu:NoSchedule"]')
    argv = pretrain_argv(settings, "/mnt/domino/data/c", RunLayout(settings.shared_root, settings.run_id))
    job = job_api(settings.job_api).render(job_spec(settings, argv), settings.run_id)
    validate_trainer_object(job, "trainjobs")
    assert job["spec"]["trainer"]["numNodes"] == 4 and job["spec"]["trainer"]["numProcPerNode"] == 8
    assert "--tensor-model-parallel-size" in job["spec"]["trainer"]["command"]
    # A setting the TrainJob cannot carry fails the step before the run folder or a job exists.
    manifest = tmp_path / "dataset.json"
    manifest.write_text(json.dumps({"prefix": str(tmp_path / "data" / "c")}))
    bad = PretrainSettings(shared_root=str(tmp_path / "shared"), run_id="r2", backend="local", job_api="trainjob",
                           backoff_limit=2)
    with pytest.raises(LaunchSpecError, match="--api trainjob: --backoff-limit"):
        run_pretrain(bad, str(manifest), str(tmp_path / "model"), log=lambda _: None)
    assert not (tmp_path / "shared").exists()
    with pytest.raises(ValueError, match="--api: 'mpijob' is not one of pytorchjob, trainjob"):
        run_pretrain(PretrainSettings(shared_root=str(tmp_path / "shared"), run_id="r3", job_api="mpijob"),
                     str(manifest), str(tmp_path / "model"), log=lambda _: None)


def test_gpu_memory_gb_refuses_a_layout_that_cannot_fit_before_any_job(tmp_path):
    """The step's run_pretrain hands the setting to the job spec; run_job's argument check refuses the layout
    with the estimate's numbers before a backend starts anything."""
    from components.pretrain.step import run_pretrain
    from components.manifest import write_manifest
    from domino.launch import LaunchSpecError

    dataset = tmp_path / "dataset.json"
    write_manifest(str(dataset), {"prefix": str(tmp_path / "corpus_text_document")})
    for ext in (".bin", ".idx"):
        (tmp_path / f"corpus_text_document{ext}").write_bytes(b"")
    settings = PretrainSettings(shared_root=str(tmp_path / "shared"), run_id="r", backend="local", nproc_per_node=2,
                                tensor_model_parallel_size=2, gpu_memory_gb=0.001)
    assert job_spec(settings, ["--preset", "tiny"]).gpu_memory_gb == 0.001
    with pytest.raises(LaunchSpecError, match=r"--gpu-memory-gb 0.001: the estimate \(domino estimate\) is"):
        run_pretrain(settings, str(dataset), str(tmp_path / "model.json"), log=lambda line: None)
    assert not os.path.exists(RunLayout(settings.shared_root, "r").checkpoint_dir)  # no training process ran


def test_credentials_come_from_secrets_and_never_from_literal_run_parameters():
    # A name that merely contains a credential word (the Hugging Face tokenizers' switch) is no credential.
    settings = PretrainSettings(shared_root="/mnt/domino", run_id="r",
                                env='{"NCCL_DEBUG": "INFO", "TOKENIZERS_PARALLELISM": "false"}',
                                env_secrets='{"HF_TOKEN": "hf-credentials:token"}',
                                env_from_secrets='["mlflow-credentials"]')
    spec = job_spec(settings, [])
    assert spec.secret_env == {"HF_TOKEN": "hf-credentials:token"} and spec.env_from_secrets == ["mlflow-credentials"]
    (container,) = render_job(spec, "r")["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-credentials", "key": "token"}}} in container["env"]
    for name in ("HF_TOKEN", "WANDB_API_KEY", "MLFLOW_TRACKING_PASSWORD", "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID",
                 "GOOGLE_APPLICATION_CREDENTIALS", "openai_api_key"):
        with pytest.raises(ValueError, match=f"env: {name} look\\(s\\) like credentials.*env_secrets"):
            job_spec(PretrainSettings(shared_root="/mnt/domino", run_id="r", env=f'{{"{name}": "hunter2"}}'), [])


def test_the_runs_own_mlflow_credentials_win_over_the_default_secret():
    """With a tracking URI the job reads MLflow's credentials from the Secret domino-mlflow unless the run names
    its own: an env_secrets entry (another Secret) or a literal env entry (a user name is no credential)."""
    from domino.tracking import CREDENTIAL_SECRET

    settings = PretrainSettings(shared_root="/mnt/domino", run_id="r", mlflow_tracking_uri="http://mlflow:5000",
                                env='{"MLFLOW_TRACKING_USERNAME": "trainer"}',
                                env_secrets='{"MLFLOW_TRACKING_PASSWORD": "team-mlflow:password"}')
    spec = job_spec(settings, [])
    assert spec.env["MLFLOW_TRACKING_USERNAME"] == "trainer"
    assert spec.secret_env == {"MLFLOW_TRACKING_PASSWORD": "team-mlflow:password",
                               "MLFLOW_TRACKING_TOKEN": CREDENTIAL_SECRET}
