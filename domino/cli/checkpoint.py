"""``domino checkpoint inspect`` and ``domino checkpoint convert`` (``domino.checkpoint.tools``)."""

from __future__ import annotations

import argparse
import json

from domino.cli.checkpoint_flags import add_checkpoint_flags


def _inspect(args: argparse.Namespace) -> int:
    from domino.checkpoint.live_reads import read_live
    from domino.checkpoint.tools import inspect

    # A checkpoint pruned by a live run while it is verified is neither damaged nor unverified: the new latest is
    # inspected instead.
    found = read_live(args.load, lambda ckpt: inspect(ckpt, verify=not args.no_verify,
                                                      progress=False if args.no_progress else None),
                      suspect=lambda found: not found.integrity.startswith(("intact", "not verified")))
    print(json.dumps(found.to_json(), indent=1) if args.json else "\n".join(found.lines()))
    return 1 if found.integrity.startswith("DAMAGED") else 0


def _convert(args: argparse.Namespace) -> int:
    from domino.checkpoint.tools import convert_layout, convert_per_tensor
    from domino.config import ConfigError

    progress = False if args.no_progress else None
    if args.per_tensor:
        print(convert_per_tensor(args.load, args.output, progress))
    elif args.tensor_model_parallel_size < 1:
        raise ConfigError(f"--tensor-model-parallel-size {args.tensor_model_parallel_size}: must be at least 1")
    else:
        print(convert_layout(args.load, args.output, args.tensor_model_parallel_size, progress))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``domino checkpoint inspect`` and ``domino checkpoint convert``."""
    parser = subparsers.add_parser("checkpoint", help="Inspect or convert a training checkpoint.",
                                   description="Inspect a checkpoint (iteration, layout, sizes, integrity, the "
                                               "layouts it resumes on) or convert it offline.")
    verbs = parser.add_subparsers(dest="checkpoint_command", metavar="VERB", required=True)
    inspect = verbs.add_parser("inspect", help="What a checkpoint holds and whether it is intact.")
    add_checkpoint_flags(inspect, tokenizer=False)
    inspect.add_argument("--json", action="store_true", help="Print one JSON object instead of text.")
    inspect.add_argument("--no-verify", action="store_true", help="Skip the CRC-32 check of every file.")
    inspect.add_argument("--no-progress", action="store_true", help="No progress bar even on a terminal.")
    inspect.set_defaults(func=_inspect)
    convert = verbs.add_parser("convert", help="Copy a checkpoint resharded for a TP size, or one file per tensor.")
    add_checkpoint_flags(convert, tokenizer=False)
    convert.add_argument("--output", required=True, metavar="DIR", help="A new directory to write.")
    target = convert.add_mutually_exclusive_group(required=True)
    target.add_argument("--tensor-model-parallel-size", type=int, metavar="N",
                        help="Cut the model shards for this TP size (a save root that --load resumes).")
    target.add_argument("--per-tensor", action="store_true",
                        help="One safetensors file per whole tensor (model and optimizer state), for inspection.")
    convert.add_argument("--no-progress", action="store_true", help="No progress bar even on a terminal.")
    convert.set_defaults(func=_convert)
