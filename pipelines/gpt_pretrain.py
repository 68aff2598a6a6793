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

import functools
import inspect
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from kfp import compiler, dsl, kubernetes

from components import declare, default_image, kfp_component, kfp_functions
from domino import images
from domino.tracking import CREDENTIAL_KEYS, CREDENTIAL_SECRET
from pipelines.preprocess_stage import PreprocessStage

PIPELINE_NAME = "gpt-pretrain"
#: Where every step (and the training job) mounts the shared volume.
MOUNT_PATH = "/mnt/domino"
#: The compiled pipeline committed beside this module.
COMPILED_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt_pretrain.yaml")

#: Parameters of each component that the pipeline supplies itself (the run id, another task's output, an
#: artifact); every other parameter of every component is the pipeline parameter of the same name.
WIRED = {"train_tokenizer": {"run_id"}, "plan_preprocess": {"tokenizer"}, "preprocess": {"group"},
         "merge_datasets": {"parts"}, "pretrain": {"run_id", "tokenizer"}, "evaluate": {"run_id"},
         "promote_model": {"run_id"}, "cleanup_job": {"run_id"}}
#: Pipeline parameters whose default differs from the component's (``image``'s is the build's image, or ''
#: when the build uses the default images).
PIPELINE_DEFAULTS = {"shared_root": MOUNT_PATH}


def pipeline_parameters() -> List[declare.Parameter]:
    """The pipeline's parameters: every component parameter the pipeline does not wire, each once.

    Raises:
        TypeError: two components declare a parameter of the same name differently (one name, one meaning:
            declare it once in ``components/run_settings.py`` and inherit it).
    """
    out: Dict[str, declare.Parameter] = {}
    for component in declare.declarations():
        for param in component.parameters():
            if param.name in WIRED.get(component.function, ()):
                continue
            if param.name in out and out[param.name] != param:
                raise TypeError(f"pipeline parameter {param.name}: {component.function} declares it as {param}, "
                                f"another component as {out[param.name]}")
            out.setdefault(param.name, param)
    return list(out.values())


def task_arguments(values: Dict[str, Any], function: str, **wired: Any) -> Dict[str, Any]:
    """The arguments of a task of component ``function``: ``values`` (pipeline parameters, by name) of its
    parameters that the pipeline does not wire, then ``wired`` (what the pipeline supplies itself)."""
    (component,) = [c for c in declare.declarations() if c.function == function]
    own = {q.name: values[q.name] for q in component.parameters()
           if q.name not in WIRED.get(function, ()) and q.name in values}
    return {**own, **wired}


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
        image: Image of every step and default image of the training job (default: the domino images,
            :mod:`domino.images`: the CPU variant for the steps, the CUDA one for an evaluate step with
            GPUs, and the training job's chosen at run time by its GPUs).
        placement: Node selector and tolerations for the step pods (default: none).
        preprocess_parallelism: Most preprocess tasks running at once (0: one per shard group); kfp
            compiles it into the ParallelFor, so it is a compile-time setting.

    Returns:
        The kfp pipeline (a ``GraphComponent``): call it under ``kfp.local`` or compile it.
    """
    job_image = image or ""  # '': the pretrain step picks the variant for the job's GPUs
    placement = placement or StepPlacement()
    eval_image = image or (images.image("cuda") if placement.eval_gpus > 0 else None)
    image = image or default_image()
    preprocess_stage = PreprocessStage(image, preprocess_parallelism)
    pretrain_op = kfp_component(kfp_functions.pretrain, image)
    evaluate_op = kfp_component(kfp_functions.evaluate, eval_image or image)
    promote_op = kfp_component(kfp_functions.promote_model, image)
    tokenizer_op = kfp_component(kfp_functions.train_tokenizer, image)
    cleanup_op = kfp_component(kfp_functions.cleanup_job, image)

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

    params = pipeline_parameters()
    names = [param.name for param in params]

    def gpt_pretrain(*values):
        p = dict(zip(names, values))
        run_id = dsl.PIPELINE_JOB_ID_PLACEHOLDER
        arguments = functools.partial(task_arguments, p)
        cleanup = on_shared_volume(cleanup_op(**arguments("cleanup_job", run_id=run_id)), p["pvc_name"])
        cleanup.set_display_name("cleanup-job")
        kubernetes.use_field_path_as_env(cleanup, env_name="POD_NAMESPACE", field_path="metadata.namespace")
        with dsl.ExitHandler(cleanup, name="train-and-gate"):
            tok = on_shared_volume(tokenizer_op(**arguments("train_tokenizer", run_id=run_id)), p["pvc_name"])
            tok.set_display_name("train-tokenizer")
            prep = preprocess_stage(lambda task: on_shared_volume(task, p["pvc_name"]), arguments, tok.output)
            train = on_shared_volume(pretrain_op(
                **arguments("pretrain", run_id=run_id, dataset=prep.outputs["dataset"], tokenizer=tok.output)),
                p["pvc_name"])
            # The launcher sets its pod as the job's owner, so deleting the run's pods removes the job too;
            # the job goes to the step's namespace unless the namespace parameter says otherwise.
            for env, path in (("POD_NAME", "metadata.name"), ("POD_UID", "metadata.uid"),
                              ("POD_NAMESPACE", "metadata.namespace")):
                kubernetes.use_field_path_as_env(train, env_name=env, field_path=path)
            # The job's default image is chosen in the step's pod, which must know the repository chosen here.
            train.set_env_variable(images.REPOSITORY_ENV, images.repository())
            # A retried step adopts its own job (same run id, same name) and resumes from its checkpoints.
            train.set_retry(num_retries=placement.pretrain_retries, backoff_duration="60s", backoff_factor=2.0)
            kubernetes.set_timeout(train, placement.pretrain_timeout_s)
            evaluation = on_shared_volume(evaluate_op(**arguments(
                "evaluate", run_id=run_id, model=train.outputs["model"], dataset=prep.outputs["dataset"])), p["pvc_name"])
            if placement.eval_gpus > 0:
                evaluation.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(placement.eval_gpus)
            with dsl.If(evaluation.outputs["Output"] == True, name="beats-promoted-model"):  # noqa: E712
                on_shared_volume(promote_op(**arguments(
                    "promote_model", run_id=run_id, model=train.outputs["model"], decision=evaluation.outputs["decision"],
                )), p["pvc_name"])

    # kfp reads the pipeline's parameters from this signature and calls the function with them positionally
    # (a pipeline function is compiled here, never shipped to a container, so __signature__ is enough).
    defaults = {**PIPELINE_DEFAULTS, "image": job_image}
    gpt_pretrain.__signature__ = inspect.Signature([
        inspect.Parameter(q.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=q.kind,
                          default=defaults.get(q.name, inspect.Parameter.empty if q.required else q.default))
        for q in params])
    docs = {q.name: q.doc for q in params}

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
