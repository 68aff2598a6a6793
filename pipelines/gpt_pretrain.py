"""The ``gpt-pretrain`` Kubeflow pipeline: preprocess -> pretrain -> evaluate -> promote if better.

::

    exit handler: cleanup-job (deletes a training job the run left behind)
      train-tokenizer  a byte-level BPE fitted to the corpus (or the named tokenizer, passed on)
      preprocess  raw text or a built-in corpus -> .bin/.idx on the shared volume
      pretrain    a distributed `domino pretrain` PyTorchJob -> checkpoint on the shared volume
      evaluate    test loss/perplexity/accuracy, HTML report, gate: beats the promoted model?
      if gate:    promote-model writes <shared_root>/promoted.json (atomically)

Every step mounts the shared ReadWriteMany volume at :data:`MOUNT_PATH`, and each run works in its own
folder ``<shared_root>/runs/<run id>`` (the run id is ``dsl.PIPELINE_JOB_ID_PLACEHOLDER``), so runs of a
schedule never collide. Defaults train the tiny preset (the local demo); ``docs/pipeline.md`` gives GPU
settings. Compilation is deterministic: the committed ``gpt_pretrain.yaml`` is checked by a test.
"""

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from kfp import compiler, dsl, kubernetes

from components import default_image
from components.cleanup import component as cleanup_component
from components.evaluate import component as evaluate_component
from components.evaluate.step import DEFAULT_PROMPTS
from components.preprocess import component as preprocess_component
from components.pretrain import component as pretrain_component
from components.promote import component as promote_component
from components.tokenizer import component as tokenizer_component

PIPELINE_NAME = "gpt-pretrain"
#: Where every step (and the training job) mounts the shared volume.
MOUNT_PATH = "/mnt/domino"
#: The compiled pipeline committed beside this module.
COMPILED_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt_pretrain.yaml")


@dataclass
class StepPlacement:
    """Compile-time Kubernetes settings of the pipeline's own step pods (not the training job's pods,
    which the ``node_selector``/``tolerations`` run parameters control).

    Attributes:
        node_selector: Node labels every step pod requires.
        tolerations: Tolerations of every step pod, as Kubernetes ``Toleration`` objects.
        eval_gpus: GPUs for the evaluate step's pod (0: it evaluates on CPU, fine for small models).
    """

    node_selector: Dict[str, str] = field(default_factory=dict)
    tolerations: List[Dict[str, str]] = field(default_factory=list)
    eval_gpus: int = 0


