"""The checkpoint format in one place.

* :mod:`~domino.checkpoint.on_disk`: the layout of a save root (``latest``, ``iter_NNNNNNN/``),
  ``checkpoint.json`` and the per-TP-rank safetensors model shards; building a model from a checkpoint;
* :mod:`~domino.checkpoint.sharding`: splitting and merging tensor-parallel shards (resharding);
* :mod:`~domino.checkpoint.manifest`: sizes and CRC-32 of every file, verified before use;
* :mod:`~domino.checkpoint.checkpointing`: saving a training run (model, optimizer, RNG, data position),
  atomically and agreed by all ranks;
* :mod:`~domino.checkpoint.resume`: choosing an intact checkpoint, verifying and loading it on every rank;
* :mod:`~domino.checkpoint.hf_interop`: export to and import from Hugging Face GPT-2 directories.
"""
