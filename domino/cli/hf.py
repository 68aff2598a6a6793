"""``domino export-hf`` / ``domino import-hf``: convert between domino checkpoints and Hugging Face GPT-2 or LLaMA."""

from __future__ import annotations

import argparse

from domino.cli.checkpoint_flags import add_checkpoint_flags


def run_export(args: argparse.Namespace) -> int:
    from domino.checkpoint.hf_interop import export_hf
    from domino.checkpoint.live_reads import read_live

    # A live run may prune the checkpoint while it is read: then the new latest is exported.
    out = read_live(args.load, lambda ckpt: export_hf(ckpt, args.output, tokenizer_spec=args.tokenizer,
                                                       overwrite=args.overwrite))
    print(out)
    return 0


def run_import(args: argparse.Namespace) -> int:
    from domino.checkpoint.hf_interop import import_hf

    ckpt = import_hf(args.input, args.output, tokenizer_spec=args.tokenizer,
                     make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, overwrite=args.overwrite)
    print(ckpt)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``domino export-hf`` and ``domino import-hf``."""
    export = subparsers.add_parser(
        "export-hf", help="Write a checkpoint as a Hugging Face GPT-2 or LLaMA directory.",
        description="Merges the TP shards of a checkpoint and writes config.json, model.safetensors and the "
                    "tokenizer files; a GPT model as GPT2LMHeadModel, a LLaMA-family one (rope, RMSNorm, "
                    "SwiGLU) as LlamaForCausalLM; transformers.AutoModelForCausalLM.from_pretrained(OUTPUT) "
                    "loads it offline.")
    add_checkpoint_flags(export)
    export.add_argument("--output", required=True, metavar="DIR", help="Directory to create.")
    export.add_argument("--overwrite", action="store_true", help="Replace a non-empty --output.")
    export.set_defaults(func=run_export)

    imp = subparsers.add_parser(
        "import-hf", help="Turn a Hugging Face GPT-2 or LLaMA directory into a domino checkpoint.",
        description="Reads config.json and safetensors weights (never pickles) and writes a TP=1 weights-only "
                    "checkpoint; fine-tune from it with `domino pretrain --load OUTPUT --finetune`.")
    imp.add_argument("--input", required=True, metavar="HF_DIR", help="Hugging Face GPT-2 or LLaMA model directory.")
    imp.add_argument("--output", required=True, metavar="DIR", help="Save root to create.")
    imp.add_argument("--tokenizer", metavar="SPEC",
                     help="Tokenizer (default: the one in HF_DIR, else gpt2).")
    imp.add_argument("--make-vocab-size-divisible-by", type=int, default=128, metavar="N",
                     help="Pad the vocabulary to a multiple of N (default 128).")
    imp.add_argument("--overwrite", action="store_true", help="Replace a non-empty --output.")
    imp.set_defaults(func=run_import)
