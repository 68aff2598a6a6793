"""The ``gpt-pretrain`` Kubeflow pipeline: preprocess -> pretrain -> evaluate -> promote if better.

::

    exit handler: cleanup-job (deletes a training job the run left behind)
      train-tokenizer  a byte-level BPE fitted to the corpus (or the named tokenizer, passed on)
      preprocess  plan -> ParallelFor over shard groups -> merge: .bin/.idx on the shared volume, reused
                  when the inputs and tokenizer are unchanged (pipelines/preprocess_stage.py)
      pretrain    a distributed `domino pretrain` PyTorchJob or TrainJob (job_api) -> checkpoint on the shared
                  volume
      evaluate    test loss/perplexity/accuracy, HTML report, gate: beats the promoted model?
      if gate:    promote-model writes <shared_root>/promoted.json (atomically)

Every step mounts the shared ReadWriteMany volume at :data:`MOUNT_PATH`, and each run works in its own
folder ``<shared_root>/runs/<run id>`` (the run id is ``dsl.PIPELINE_JOB_ID_PLACEHOLDER``), so runs of a
schedule never collide. Defaults train the tiny preset (the local demo); ``docs/pipeline.md`` gives GPU
settings. Compilation is deterministic: the committed ``gpt_pretrain.yaml`` is checked by a test.
"""

import inspect
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from kfp import compiler, dsl, kubernetes

from components import default_image
from components.cleanup import component as cleanup_component
from components.evaluate import component as evaluate_component
from components.evaluate.step import DEFAULT_PROMPTS
from components.pretrain import component as pretrain_component
from components.pretrain import settings as pretrain_settings
from components.promote import component as promote_component
from components.tokenizer import component as tokenizer_component
from domino.tracking import CREDENTIAL_KEYS, CREDENTIAL_SECRET
from pipelines.preprocess_stage import PreprocessStage

PIPELINE_NAME = "gpt-pretrain"
#: Where every step (and the training job) mounts the shared volume.
MOUNT_PATH = "/mnt/domino"
#: The compiled pipeline committed beside this module.
COMPILED_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt_pretrain.yaml")

#: The pipeline's own parameters (name, type, default); the pretrain step's come from its settings.
OWN_PARAMETERS = [
    ("corpus", str, "shakespeare"),
    ("input_uri", str, ""),
    ("preprocess_groups", int, 1),
    ("reuse_dataset", bool, True),
    ("tokenizer_vocab_size", int, 0),
    ("eval_batches", int, 8),
    ("sample_prompts", str, DEFAULT_PROMPTS),
    ("sample_tokens", int, 24),
    ("min_improvement", float, 0.0),
    ("keep_failed_jobs", bool, True),
    ("registered_model_name", str, "domino-gpt"),
]
OWN_DOCS = {
    "corpus": "Built-in corpus to train on when input_uri is empty (shakespeare, kjv).",
    "input_uri": "Comma-separated files, directories or globs on the shared volume (overrides corpus): "
                 ".jsonl/.txt, optionally .gz or .zst, and .parquet.",
    "preprocess_groups": "Shard groups tokenized in parallel, one task each, then merged.",
    "reuse_dataset": "Reuse the dataset an earlier run made from the same files and tokenizer.",
    "eval_batches": "Test batches per evaluated model.",
    "sample_prompts": "Prompts of the report's sample generations, separated by '|' ('\\n': line break).",
    "tokenizer_vocab_size": "Train a byte-level BPE of this many tokens on the corpus (0: use tokenizer).",
    "sample_tokens": "Tokens generated per report prompt (0: no samples).",
    "min_improvement": "Fraction by which the test perplexity must beat the promoted model's.",
    "keep_failed_jobs": "Keep a failed training job for debugging (its TTL removes it later).",
    "registered_model_name": "MLflow registered model that gets a version per promotion (with mlflow_tracking_uri).",
}



