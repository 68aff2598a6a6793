"""``--parallel-layout derive`` chooses context parallelism when the sequence needs it: at 32k tokens no TP
within a pod of 80 GiB GPUs holds GPT 1.3B's activations at CP 1, while its weights and optimizer state fit;
the smallest CP (then the smallest TP) whose estimate fits is chosen, and the pods' command carries it."""

from __future__ import annotations

import pytest

from domino.launch.parallel_layout import derive_layout, layout_flags
from domino.launch.spec import JobSpec, LaunchSpecError

LONG = ["--preset", "gpt3-1.3b", "--mock-data", "--train-iters", "10", "--seq-length", "32768",
        "--max-position-embeddings", "32768", "--bf16", "--attention-dropout", "0"]


def _derive(nodes, args=LONG, memory=80.0) -> JobSpec:
    return JobSpec(name="gpt", image="i", nodes=nodes, nproc_per_node=8, gpus_per_node=8, gpu_memory_gb=memory,
                   pretrain_args=list(args), parallel_layout="derive")


def test_cp_is_chosen_when_only_the_sequence_does_not_fit():
    one_pod = derive_layout(_derive(1))
    assert (one_pod.tensor_model_parallel_size, one_pod.context_parallel_size) == (4, 2)
    # Passed over, in order: every TP at CP 1, then TP 1 and 2 at CP 2 (the ring's blocks fused on GPUs: the
    # estimate holds no (s/CP)^2 scores, so CP 2 is enough at TP 4).
    assert "TP 8: the estimate is" in one_pod.why and "TP 2 x CP 2: the estimate is" in one_pod.why
    assert "TP 8 x CP 2" not in one_pod.why  # 16 ranks of 8: no such layout, not named
    assert one_pod.why.startswith("1 pod(s) x 8 process(es): TP 4 x CP 2 x DP 1 (TP 1: the estimate is")
    assert layout_flags(_derive(1)) == ["--tensor-model-parallel-size", "4", "--context-parallel-size", "2"]
    two_pods = derive_layout(_derive(2))  # CP may span the pods: TP stays within one
    assert (two_pods.tensor_model_parallel_size, two_pods.context_parallel_size) == (4, 2)


def test_a_given_cp_is_where_the_search_starts_and_the_short_sequence_keeps_cp_1():
    given = derive_layout(_derive(1, [*LONG, "--context-parallel-size", "4"]))
    assert (given.tensor_model_parallel_size, given.context_parallel_size) == (2, 4)
    assert "x CP" not in given.why.split("(")[1]  # the given CP's attempts named by TP alone
    short = derive_layout(_derive(1, [*LONG, "--seq-length", "2048", "--max-position-embeddings", "2048"]))
    assert (short.tensor_model_parallel_size, short.context_parallel_size) == (1, 1)


def test_a_sequence_that_no_cp_holds_is_refused_in_one_line():
    with pytest.raises(LaunchSpecError, match=r"^--parallel-layout derive: 1 pod\(s\) x 8 process\(es\) cannot hold "
                       r"this run: TP 1: .*; TP 1 x CP 8: the estimate is [\d.]+ GiB per GPU, over 90% of 16 GiB "
                       r"\(domino estimate\)$"):
        derive_layout(_derive(1, memory=16.0))
