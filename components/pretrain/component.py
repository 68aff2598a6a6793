"""kfp wrapper of the pretrain step (see ``step.py`` for the logic and ``README.md`` for usage)."""

from typing import Optional

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Model, Output

from components import default_image


def pretrain(
    dataset: Input[Dataset],
    model: Output[Model],
    metrics: Output[Metrics],
    shared_root: str,
    run_id: str,
    preset: str = "tiny",
    config_overrides: str = "{}",
    train_iters: int = 20,
    micro_batch_size: int = 4,
    global_batch_size: int = 0,
    lr: float = 0.0,
    split: str = "90,5,5",
    tokenizer: str = "gpt2",
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
    image: str = "",
    namespace: str = "domino",
    job_name: str = "gpt-pretrain",
    pvc_name: str = "domino-data",
    cpu_request: str = "",
    memory_request: str = "",
    memory_limit: str = "",
    node_selector: str = "{}",
    tolerations: str = "[]",
    job_timeout_s: int = 0,
    scheduling_timeout_s: int = 600,
):
    """Trains a GPT model with a distributed ``domino pretrain`` job (PyTorchJob, or local processes).

    Args:
        dataset: The preprocess step's manifest (its ``prefix`` becomes ``--data-path``).
        model: Manifest of the final checkpoint (on the shared volume); metadata: iterations, tokens_seen,
            final losses, checkpoint_dir, job.
        metrics: final_train_loss, final_valid_loss, tokens_per_s, mfu, tflops_per_device, iterations.
        shared_root: Mount path of the shared volume (or a local folder with backend=local).
        run_id: Unique run id; the job name and folders derive from it.
        preset: Model/training preset (tiny, gpt2-125m, gpt3-1.3b, ...).
        config_overrides: JSON object of further config fields, e.g. {"num_layers": 4, "bf16": true}.
        train_iters: Optimizer steps.
        micro_batch_size: Samples per process per pass.
        global_batch_size: Samples per step (0: micro batch x data-parallel size).
        lr: Peak learning rate (0: the preset's).
        split: Train/valid/test split of the documents.
        tokenizer: Tokenizer used by preprocess.
        save_interval: Save every N steps (0: only the final save).
        eval_interval: Validate every N steps.
        eval_iters: Batches per validation.
        log_interval: Metrics line every N steps.
        nodes: Pods of the job.
        nproc_per_node: Processes per pod.
        gpus_per_node: GPUs requested per pod (0 on CPU).
        tensor_parallel: Tensor-parallel size.
        domino_chunks: Domino micro-chunks per layer (1: plain TP).
        zero_stage: DeepSpeed ZeRO stage (0, 1, 2).
        warm_start: Start from the promoted model's weights (registry on the shared volume).
        backend: pytorchjob (in a cluster) or local (processes where the step runs).
        image: Training image ('' : the components' image).
        namespace: Namespace of the job.
        job_name: Base name of the job; the run id is appended.
        pvc_name: ReadWriteMany claim mounted at shared_root in the job's pods.
        cpu_request: CPU request per pod ('' : none).
        memory_request: Memory request per pod ('' : none).
        memory_limit: Memory limit per pod ('' : none).
        node_selector: JSON object of node labels for the job's pods.
        tolerations: JSON array of tolerations ('key=value:effect' strings or objects).
        job_timeout_s: Wall-clock limit of the job (0: none).
        scheduling_timeout_s: Fail when the job is not running after this many seconds.
    """
    values = dict(locals())
    from components.pretrain.step import metric_values, run_pretrain, settings_from_kwargs

    summary = run_pretrain(settings_from_kwargs(values), dataset.path, model.path)
    model.metadata.update({key: value for key, value in summary.items() if key != "config"})
    for name, value in metric_values(summary).items():
        metrics.log_metric(name, value)


def build(image: Optional[str] = None):
    """The pretrain component running in ``image`` (default: :func:`components.default_image`)."""
    return dsl.component(pretrain, base_image=image or default_image(), install_kfp_package=False)
