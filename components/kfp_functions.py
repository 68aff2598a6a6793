"""The kfp functions of every component. GENERATED from the declarations in components/*/component.py
by components/declare.py (run `domino pipeline compile`); do not edit. kfp ships each function's source to
its container, so the signatures are written out here (see components/declare.py for why)."""

from typing import List

from kfp.dsl import HTML, Artifact, Dataset, Input, Metrics, Model, Output, PipelineTaskFinalStatus


def train_tokenizer(
    *,
    shared_root: str,
    run_id: str,
    corpus: str = 'shakespeare',
    input_uri: str = '',
    json_keys: str = 'text',
    tokenizer: str = 'gpt2',
    tokenizer_vocab_size: int = 0,
) -> str:
    r"""Trains a byte-level BPE on the run's corpus (tokenizer_vocab_size > 0) or passes ``tokenizer`` on.

    Args:
        shared_root: Mount path of the shared volume (or a local folder with backend=local).
        run_id: Unique run id; the run's folders and its training job's name derive from it.
        corpus: Built-in corpus to train on when input_uri is empty (shakespeare, kjv).
        input_uri: Comma-separated files, directories, globs or file:// URIs on the shared volume (overrides corpus): .jsonl/.txt, optionally .gz or .zst, and .parquet.
        json_keys: Comma-separated JSON keys (Parquet columns) whose texts are tokenized.
        tokenizer: Tokenizer: 'gpt2' (offline GPT-2 BPE), a tokenizer.json, or a directory holding one. ('': not given, the preset's value or domino's default)
        tokenizer_vocab_size: Train a byte-level BPE of this many tokens on the corpus (0: use tokenizer).

    Returns:
        The tokenizer spec that preprocess and pretrain use (the trained folder, or ``tokenizer``).
    """
    values = dict(locals())
    from components.tokenizer.component import run

    return run(**values)


def plan_preprocess(
    *,
    tokenizer: str,
    shared_root: str,
    corpus: str = 'shakespeare',
    input_uri: str = '',
    json_keys: str = 'text',
    preprocess_groups: int = 1,
) -> List[str]:
    r"""Expands the inputs, names the dataset by its key, and splits the files into shard groups.

    Args:
        tokenizer: The tokenizer (train-tokenizer's output); its content is part of the dataset key.
        shared_root: Mount path of the shared volume (or a local folder with backend=local).
        corpus: Built-in corpus to train on when input_uri is empty (shakespeare, kjv).
        input_uri: Comma-separated files, directories, globs or file:// URIs on the shared volume (overrides corpus): .jsonl/.txt, optionally .gz or .zst, and .parquet.
        json_keys: Comma-separated JSON keys (Parquet columns) whose texts are tokenized.
        preprocess_groups: Shard groups tokenized in parallel, one task each, then merged (fewer when there are fewer files).

    Returns:
        One JSON object per group, the items of the stage's ParallelFor.
    """
    values = dict(locals())
    from components.preprocess.component import run_plan

    return run_plan(**values)


def preprocess(
    *,
    group: str,
    shared_root: str,
    reuse_dataset: bool = True,
    preprocess_workers: int = 1,
) -> str:
    r"""Tokenizes one shard group into ``.bin/.idx`` on the shared volume, unless it is done already.

    Args:
        group: One item of the plan (JSON; it names the tokenizer and the JSON keys).
        shared_root: Mount path of the shared volume (or a local folder with backend=local).
        reuse_dataset: Reuse the dataset an earlier run made from the same files and tokenizer.
        preprocess_workers: Tokenizer threads of each preprocess task.

    Returns:
        The group's result (JSON) for the merge step.
    """
    values = dict(locals())
    from components.preprocess.component import run_one_group

    return run_one_group(**values)


def merge_datasets(
    *,
    dataset: Output[Dataset],
    parts: List[str],
    shared_root: str,
    reuse_dataset: bool = True,
) -> None:
    r"""Concatenates the shard groups' datasets in order into the run's dataset.

    Args:
        dataset: Manifest naming the tokenized files on the shared volume; its metadata holds prefix, documents, tokens, tokenizer, vocab_size, idx_sha256, dataset_key, reused, groups, groups_tokenized.
        parts: The preprocess tasks' results (dsl.Collected over the ParallelFor).
        shared_root: Mount path of the shared volume (or a local folder with backend=local).
        reuse_dataset: Reuse the dataset an earlier run made from the same files and tokenizer.
    """
    values = dict(locals())
    from components.merge.component import run

    return run(**values)


