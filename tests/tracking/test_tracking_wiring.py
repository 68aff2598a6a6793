"""How the pipeline hands MLflow its URI and credentials: credentials only from the Secret ``domino-mlflow`` (as
``secretKeyRef`` on the training pods, valid against the PyTorchJob and TrainJob CRDs and the Pod schema; as
``secretAsEnv`` on every step when compiled with ``--mlflow-credentials``), never as a run parameter."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from components.pretrain.step import job_spec
from components.pretrain.settings import PretrainSettings
from domino.tracking import CREDENTIAL_KEYS, CREDENTIAL_SECRET
from domino.tracking.registry import volume_uri

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))  # k8s_schemas: CRD and Pod validators

from k8s_schemas import validate_job, validate_trainer_object  # noqa: E402


def _secret_env(env):
    return {e["name"]: e["valueFrom"]["secretKeyRef"] for e in env if "valueFrom" in e}


def test_training_pods_read_credentials_from_the_secret_only_when_tracking_is_on():
    from domino.launch.render import render_job
    from domino.launch.trainjob import render_trainjob

    settings = PretrainSettings(shared_root="/mnt/domino", run_id="run-1", mlflow_tracking_uri="http://mlflow:5000")
    spec = job_spec(settings, ["--preset", "tiny"])
    assert spec.env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000" and spec.env["DOMINO_KFP_RUN_ID"] == "run-1"
    job = render_job(spec, "run-1")
    validate_job(job)
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    expected = {key: {"name": CREDENTIAL_SECRET, "key": key, "optional": True} for key in CREDENTIAL_KEYS}
    assert _secret_env(container["env"]) == expected
    trainjob = render_trainjob(spec, "run-1")
    validate_trainer_object(trainjob, "trainjobs")
    assert _secret_env(trainjob["spec"]["trainer"]["env"]) == expected

    untracked = job_spec(PretrainSettings(shared_root="/mnt/domino", run_id="run-1"), ["--preset", "tiny"])
    assert untracked.secret_env == {} and "MLFLOW_TRACKING_URI" not in untracked.env
    container = render_job(untracked, "run-1")["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert _secret_env(container["containers"][0]["env"]) == {}


def test_steps_read_credentials_from_the_secret_when_compiled_so_and_no_parameter_carries_them(tmp_path):
    from pipelines.gpt_pretrain import StepPlacement, compile_pipeline

    plain = yaml.safe_load_all(open(compile_pipeline(str(tmp_path / "plain.yaml"))))
    with_credentials = list(yaml.safe_load_all(open(compile_pipeline(
        str(tmp_path / "credentials.yaml"), placement=StepPlacement(mlflow_credentials=True)))))
    spec, platform = with_credentials
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert len(executors) == len(spec["deploymentSpec"]["executors"])  # every step
    for config in executors.values():
        [secret] = config["secretAsEnv"]
        assert secret["secretName"] == CREDENTIAL_SECRET and secret["optional"] is True
        assert [m["envVar"] for m in secret["keyToEnv"]] == list(CREDENTIAL_KEYS)
    assert all("secretAsEnv" not in config for config in list(plain)[1]["platforms"]["kubernetes"]
               ["deploymentSpec"]["executors"].values())
    parameters = spec["root"]["inputDefinitions"]["parameters"]
    assert "mlflow_tracking_uri" in parameters
    assert not [name for name in parameters if name.endswith(("_token", "password", "username", "credentials"))]


def test_a_version_source_names_the_claim_and_the_path_inside_it():
    assert volume_uri("/mnt/domino/runs/r1/checkpoints/iter_0000004", "/mnt/domino", "domino-data") == \
        "pvc://domino-data/runs/r1/checkpoints/iter_0000004"
    assert volume_uri("/elsewhere/ckpt", "/mnt/domino", "domino-data") == "file:///elsewhere/ckpt"


def test_http_bounds_are_domino_s_unless_the_environment_sets_mlflow_s(monkeypatch):
    from domino.tracking.session import HTTP_DEFAULTS, apply_http_defaults

    for name in HTTP_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")
    assert apply_http_defaults() == {**HTTP_DEFAULTS, "MLFLOW_HTTP_REQUEST_TIMEOUT": "60"}
    from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_RESPECT_RETRY_AFTER_HEADER

    assert MLFLOW_HTTP_REQUEST_MAX_RETRIES.get() == 2 and MLFLOW_HTTP_RESPECT_RETRY_AFTER_HEADER.get() is False
