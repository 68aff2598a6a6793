"""The optimizer of a training run behind one interface (:mod:`domino.optim.interface`), and DeepSpeed inside it.

* :mod:`~domino.optim.interface`: :class:`~domino.optim.interface.TrainingOptimizer`, all the loop, the pipeline
  step and the checkpoint manager use;
* :mod:`~domino.optim.deepspeed_optimizer`: DeepSpeed's engine and its ZeRO 1/2 and 16-bit optimizers behind it;
  :mod:`~domino.optim.bf16_step`, :mod:`~domino.optim.zero_step`, :mod:`~domino.optim.device_loss_scale`: their
  steps decided on the device, in subclasses (:mod:`~domino.optim.deepspeed_subclasses`) that DeepSpeed's engine
  subclass builds (:mod:`~domino.optim.deepspeed_engine`); :mod:`~domino.optim.deepspeed_config`, :mod:`~domino.optim.deepspeed_mpu`,
  :mod:`~domino.optim.deepspeed_runtime`: the config, the mesh and the process-wide set-up DeepSpeed reads;
* :mod:`~domino.optim.clipping`: the global gradient norm, clipping and a torch optimizer's device-decided skip;
* :mod:`~domino.optim.state`, :mod:`~domino.optim.state_dict`: the state by parameter name that checkpoints store
  on any layout, and format 1's per-rank state dict.

No module outside this package imports DeepSpeed (``tests/test_layering.py``).
"""
