"""Pipeline parallelism applied to a built ``GPTModel`` from outside, scheduled by ``torch.distributed.pipelining``.

* :mod:`~domino.pipeline.stages` - :func:`~domino.pipeline.stages.split_model`: the whole model cut down to this
  rank's stage (layers divided evenly, embeddings first, final norm, output layer and loss last), or to its model
  chunks of the interleaved schedule (:class:`~domino.pipeline.stages.VirtualStages`);
* :mod:`~domino.pipeline.schedule` - :class:`~domino.pipeline.schedule.StageSchedule`: the stage on the 1F1B
  schedule over the pipeline group, its chunks on the interleaved 1F1B schedule;
* :mod:`~domino.pipeline.gradients` - the tied embeddings' gradient sum over the first and last stage, and which
  parameters a gradient norm counts.

The process grid (TP x PP x DP, Megatron's rank order) and the pipeline and embedding groups are
:mod:`domino.runtime.state`'s. At one stage nothing here runs: the model is not split and the training loop runs
its own micro-batch loop.
"""
