"""The parallel layout of a job's pods: the pretrain arguments' own, or derived from the pods the job is granted.

A checkpoint is layout-free (docs/training.md, "Elastic resume"), so a run may continue on other pods than
the ones that wrote it. Kueue does not change a job's pods: a preempted PyTorchJob or TrainJob is suspended,
its pods are deleted, and on re-admission it is resumed with the pod counts it had (kubernetes-sigs/kueue
v0.19.2: ``pkg/controller/jobs/kubeflow/kubeflowjob/kubeflowjob_controller.go`` ``PodSets`` sets no
``MinCount``, so there is no partial admission, and ``RunWithPodSetsInfo`` only merges the flavor's node
selectors, tolerations, labels and annotations into the pod templates; ``MinCount`` is set only by the
``batch/Job`` integration, ``pkg/controller/jobs/job/job_controller.go``). A run that must continue on what
a smaller quota grants is therefore submitted again, with the same checkpoint directory and the nodes granted;
``--parallel-layout derive`` then chooses the layout for those pods, so the same command works on any grant.

The rule: the tensor-parallel size stays within one pod (its all-reduces run in every layer's forward and
backward, over NVLink inside a node; the data-parallel gradient reduction, and CP's, cross pods) and is the
smallest that the model admits (heads, query groups, MLP width, the global batch over the data-parallel
replicas: :func:`domino.config.validate.validate`) and, given ``gpu_memory_gb``, whose memory estimate fits
(:mod:`domino.config.estimate` ranks by step time, where a smaller TP exposes fewer all-reduces). A
``--tensor-model-parallel-size`` in the pretrain arguments is the largest allowed. GPU pods need
``gpu_memory_gb``: without it nothing says that a small TP fits. A ``--pipeline-model-parallel-size`` is kept as
given; DP takes the rest.

Context parallelism (CP) is the pretrain arguments' ``--context-parallel-size`` (default 1) unless no TP fits
there and, for some TP, what the sequence length does not change (weights, gradients, optimizer state, buffers)
would: then the sequence's memory (activations, logits, attention buffers) is what does not fit, and CP doubles,
TP tried smallest first again at each size, until a layout fits or the sequence is no longer what is to blame
(CP is not kept within one pod: its exchange runs once per layer, where TP's all-reduces run per GEMM pair).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from domino.config import ConfigError, config_from_args
from domino.config.estimate import USABLE_FRACTION, Estimate, estimate_layout, layout_of
from domino.config.layout import data_parallel_size
from domino.launch.pretrain_flags import flag_value, parse_pretrain_args
from domino.launch.spec import JobSpec, LaunchSpecError

TP_FLAG = "--tensor-model-parallel-size"
CP_FLAG = "--context-parallel-size"


@dataclass(frozen=True)
class DerivedLayout:
    """The layout derived for a job's pods.

    Attributes:
        tensor_model_parallel_size: TP, a divisor of the processes of one pod.
        data_parallel_size: DP, the job's processes over TP (x PP, the pretrain arguments' own).
        why: One line: the pods, the choice, and why smaller TP (and CP) sizes were passed over.
        context_parallel_size: CP: the pretrain arguments' own (default 1), or larger where only that fits.
    """

    tensor_model_parallel_size: int
    data_parallel_size: int
    why: str
    context_parallel_size: int = 1


def processes_per_pod(spec: JobSpec) -> Optional[int]:
    """The processes one pod runs: ``nproc_per_node``, or its GPUs for ``auto``/``gpu``; None when unknown."""
    if isinstance(spec.nproc_per_node, int):
        return spec.nproc_per_node
    if spec.nproc_per_node in ("auto", "gpu") and spec.gpus_per_node > 0:
        return spec.gpus_per_node
    return None


def derive_layout(spec: JobSpec) -> DerivedLayout:
    """The layout ``--parallel-layout derive`` gives ``spec``'s pods (see the module docstring).

    Raises:
        LaunchSpecError: in one line, when the pods cannot hold the run: the processes per pod are unknown,
            GPU pods without ``gpu_memory_gb``, or no tensor-parallel size within a pod passes (each one's
            reason given).
    """
    per_pod = processes_per_pod(spec)
    if per_pod is None:
        raise LaunchSpecError(f"--parallel-layout derive: --nproc-per-node {spec.nproc_per_node} says nothing about "
                              "the processes of a pod; give a number (or --gpus-per-node with auto/gpu)")
    if spec.gpus_per_node > 0 and spec.gpu_memory_gb is None:
        raise LaunchSpecError("--parallel-layout derive on GPU pods needs --gpu-memory-gb: without the memory of a "
                              "GPU nothing says which tensor-parallel size fits")
    world = spec.nodes * per_pod
    given = flag_value(list(spec.pretrain_args), TP_FLAG)
    largest = int(given) if given is not None and given.isdigit() else per_pod
    given_cp = flag_value(list(spec.pretrain_args), CP_FLAG)
    smallest_cp = int(given_cp) if given_cp is not None and given_cp.isdigit() else 1
    pods = f"{spec.nodes} pod(s) x {per_pod} process(es)"
    passed_over: List[str] = []
    sizes = [t for t in range(1, per_pod + 1) if per_pod % t == 0 and t <= largest]
    cp, sequence_to_blame = smallest_cp, True
    while sequence_to_blame and cp <= world:  # larger CP only while the sequence's memory is what does not fit
        sequence_to_blame = False
        for tp in sizes:
            if cp != smallest_cp and world % (tp * cp):  # no such layout: not worth a line of the refusal
                continue
            name = f"TP {tp}" + (f" x CP {cp}" if cp != smallest_cp else "")
            args = parse_pretrain_args([*spec.pretrain_args, TP_FLAG, str(tp), CP_FLAG, str(cp)])
            try:
                config = config_from_args(args, world_size=world, for_training=True)
            except ConfigError as error:
                passed_over.append(f"{name}: {error}")
                continue
            if spec.gpu_memory_gb is not None:
                estimate = estimate_layout(config, layout_of(config, world), gpu_memory_gb=spec.gpu_memory_gb)
                if not estimate.fits:
                    passed_over.append(f"{name}: the estimate is {estimate.total / 2**30:.1f} GiB per GPU, over "
                                       f"{USABLE_FRACTION:.0%} of {spec.gpu_memory_gb:g} GiB (domino estimate)")
                    sequence_to_blame |= _fits_without_the_sequence(estimate)
                    continue
            pp, dp = config.parallel.pipeline_model_parallel_size, data_parallel_size(config, world)
            why = f"{pods}: TP {tp}{f' x PP {pp}' if pp > 1 else ''}{f' x CP {cp}' if cp > 1 else ''} x DP {dp}" + (
                f" ({'; '.join(passed_over)})" if passed_over else "")
            return DerivedLayout(tp, dp, why, cp)
        cp *= 2
    if not passed_over:
        passed_over.append(f"{TP_FLAG} {largest} allows none of the sizes that divide {per_pod}")
    raise LaunchSpecError(f"--parallel-layout derive: {pods} cannot hold this run: " + "; ".join(passed_over))


def _fits_without_the_sequence(estimate: Estimate) -> bool:
    """Whether what the sequence length does not change (weights, gradients, optimizer state, buffers) fits:
    then the activations, logits and attention buffers are what does not, and a larger CP divides them."""
    fixed = (estimate.weights + estimate.gradients + estimate.optimizer + estimate.buffers + estimate.fp32_grads
             + estimate.step_gradient_copy)
    return fixed <= USABLE_FRACTION * estimate.gpu_memory_gb * 2**30


def layout_flags(spec: JobSpec) -> List[str]:
    """The pretrain flags that set the derived layout (after the pretrain arguments: :func:`derived_flags`),
    none for ``--parallel-layout given``."""
    if spec.parallel_layout != "derive" or spec.command is not None:
        return []
    return derived_flags(derive_layout(spec), spec.pretrain_args)


def derived_flags(derived: DerivedLayout, pretrain_args: List[str]) -> List[str]:
    """The flags that set ``derived`` after ``pretrain_args``: the TP size, and the CP size where derive chose
    another than theirs (argparse keeps the last of a repeated flag)."""
    flags = [TP_FLAG, str(derived.tensor_model_parallel_size)]
    if str(derived.context_parallel_size) != (flag_value(list(pretrain_args), CP_FLAG) or "1"):
        flags += [CP_FLAG, str(derived.context_parallel_size)]
    return flags