def build_pipeline(image: Optional[str] = None, placement: Optional[StepPlacement] = None):
    """Builds the pipeline with every component running in ``image``.

    Args:
        image: Image of the steps and default image of the training job (default: ``$DOMINO_IMAGE`` or
            ``components.DEFAULT_IMAGE``).
        placement: Node selector and tolerations for the step pods (default: none).

    Returns:
        The kfp pipeline (a ``GraphComponent``): call it under ``kfp.local`` or compile it.
    """
    image = image or default_image()
    placement = placement or StepPlacement()
    preprocess_op = preprocess_component.build(image)
    pretrain_op = pretrain_component.build(image)
    evaluate_op = evaluate_component.build(image)
    promote_op = promote_component.build(image)
    tokenizer_op = tokenizer_component.build(image)
    cleanup_op = cleanup_component.build(image)

    def on_shared_volume(task, pvc_name):
        kubernetes.mount_pvc(task, pvc_name=pvc_name, mount_path=MOUNT_PATH)
        for key, value in sorted(placement.node_selector.items()):
            kubernetes.add_node_selector(task, label_key=key, label_value=value)
        for toleration in placement.tolerations:
            kubernetes.add_toleration(task, **toleration)
        task.set_caching_options(False)
        return task

    @dsl.pipeline(name=PIPELINE_NAME, description="Pretrain a GPT model with Domino tensor parallelism, "
                  "evaluate it, and promote it when it beats the promoted model.")
    def gpt_pretrain(
        shared_root: str = MOUNT_PATH,
        pvc_name: str = "domino-data",
        corpus: str = "shakespeare",
        input_uri: str = "",
        tokenizer: str = "gpt2",
        tokenizer_vocab_size: int = 0,
        preset: str = "tiny",
        config_overrides: str = "{}",
        train_iters: int = 20,
        micro_batch_size: int = 4,
        global_batch_size: int = 0,
        lr: float = 0.0,
        split: str = "90,5,5",
        save_interval: int = 0,
        eval_interval: int = 10,
        eval_iters: int = 2,
        log_interval: int = 5,
        nodes: int = 1,
        nproc_per_node: int = 2,
        gpus_per_node: int = 0,
        tensor_parallel: int = 2,
        domino_chunks: int = 2,
        zero_stage: int = 1,
        warm_start: bool = False,
        backend: str = "pytorchjob",
        image: str = image,
        namespace: str = "domino",
        job_name: str = "gpt-pretrain",
        cpu_request: str = "",
        memory_request: str = "",
        memory_limit: str = "",
        node_selector: str = "{}",
        tolerations: str = "[]",
        job_timeout_s: int = 0,
        scheduling_timeout_s: int = 600,
        eval_batches: int = 8,
        sample_prompts: str = DEFAULT_PROMPTS,
        sample_tokens: int = 24,
        min_improvement: float = 0.0,
        keep_failed_jobs: bool = True,
    ):
        """Pretrain, evaluate and conditionally promote a GPT model.

        Args:
            shared_root: Where the shared volume is mounted (keep the default in a cluster; a local
                folder for local runs). Runs write under shared_root/runs/RUN_ID.
            pvc_name: ReadWriteMany PersistentVolumeClaim mounted by every step and the training job.
            corpus: Built-in corpus to train on when input_uri is empty (shakespeare, kjv).
            input_uri: Comma-separated text/JSON-lines files on the shared volume (overrides corpus).
            tokenizer: Tokenizer when tokenizer_vocab_size is 0 (gpt2 works offline).
            tokenizer_vocab_size: Train a byte-level BPE of this many tokens on the corpus (0: use tokenizer).
            preset: Model and training preset (tiny, gpt2-125m, gpt3-350m, gpt3-1.3b, ...).
            config_overrides: JSON object of further domino config fields, e.g. {"num_layers": 4}.
            train_iters: Optimizer steps.
            micro_batch_size: Samples per process per pass (divisible by domino_chunks).
            global_batch_size: Samples per optimizer step (0: micro batch x data-parallel size).
            lr: Peak learning rate (0: the preset's).
            split: Train/valid/test split of the documents.
            save_interval: Checkpoint every N steps (0: only at the end).
            eval_interval: Validate every N steps.
            eval_iters: Batches per validation during training.
            log_interval: Log a metrics line every N steps.
            nodes: Pods of the training job.
            nproc_per_node: Processes per pod.
            gpus_per_node: GPUs per pod (0 trains on CPU).
            tensor_parallel: Tensor-parallel size (divides nodes x nproc_per_node).
            domino_chunks: Domino micro-chunks per layer (1: plain tensor parallelism).
            zero_stage: DeepSpeed ZeRO stage (0, 1, 2).
            warm_start: Initialise from the promoted model's weights (fresh start when none).
            backend: pytorchjob (Kubeflow training operator) or local (processes in the step's pod).
            image: Image of the training job.
            namespace: Namespace of the training job.
            job_name: Base name of the training job (the run id is appended).
            cpu_request: CPU request per training pod ('' : none).
            memory_request: Memory request per training pod ('' : none).
            memory_limit: Memory limit per training pod ('' : none).
            node_selector: JSON object of node labels for the training pods.
            tolerations: JSON array of tolerations for the training pods.
            job_timeout_s: Wall-clock limit of the training job (0: none).
            scheduling_timeout_s: Fail when the training job is not running after this many seconds.
            eval_batches: Test batches per evaluated model.
            sample_prompts: Prompts of the report's sample generations, separated by '|' ('\\n': line break).
            sample_tokens: Tokens generated per report prompt (0: no samples).
            min_improvement: Fraction by which the test perplexity must beat the promoted model's.
            keep_failed_jobs: Keep a failed training job for debugging (its TTL removes it later).
        """
        run_id = dsl.PIPELINE_JOB_ID_PLACEHOLDER
        cleanup = on_shared_volume(
            cleanup_op(run_id=run_id, namespace=namespace, backend=backend, keep_failed=keep_failed_jobs), pvc_name)
        cleanup.set_display_name("cleanup-job")
        with dsl.ExitHandler(cleanup, name="train-and-gate"):
            tok = on_shared_volume(tokenizer_op(
                shared_root=shared_root, run_id=run_id, corpus=corpus, input_uri=input_uri, tokenizer=tokenizer,
                vocab_size=tokenizer_vocab_size,
            ), pvc_name)
            tok.set_display_name("train-tokenizer")
            prep = on_shared_volume(preprocess_op(
                shared_root=shared_root, run_id=run_id, corpus=corpus, input_uri=input_uri, tokenizer=tok.output,
            ), pvc_name)
            train = on_shared_volume(pretrain_op(
                dataset=prep.outputs["dataset"], shared_root=shared_root, run_id=run_id, preset=preset,
                config_overrides=config_overrides, train_iters=train_iters, micro_batch_size=micro_batch_size,
                global_batch_size=global_batch_size, lr=lr, split=split, tokenizer=tok.output,
                save_interval=save_interval, eval_interval=eval_interval, eval_iters=eval_iters,
                log_interval=log_interval, nodes=nodes, nproc_per_node=nproc_per_node,
                gpus_per_node=gpus_per_node, tensor_parallel=tensor_parallel, domino_chunks=domino_chunks,
                zero_stage=zero_stage, warm_start=warm_start, backend=backend, image=image, namespace=namespace,
                job_name=job_name, pvc_name=pvc_name, cpu_request=cpu_request, memory_request=memory_request,
                memory_limit=memory_limit, node_selector=node_selector, tolerations=tolerations,
                job_timeout_s=job_timeout_s, scheduling_timeout_s=scheduling_timeout_s,
            ), pvc_name)
            # The launcher sets its pod as the job's owner, so deleting the run's pods removes the job too.
            for env, path in (("POD_NAME", "metadata.name"), ("POD_UID", "metadata.uid"),
                              ("POD_NAMESPACE", "metadata.namespace")):
                kubernetes.use_field_path_as_env(train, env_name=env, field_path=path)
            evaluation = on_shared_volume(evaluate_op(
                model=train.outputs["model"], dataset=prep.outputs["dataset"], shared_root=shared_root,
                run_id=run_id, eval_batches=eval_batches, sample_prompts=sample_prompts, sample_tokens=sample_tokens,
                min_improvement=min_improvement,
            ), pvc_name)
            if placement.eval_gpus > 0:
                evaluation.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(placement.eval_gpus)
            with dsl.If(evaluation.outputs["Output"] == True, name="beats-promoted-model"):  # noqa: E712
                on_shared_volume(promote_op(
                    model=train.outputs["model"], decision=evaluation.outputs["decision"],
                    shared_root=shared_root, run_id=run_id,
                ), pvc_name)

    return gpt_pretrain


def compile_pipeline(output: str = COMPILED_PATH, image: Optional[str] = None,
                     placement: Optional[StepPlacement] = None) -> str:
    """Compiles the pipeline to ``output`` (YAML) and returns the path.

    The output depends only on the arguments and the installed kfp version (no timestamps), so
    recompiling an unchanged pipeline reproduces the committed file byte for byte.
    """
    compiler.Compiler().compile(build_pipeline(image, placement), package_path=output)
    return output
