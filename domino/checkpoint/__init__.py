"""The checkpoint format in one place.

* :mod:`~domino.checkpoint.on_disk`: the layout of a save root (``latest``, ``iter_NNNNNNN/``), ``checkpoint.json``,
  the per-TP-rank safetensors model shards, and :class:`~domino.checkpoint.on_disk.Checkpoint` (a directory and
  its checked metadata, read once and passed along);
* :mod:`~domino.checkpoint.model_loading`: building a model from a checkpoint (its metadata checked against the
  shards first);
* :mod:`~domino.checkpoint.sharding`: splitting and merging tensor-parallel shards (resharding);
* :mod:`~domino.optim.state` and :mod:`~domino.checkpoint.distributed_io`: the optimizer state by
  parameter name and global shape, written and read on any layout (``torch.distributed.checkpoint``);
* :mod:`~domino.checkpoint.per_rank_state`: what one rank reads back itself (RNG streams, format 1's optimizer);
* :mod:`~domino.checkpoint.manifest`: sizes and CRC-32 of every file, verified before use;
* :mod:`~domino.checkpoint.checkpointing`: saving a training run, atomically and agreed by all ranks;
* :mod:`~domino.checkpoint.save_root`: one writer per save root (a record lock from start-up to exit);
* :mod:`~domino.checkpoint.leftovers`: sweeping interrupted saves' temporaries, by the save root's holder;
* :mod:`~domino.checkpoint.discovery`: choosing the checkpoint to start from (intact, else the newest intact);
* :mod:`~domino.checkpoint.resume`: checking it fits the run, verifying and loading it on every rank;
* :mod:`~domino.checkpoint.tools`: ``domino checkpoint inspect`` and ``convert``;
* :mod:`~domino.checkpoint.hf_interop`: export to and import from Hugging Face directories.
"""