@dataclass
class StepPlacement:
    """Compile-time Kubernetes settings of the pipeline's own step pods (not the training job's pods,
    which the ``node_selector``/``tolerations`` run parameters control).

    Attributes:
        node_selector: Node labels every step pod requires.
        tolerations: Tolerations of every step pod, as Kubernetes ``Toleration`` objects.
        eval_gpus: GPUs for the evaluate step's pod (0: it evaluates on CPU, fine for small models).
        run_as_user: Non-root UID (and GID) of every step's container (the image works under any UID).
        pretrain_retries: kfp retries of the pretrain step (a retry adopts the run's job and resumes it).
        pretrain_timeout_s: The pretrain step pod's activeDeadlineSeconds (a bound on the whole training).
        mlflow_credentials: Every step reads MLflow's credential variables from the Secret ``domino-mlflow``
            (``secretAsEnv``, optional keys: needs a KFP backend whose driver knows that field,
            kubeflow/pipelines#12495); the training pods read them from it whenever tracking is on.
    """

    node_selector: Dict[str, str] = field(default_factory=dict)
    tolerations: List[Dict[str, str]] = field(default_factory=list)
    eval_gpus: int = 0
    run_as_user: int = 1000
    pretrain_retries: int = 2
    pretrain_timeout_s: int = 7 * 24 * 3600
    mlflow_credentials: bool = False


