"""The checkpoint format's integrity layer: manifests with sizes and checksums, verified before use.

The rest of the format (layout, ``checkpoint.json``, model shards, resharding) still lives in
``domino.model.weights_io`` and ``domino.train.checkpointing``; it moves here piece by piece.
"""
