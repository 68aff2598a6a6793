"""The pipeline's preprocess stage: plan, a ``ParallelFor`` fan-out over shard groups, then a merge.

::

    plan-preprocess ............. inputs -> dataset key + shard groups (JSON list)
    ParallelFor(groups, parallelism=N):
      preprocess ................ tokenise one group, or find it (or the whole dataset) done
    merge-datasets .............. dsl.Collected(results) -> the groups concatenated in order -> Dataset

KFP runs the fan-out: ``dsl.ParallelFor`` over a task's list output, at most ``parallelism``
iterations at a time, and ``dsl.Collected`` hands every iteration's output to the merge as one list
(kfp 2.17, ``kfp/dsl/tasks_group.py`` and ``kfp/dsl/for_loop.py``). ``parallelism`` is compiled into
the pipeline (the ``iteratorPolicy.parallelismLimit`` of the loop; kfp takes a Python int there, not a
run parameter); the number of groups is a run parameter. ``kfp.local`` 2.17 runs the same graph: its
``enhanced_dag_orchestrator`` runs ParallelFor iterations on a thread pool bounded by the same limit
and publishes their outputs for ``dsl.Collected`` (``kfp/local/orchestrator/enhanced_dag_orchestrator.py``).
"""

from __future__ import annotations

from typing import Callable, Optional

from kfp import dsl

from components import kfp_component, kfp_functions


class PreprocessStage:
    """The stage's three components, built once per pipeline for one image.

    Args:
        image: Image of the steps.
        parallelism: Most preprocess tasks running at once (0: as many as there are groups).
    """

    def __init__(self, image: Optional[str] = None, parallelism: int = 0) -> None:
        if parallelism < 0:
            raise ValueError(f"preprocess parallelism: {parallelism} must be >= 0 (0: unbounded)")
        self.parallelism = parallelism
        self.plan_op = kfp_component(kfp_functions.plan_preprocess, image)
        self.preprocess_op = kfp_component(kfp_functions.preprocess, image)
        self.merge_op = kfp_component(kfp_functions.merge_datasets, image)

    def __call__(self, configure: Callable, arguments: Callable, tokenizer):
        """Adds the stage to the pipeline being defined; returns the merge task (its ``dataset`` output).

        ``configure`` is applied to every task (volume mounts, placement, caching); ``arguments(function,
        **wired)`` gives a task's pipeline parameters plus ``wired``; ``tokenizer`` is train-tokenizer's output.
        """
        plan = configure(self.plan_op(**arguments("plan_preprocess", tokenizer=tokenizer)))
        # Each group item carries the tokenizer and the JSON keys the plan keyed it with, so the loop body
        # takes no second task output: kfp.local 2.17 handed the loop item to such an input (seen in
        # tests/pipelines/test_pipeline_local_e2e.py with the train-tokenizer output; the compiled spec was right).
        with dsl.ParallelFor(plan.output, parallelism=self.parallelism, name="shard-groups") as group:
            part = configure(self.preprocess_op(**arguments("preprocess", group=group)))
        return configure(self.merge_op(**arguments("merge_datasets", parts=dsl.Collected(part.output))))
