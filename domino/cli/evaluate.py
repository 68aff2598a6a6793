"""``domino evaluate``: loss, perplexity and token accuracy of a checkpoint on a dataset (TP under torchrun)."""

from __future__ import annotations

import argparse
import json

from domino.cli.checkpoint_flags import add_checkpoint_flags
from domino.eval.settings import add_eval_flags, eval_settings_from_args
from domino.tracking import evaluation_scalars, tracker_of_checkpoint

def _held_out_split(ckpt) -> str:
    """The checkpoint's own ``--split``: with --data-path, its test part is what training held out."""
    return ckpt.meta["config"]["data"]["split"]


def _log_to_training_run(load: str, result) -> None:
    """With ``MLFLOW_TRACKING_URI`` set, the result goes to the MLflow run that trained the checkpoint, at its
    iteration (bounded wait; a failure is said, never raised)."""
    tracker = tracker_of_checkpoint(load, "evaluation")
    if tracker is not None:
        numbers = {key: result[key] for key in ("loss", "ppl", "accuracy")}
        tracker.log_metrics(evaluation_scalars(numbers, int(result["iteration"])))
        tracker.set_tags({"domino.evaluated_data": result["data"], "domino.evaluated_tokens": result["tokens"]})
        tracker.finish(completed=False)


def run(args: argparse.Namespace) -> int:
    from domino.checkpoint.live_reads import one_process, read_live
    from domino.eval.evaluate import evaluate_checkpoint
    from domino.eval.runtime import is_output_rank, parse_dtype, teardown

    dtype = parse_dtype(args.dtype)

    def evaluate(ckpt):  # checkpoint.json read and checked once, then passed along
        split = args.split or (_held_out_split(ckpt) if args.data_path else None)
        return evaluate_checkpoint(
            ckpt, args.data_path, eval_settings_from_args(args), split=split,
            seq_length=args.seq_length, eod_mask_loss=args.eod_mask_loss,
            reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
            tensor_model_parallel_size=args.tensor_model_parallel_size, tokenizer_spec=args.tokenizer,
            seed=args.seed, data_cache_path=args.data_cache_path, dtype=dtype, progress=not args.no_progress)

    try:
        # A live run may prune the checkpoint while it is read: one process reads the new latest, ranks say so.
        result = read_live(args.load, evaluate, retry=one_process())
        output = is_output_rank()
    finally:
        teardown()
    if output:
        _log_to_training_run(args.load, result)
        if args.json:
            print(json.dumps(result))
        else:
            print(f"checkpoint {result['checkpoint']} (iteration {result['iteration']}): loss {result['loss']:.4f}  "
                  f"ppl {result['ppl']:.3f}  accuracy {result['accuracy']:.4f}  tokens {result['tokens']} "
                  f"of the {result['data']}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``domino evaluate``."""
    parser = subparsers.add_parser(
        "evaluate", help="Loss, perplexity and token accuracy of a checkpoint.",
        description="Evaluates a checkpoint (saved with any TP size) on --data-path, or on the test split of the "
                    "data it was trained on. Under torchrun the model runs tensor-parallel over the processes.")
    add_checkpoint_flags(parser, tensor_model_parallel_size=True, dtype=True)
    parser.add_argument("--data-path", nargs="+", metavar="PREFIX",
                        help="Dataset prefix(es), optionally weighted (default: the checkpoint's test split).")
    parser.add_argument("--split", metavar="SPLIT",
                        help="Evaluate the test part of this train,valid,test split of --data-path (default: the "
                             "checkpoint's split, i.e. the documents training held out; 0,0,1: every document).")
    add_eval_flags(parser)
    parser.add_argument("--seq-length", type=int, metavar="S", help="Sample length (default: the checkpoint's).")
    for flag, what in (("eod-mask-loss", "Exclude end-of-document tokens from the loss"),
                       ("reset-position-ids", "Restart position ids after end-of-document tokens"),
                       ("reset-attention-mask", "Stop attention across end-of-document tokens")):
        parser.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=None,
                            help=f"{what} (default: the checkpoint's setting).")
    parser.add_argument("--seed", type=int, help="Sample-order seed (default: the checkpoint's).")
    parser.add_argument("--data-cache-path", metavar="DIR", help="Where to cache sample indices.")
    parser.add_argument("--json", action="store_true", help="Print the result as one JSON object.")
    parser.add_argument("--no-progress", action="store_true", help="No progress bar.")
    parser.set_defaults(func=run)