def pretrain(
    *,
    dataset: Input[Dataset],
    model: Output[Model],
    metrics: Output[Metrics],
    shared_root: str,
    run_id: str,
    backend: str = 'cluster',
    job_api: str = 'pytorchjob',
    namespace: str = '',
    mlflow_tracking_uri: str = '',
    preset: str = 'tiny',
    config_overrides: str = '{}',
    train_iters: int = 20,
    micro_batch_size: int = -1,
    global_batch_size: int = -1,
    lr: float = -1.0,
    split: str = '',
    tokenizer: str = '',
    save_interval: int = -1,
    eval_interval: int = -1,
    eval_iters: int = -1,
    log_interval: int = -1,
    nodes: int = 1,
    nproc_per_node: int = 2,
    gpus_per_node: int = 0,
    gpu_memory_gb: float = 0.0,
    parallel_layout: str = 'given',
    tensor_model_parallel_size: int = 2,
    domino_chunks: int = -1,
    zero_stage: int = -1,
    warm_start: bool = False,
    resume_from_run: str = '',
    image: str = '',
    job_name: str = 'gpt-pretrain',
    pvc_name: str = 'domino-data',
    cpu_request: str = '',
    cpu_limit: str = '',
    memory_request: str = '',
    memory_limit: str = '',
    shm_size: str = '16Gi',
    rdma_resources: str = '{}',
    node_selector: str = '{}',
    tolerations: str = '[]',
    priority_class: str = '',
    service_account: str = '',
    image_pull_secrets: str = '[]',
    env: str = '{}',
    env_secrets: str = '{}',
    env_from_secrets: str = '[]',
    labels: str = '{}',
    annotations: str = '{}',
    queue: str = '',
    queue_timeout_s: int = 86400,
    backoff_limit: int = -1,
    termination_grace_period_s: int = 180,
    job_timeout_s: int = 0,
    scheduling_timeout_s: int = 600,
) -> None:
    r"""Trains a GPT model with a distributed ``domino pretrain`` job (PyTorchJob, TrainJob, or local processes).

    Args:
        dataset: The preprocess step's manifest (its ``prefix`` becomes ``--data-path``).
        model: Manifest of the final checkpoint (on the shared volume); metadata: iterations, tokens_seen, final losses, checkpoint_dir, checkpoint_uri (pvc://<claim>/<path>), job, mlflow_run_id (with mlflow_tracking_uri).
        metrics: final_train_loss, final_valid_loss, tokens_per_s, mfu, tflops_per_device, iterations.
        shared_root: Mount path of the shared volume (or a local folder with backend=local).
        run_id: Unique run id; the run's folders and its training job's name derive from it.
        backend: cluster (a job created through the Kubernetes API) or local (processes in the step's pod).
        job_api: pytorchjob (Kubeflow training operator v1) or trainjob (Kubeflow Trainer v2.3, runtime from k8s/trainer).
        namespace: Namespace of the training job ('': the step's own namespace, POD_NAMESPACE).
        mlflow_tracking_uri: MLflow server that training, evaluation and promotion log to ('': none; credentials: a Secret, see docs).
        preset: Model and training preset (tiny, gpt2-125m, gpt3-350m, gpt3-1.3b, ...).
        config_overrides: JSON object of further domino config fields, e.g. {"num_layers": 4, "bf16": true}.
        train_iters: Number of optimizer steps to train for. (-1: not given, the preset's value or domino's default)
        micro_batch_size: Samples per process per forward/backward pass. (-1: not given, the preset's value or domino's default)
        global_batch_size: Samples per optimizer step over all data-parallel ranks (default: micro x DP). (-1: not given, the preset's value or domino's default)
        lr: Peak learning rate. (-1.0: not given, the preset's value or domino's default)
        split: Train/valid/test split of --data-path documents, e.g. 949,50,1. ('': not given, the preset's value or domino's default)
        tokenizer: Tokenizer: 'gpt2' (offline GPT-2 BPE), a tokenizer.json, or a directory holding one. ('': not given, the preset's value or domino's default)
        save_interval: Save every this many iterations (a final save always happens with --save). (-1: not given, the preset's value or domino's default)
        eval_interval: Run validation every this many iterations (0 disables). (-1: not given, the preset's value or domino's default)
        eval_iters: Batches per validation or test evaluation. (-1: not given, the preset's value or domino's default)
        log_interval: Log one line every this many iterations. (-1: not given, the preset's value or domino's default)
        nodes: Pods of the training job.
        nproc_per_node: Processes per pod.
        gpus_per_node: GPUs per pod (0 trains on CPU).
        gpu_memory_gb: Memory of one GPU in GiB: refuse a layout whose memory estimate does not fit (0: no check).
        parallel_layout: given: tensor_model_parallel_size as set; derive: the smallest TP within one pod that the model admits and (with gpu_memory_gb) fits, tensor_model_parallel_size the largest allowed, DP across the pods (a run resumed on other nodes continues on the layout they hold; docs/cluster.md).
        tensor_model_parallel_size: Number of processes that split every layer (tensor parallelism). (-1: not given, the preset's value or domino's default)
        domino_chunks: Micro-chunks per layer input for Domino overlap; 1 means plain synchronous tensor parallelism (default: 2 when --tensor-model-parallel-size > 1 and --micro-batch-size is even, else 1). (-1: not given, the preset's value or domino's default)
        zero_stage: DeepSpeed ZeRO stage for data parallelism (0, 1 or 2; default: the stage of the checkpoint resumed, else 0 with one data-parallel replica and neither --bf16 nor --fp16, where ZeRO has nothing to shard, else 1). (-1: not given, the preset's value or domino's default)
        warm_start: Initialise from the promoted model's weights (fresh start when none).
        resume_from_run: Run id of an earlier (preempted) run of this pipeline: continue its training, optimizer state and data position included, from its newest checkpoint in <shared_root>/runs/<id>/checkpoints ('': none).
        image: Image of the training job ('': the domino CUDA image with GPUs, else the CPU one).
        job_name: Base name of the training job (the run id is appended).
        pvc_name: ReadWriteMany claim mounted at shared_root by every step and the training job.
        cpu_request: CPU request per training pod ('': sized from nproc_per_node).
        cpu_limit: CPU limit per training pod ('': none).
        memory_request: Memory request per training pod ('': sized from nproc_per_node).
        memory_limit: Memory limit per training pod ('': none).
        shm_size: Size limit of /dev/shm in the training pods (memory emptyDir).
        rdma_resources: JSON object RESOURCE -> count: an RDMA device plugin's resources per training pod, plus IPC_LOCK (the fast network: docs/cluster.md; the namespace must allow it).
        node_selector: JSON object of node labels for the training pods.
        tolerations: JSON array of tolerations for the training pods ('key=value:effect' strings or objects).
        priority_class: PriorityClass of the training pods ('': none).
        service_account: ServiceAccount of the training pods ('': the namespace's default; no token is mounted).
        image_pull_secrets: JSON array of Secret names for pulling the training image.
        env: JSON object of extra environment variables of the training container (overrides NCCL defaults); literal values, stored with the run: nothing secret (use env_secrets).
        env_secrets: JSON object NAME -> "SECRET:KEY": environment variables read from Kubernetes Secrets when the pods start.
        env_from_secrets: JSON array of Secret names whose every key becomes an environment variable (PyTorchJob only).
        labels: JSON object of extra labels on the training job and its pods.
        annotations: JSON object of extra annotations on the training job and its pods.
        queue: Kueue LocalQueue of the training job ('': none); Kueue holds it suspended until admitted.
        queue_timeout_s: Fail when the queued job is not admitted after this many seconds (0: no limit but job_timeout_s).
        backoff_limit: Container restarts, summed over the training pods, before the job fails (-1: 3 x nodes).
        termination_grace_period_s: Seconds a training pod has to save a checkpoint after SIGTERM.
        job_timeout_s: Wall-clock limit of the training job, also its activeDeadlineSeconds (0: none).
        scheduling_timeout_s: Fail when the admitted training job does not have all its pods running after this many seconds.
    """
    values = dict(locals())
    from components.pretrain.component import run

    return run(**values)


