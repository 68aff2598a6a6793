"""The flags of every verb that reads a checkpoint, declared once (``evaluate``, ``generate``, ``export-hf``,
``report``): where it is, and how to load it."""

from __future__ import annotations

import argparse

#: Help of ``--load`` (a save root resolves to its ``latest`` checkpoint, domino.checkpoint.on_disk).
LOAD_HELP = "Save root (its latest) or iter_* directory."


def add_checkpoint_flags(parser: argparse.ArgumentParser, *, required: bool = True, tokenizer: bool = True,
                         tensor_model_parallel_size: bool = False, dtype: bool = False) -> None:
    """Adds ``--load`` and, as asked, the flags that say how the checkpoint is loaded.

    Args:
        parser: The verb's parser.
        required: Whether ``--load`` must be given.
        tokenizer: Add ``--tokenizer`` (override the checkpoint's tokenizer).
        tensor_model_parallel_size: Add ``--tensor-model-parallel-size`` (the TP size to load at; the verb runs
            tensor-parallel under torchrun).
        dtype: Add ``--dtype`` (the parameters' dtype after loading).
    """
    parser.add_argument("--load", required=required, metavar="DIR", help=LOAD_HELP)
    if tokenizer:
        parser.add_argument("--tokenizer", metavar="SPEC", help="Override the checkpoint's tokenizer.")
    if tensor_model_parallel_size:
        parser.add_argument("--tensor-model-parallel-size", type=int, metavar="TP",
                            help="TP size to load at (default: the number of processes).")
    if dtype:
        parser.add_argument("--dtype", default="fp32", help="fp32, fp16 or bf16 (default fp32).")