def build_pipeline(image: Optional[str] = None, placement: Optional[StepPlacement] = None,
                   preprocess_parallelism: int = 0):
    """Builds the pipeline with every component running in ``image``.

    Args:
        image: Image of the steps and default image of the training job (default: ``$DOMINO_IMAGE`` or
            ``components.DEFAULT_IMAGE``).
        placement: Node selector and tolerations for the step pods (default: none).
        preprocess_parallelism: Most preprocess tasks running at once (0: one per shard group); kfp
            compiles it into the ParallelFor, so it is a compile-time setting.

    Returns:
        The kfp pipeline (a ``GraphComponent``): call it under ``kfp.local`` or compile it.
    """
    image = image or default_image()
    placement = placement or StepPlacement()
    preprocess_stage = PreprocessStage(image, preprocess_parallelism)
    pretrain_op = pretrain_component.build(image)
    evaluate_op = evaluate_component.build(image)
    promote_op = promote_component.build(image)
    tokenizer_op = tokenizer_component.build(image)
    cleanup_op = cleanup_component.build(image)

    def on_shared_volume(task, pvc_name):
        kubernetes.mount_pvc(task, pvc_name=pvc_name, mount_path=MOUNT_PATH)
        # kfp-kubernetes 2.17 sets identity only (runAsUser/Group/NonRoot); the KFP backend adds
        # allowPrivilegeEscalation=false, drop ALL and RuntimeDefault seccomp to every user container.
        kubernetes.set_security_context(task, run_as_user=placement.run_as_user, run_as_group=placement.run_as_user,
                                        run_as_non_root=True)
        for key, value in sorted(placement.node_selector.items()):
            kubernetes.add_node_selector(task, label_key=key, label_value=value)
        for toleration in placement.tolerations:
            kubernetes.add_toleration(task, **toleration)
        if placement.mlflow_credentials:  # from a Secret, never a run parameter; a missing key is left unset
            kubernetes.use_secret_as_env(task, CREDENTIAL_SECRET, {key: key for key in CREDENTIAL_KEYS},
                                         optional=True)
        task.set_caching_options(False)
        return task

    # The pipeline's parameters: every pretrain setting (components/pretrain/settings.py, the one
    # declaration) except what the run supplies, then its own. kfp reads them from the signature and
    # calls the function with them positionally.
    names = [param.name for param in pretrain_settings.parameters(skip=pretrain_settings.RUN_SUPPLIED)]
    names += [name for name, _, _ in OWN_PARAMETERS]
    pretrain_names = [name for name in names if name in pretrain_settings.PretrainSettings.__dataclass_fields__]

    def gpt_pretrain(*values):
        p = dict(zip(names, values))
        run_id = dsl.PIPELINE_JOB_ID_PLACEHOLDER
        cleanup = on_shared_volume(cleanup_op(run_id=run_id, namespace=p["namespace"], backend=p["backend"],
                                              job_api=p["job_api"], keep_failed=p["keep_failed_jobs"]), p["pvc_name"])
        cleanup.set_display_name("cleanup-job")
        kubernetes.use_field_path_as_env(cleanup, env_name="POD_NAMESPACE", field_path="metadata.namespace")
        with dsl.ExitHandler(cleanup, name="train-and-gate"):
            tok = on_shared_volume(tokenizer_op(
                shared_root=p["shared_root"], run_id=run_id, corpus=p["corpus"], input_uri=p["input_uri"],
                tokenizer=p["tokenizer"], vocab_size=p["tokenizer_vocab_size"],
            ), p["pvc_name"])
            tok.set_display_name("train-tokenizer")
            prep = preprocess_stage(lambda task: on_shared_volume(task, p["pvc_name"]), shared_root=p["shared_root"],
                                    corpus=p["corpus"], input_uri=p["input_uri"], tokenizer=tok.output,
                                    groups=p["preprocess_groups"], reuse=p["reuse_dataset"])
            train = on_shared_volume(pretrain_op(
                dataset=prep.outputs["dataset"], run_id=run_id, tokenizer=tok.output,
                **{name: p[name] for name in pretrain_names if name != "tokenizer"},
            ), p["pvc_name"])
            # The launcher sets its pod as the job's owner, so deleting the run's pods removes the job too;
            # the job goes to the step's namespace unless the namespace parameter says otherwise.
            for env, path in (("POD_NAME", "metadata.name"), ("POD_UID", "metadata.uid"),
                              ("POD_NAMESPACE", "metadata.namespace")):
                kubernetes.use_field_path_as_env(train, env_name=env, field_path=path)
            # A retried step adopts its own job (same run id, same name) and resumes from its checkpoints.
            train.set_retry(num_retries=placement.pretrain_retries, backoff_duration="60s", backoff_factor=2.0)
            kubernetes.set_timeout(train, placement.pretrain_timeout_s)
            evaluation = on_shared_volume(evaluate_op(
                model=train.outputs["model"], dataset=prep.outputs["dataset"], shared_root=p["shared_root"],
                run_id=run_id, eval_batches=p["eval_batches"], sample_prompts=p["sample_prompts"],
                sample_tokens=p["sample_tokens"], min_improvement=p["min_improvement"],
                mlflow_tracking_uri=p["mlflow_tracking_uri"],
            ), p["pvc_name"])
            if placement.eval_gpus > 0:
                evaluation.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(placement.eval_gpus)
            with dsl.If(evaluation.outputs["Output"] == True, name="beats-promoted-model"):  # noqa: E712
                on_shared_volume(promote_op(
                    model=train.outputs["model"], decision=evaluation.outputs["decision"],
                    shared_root=p["shared_root"], run_id=run_id, mlflow_tracking_uri=p["mlflow_tracking_uri"],
                    registered_model_name=p["registered_model_name"], pvc_name=p["pvc_name"],
                ), p["pvc_name"])

    defaults = {"image": image, "shared_root": MOUNT_PATH}
    params = [param.replace(default=defaults.get(param.name, param.default))
              for param in pretrain_settings.parameters(skip=pretrain_settings.RUN_SUPPLIED)]
    params += [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=kind)
               for name, kind, default in OWN_PARAMETERS]
    gpt_pretrain.__signature__ = inspect.Signature(params)
    docs = {**OWN_DOCS, **pretrain_settings.parameter_docs(), "image": "Image of the training job."}
    gpt_pretrain.__doc__ = ("Pretrain, evaluate and conditionally promote a GPT model.\n\nArgs:\n"
                            + "".join(f"    {name}: {docs[name]}\n" for name in names))
    return dsl.pipeline(name=PIPELINE_NAME, description="Pretrain a GPT model with Domino tensor parallelism, "
                        "evaluate it, and promote it when it beats the promoted model.")(gpt_pretrain)


def compile_pipeline(output: str = COMPILED_PATH, image: Optional[str] = None,
                     placement: Optional[StepPlacement] = None, preprocess_parallelism: int = 0) -> str:
    """Compiles the pipeline to ``output`` (YAML) and returns the path.

    The output depends only on the arguments and the installed kfp version (no timestamps), so
    recompiling an unchanged pipeline reproduces the committed file byte for byte.
    """
    compiler.Compiler().compile(build_pipeline(image, placement, preprocess_parallelism), package_path=output)
    return output