def evaluate(
    *,
    model: Input[Model],
    dataset: Input[Dataset],
    metrics: Output[Metrics],
    report: Output[HTML],
    decision: Output[Artifact],
    shared_root: str,
    run_id: str,
    mlflow_tracking_uri: str = '',
    eval_batches: int = 0,
    eval_micro_batch_size: int = 16,
    sample_prompts: str = 'To be, or not to be|In the beginning',
    sample_tokens: int = 24,
    sample_temperature: float = 0.8,
    sample_top_k: int = 40,
    sample_seed: int = 1,
    min_improvement: float = 0.0,
) -> bool:
    r"""Measures test loss, perplexity and token accuracy, writes the HTML report, and gates promotion.

    Args:
        model: The pretrain step's manifest (checkpoint on the shared volume).
        dataset: The preprocess step's manifest; its test split is evaluated.
        metrics: test_loss, test_ppl, token_accuracy, test_tokens, incumbent_ppl (when a model was promoted before), unigram_ppl (the baseline), sample_word_fraction (corpus words in the samples), promote (1/0).
        report: HTML report: what ran, loss curves, evaluation table with a unigram baseline, sample generations with the share of their words found in the corpus, configuration.
        decision: JSON with every result and the gate's decision and reason (read by the promote step).
        shared_root: Mount path of the shared volume (or a local folder with backend=local).
        run_id: Unique run id; the run's folders and its training job's name derive from it.
        mlflow_tracking_uri: MLflow server that training, evaluation and promotion log to ('': none; credentials: a Secret, see docs).
        eval_batches: Test batches per evaluated model (0: domino evaluate's default token budget).
        eval_micro_batch_size: Samples per evaluation batch.
        sample_prompts: Prompts of the report's sample generations, separated by '|' ('\n': line break).
        sample_tokens: Tokens generated per report prompt (0: no samples).
        sample_temperature: Sampling temperature of the report's generations.
        sample_top_k: Sample among the k most likely tokens (0: all).
        sample_seed: Seed of the report's sample generations.
        min_improvement: Fraction by which the test perplexity must beat the promoted model's (0: any).

    Returns:
        True when the new model should replace the promoted one (the pipeline's gate).
    """
    values = dict(locals())
    from components.evaluate.component import run

    return run(**values)


