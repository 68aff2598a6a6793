"""Arguments and secrets on rendered manifests: a literal credential in ``--env`` is refused (by the rule the
pipeline's ``env`` parameter follows, with an ``--env-secret`` hint), and a ``$`` in the training arguments
reaches the process as written: the kubelet expands ``$(VAR)`` in container commands and reduces ``$$`` to
``$``, modelled here from kubernetes/kubernetes third_party/forked/golang/expansion/expand.go (commit
fde22c3f9aacfd260225a9741de123a41157b7c0) and applied with the container's environment as the kubelet does."""

from __future__ import annotations

from typing import Dict, List

import pytest

from components.pretrain.step import _literal_env
from domino.cli.main import main as domino_main
from domino.launch import JobSpec, LaunchSpecError, trainjob
from domino.launch.render import container_command, render_job
from domino.launch.spec import credential_names


def kubelet_expand(text: str, env: Dict[str, str]) -> str:
    """``expansion.Expand(text, MappingFuncFor(env))``: ``$$`` -> ``$``; ``$(NAME)`` -> its value, or left as
    written when undefined; an unclosed ``$(`` and any other ``$x`` are kept."""
    out: List[str] = []
    i = 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                close = text.find(")", i + 2)
                if close != -1:
                    name = text[i + 2:close]
                    out.append(env.get(name, f"$({name})"))
                    i = close + 1
                    continue
                out.append("$(")
                i += 2
                continue
            out.append("$" + nxt)
            i += 2
            continue
        out.append(text[i])
        i += 1
    return "".join(out)


def test_the_expansion_model_follows_the_api_documentation():
    """core/v1 Container.command: references expand, unresolvable ones stay, "$$(VAR_NAME)" gives "$(VAR_NAME)"."""
    env = {"HF_TOKEN": "hf_secret"}
    assert kubelet_expand("$(HF_TOKEN)", env) == "hf_secret"
    assert kubelet_expand("$(UNSET)", env) == "$(UNSET)"
    assert kubelet_expand("$$(HF_TOKEN)", env) == "$(HF_TOKEN)"
    assert kubelet_expand("a$b $$ $(x", env) == "a$b $ $(x"


ARGS = ["--preset", "tiny", "--mock-data", "--train-iters", "2", "--data-path", "/mnt/domino/$(HF_TOKEN)/$$x/$5/$(",
        "--save", "/mnt/domino/cost$"]


@pytest.mark.parametrize("api", ["pytorchjob", "trainjob"])
def test_arguments_reach_torchrun_as_written_after_the_kubelets_expansion(api):
    spec = JobSpec(name="gpt", image="i", nodes=2, pretrain_args=ARGS, env={"NCCL_DEBUG": "INFO"},
                   secret_env={"HF_TOKEN": "hf-credentials:token"})
    if api == "pytorchjob":
        job = render_job(spec, "r")
        container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
        command, env_entries = container["command"], container["env"]
    else:
        trainer = trainjob.render_trainjob(spec, "r")["spec"]["trainer"]
        command, env_entries = trainer["command"], trainer["env"]
    # What the kubelet resolves the env to when the pod starts (the Secret's value included).
    env = {e["name"]: e.get("value", "hf_from_the_secret") for e in env_entries}
    expected = container_command(spec, "gpt-r")
    assert [kubelet_expand(arg, env) for arg in command] == expected
    assert "/mnt/domino/$(HF_TOKEN)/$$x/$5/$(" in expected  # the local backend runs this, unexpanded
    # Unescaped, the token's value would have been substituted into the argument.
    assert "hf_from_the_secret" in " ".join(kubelet_expand(arg, env) for arg in expected)


def test_a_command_override_is_passed_verbatim_too():
    spec = JobSpec(name="gpt", image="i", command=["sh", "-c", "echo $(HOSTNAME) $$HOME"])
    container = render_job(spec, "r")["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert [kubelet_expand(a, {"HOSTNAME": "pod-0"}) for a in container["command"]] == spec.command


def test_a_literal_credential_in_env_is_refused_with_the_env_secret_hint(capsys):
    with pytest.raises(SystemExit) as exit_info:
        domino_main(["launch", "render", "--name", "gpt", "--image", "i", "--env", "HF_TOKEN=hf_abc", "--",
                     "--preset", "tiny", "--mock-data", "--train-iters", "2"])
    assert exit_info.value.code == 2
    out = capsys.readouterr()
    assert out.out == "" and "hf_abc" not in out.err
    (line,) = [line for line in out.err.splitlines() if "HF_TOKEN" in line]
    assert "--env: HF_TOKEN looks like a credential" in line and "--env-secret HF_TOKEN=SECRET:KEY" in line


@pytest.mark.parametrize("name,credential", [
    ("HF_TOKEN", True), ("MLFLOW_TRACKING_PASSWORD", True), ("OPENAI_API_KEY", True), ("AWS_SECRET_ACCESS_KEY", True),
    ("AWS_ACCESS_KEY_ID", True), ("GOOGLE_APPLICATION_CREDENTIALS", True), ("TOKENIZERS_PARALLELISM", False),
    ("NCCL_DEBUG", False), ("MLFLOW_TRACKING_URI", False), ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", False),
])
def test_launch_and_the_pipeline_refuse_the_same_names(name, credential):
    env = {name: "value"}
    assert credential_names(env) == ([name] if credential else [])
    if credential:
        with pytest.raises(LaunchSpecError, match=f"--env: {name} looks like a credential"):
            JobSpec(name="gpt", image="i", env=env).validate()
        with pytest.raises(ValueError, match=f"env: {name} look"):
            _literal_env(env)
    else:
        JobSpec(name="gpt", image="i", env=env).validate()
        assert _literal_env(env) == env
    assert credential_names({name: ""}) == []  # an empty value carries nothing