def promote_model(
    *,
    model: Input[Model],
    decision: Input[Artifact],
    shared_root: str,
    run_id: str,
    mlflow_tracking_uri: str = '',
    registered_model_name: str = 'domino-gpt',
) -> str:
    r"""Makes ``model`` the promoted model in ``<shared_root>/promoted.json`` (written atomically) and, with a tracking URI, the alias ``champion`` of a new version in MLflow's registry.

    Args:
        model: The pretrain step's manifest.
        decision: The evaluate step's decision (test perplexity and loss of the new model).
        shared_root: Mount path of the shared volume (or a local folder with backend=local).
        run_id: Unique run id; the run's folders and its training job's name derive from it.
        mlflow_tracking_uri: MLflow server that training, evaluation and promotion log to ('': none; credentials: a Secret, see docs).
        registered_model_name: MLflow registered model that gets a version per promotion (with mlflow_tracking_uri).

    Returns:
        The promoted checkpoint directory.
    """
    values = dict(locals())
    from components.promote.component import run

    return run(**values)


def cleanup_job(
    *,
    status: PipelineTaskFinalStatus,
    run_id: str,
    backend: str = 'cluster',
    job_api: str = 'pytorchjob',
    namespace: str = '',
    keep_failed_jobs: bool = True,
) -> None:
    r"""Deletes the run's training job if it is still there (cancelled or crashed launcher).

    Args:
        status: Final status of the tasks inside the exit handler (filled in by kfp).
        run_id: Unique run id; the run's folders and its training job's name derive from it.
        backend: cluster (a job created through the Kubernetes API) or local (processes in the step's pod).
        job_api: pytorchjob (Kubeflow training operator v1) or trainjob (Kubeflow Trainer v2.3, runtime from k8s/trainer).
        namespace: Namespace of the training job ('': the step's own namespace, POD_NAMESPACE).
        keep_failed_jobs: Keep a failed training job for debugging (its TTL removes it later).
    """
    values = dict(locals())
    from components.cleanup.component import run

    return run(**values)
