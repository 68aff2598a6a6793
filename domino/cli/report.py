"""``domino report``: one self-contained HTML page about a run (plots, evaluation, config, samples)."""

from __future__ import annotations

import argparse

from domino.cli.checkpoint_flags import add_checkpoint_flags
from domino.cli.generate import prompt_text

DEFAULT_PROMPTS = ["To be, or not to be", "In the beginning"]


def run(args: argparse.Namespace) -> int:
    from domino.eval.report import load_eval_json, write_report

    eval_results = load_eval_json(args.eval_json) if args.eval_json else None
    config, samples = None, None
    if args.load:
        from domino.eval.generate import generate_samples
        from domino.checkpoint.on_disk import Checkpoint

        ckpt = Checkpoint.open(args.load)  # checkpoint.json read and checked once, then passed along
        config = ckpt.meta["config"]
        if args.sample_tokens > 0:
            samples = generate_samples(ckpt, args.sample_prompt or DEFAULT_PROMPTS, args.sample_tokens)
    out = write_report(args.output, args.metrics_file, eval_results=eval_results, config=config, samples=samples,
                       save_root=_save_root(args.load),
                       title=args.title)
    print(out)
    return 0


def _save_root(load):
    """The run's save root for its goodput ledger: ``--load`` itself, or the save root an ``iter_*`` lies in."""
    from pathlib import Path

    from domino.goodput.ledger import LEDGER_FILE

    if not load:
        return None
    return next((p for p in (Path(load), Path(load).parent) if (p / LEDGER_FILE).is_file()), None)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``domino report``."""
    parser = subparsers.add_parser(
        "report", help="Write a self-contained HTML report of a run.",
        description="Plots training/validation loss and throughput from a --metrics-file, and adds the "
                    "evaluation table, the checkpoint's config and a few greedy generations; no external assets.")
    parser.add_argument("--metrics-file", metavar="FILE", help="The run's metrics JSONL (from domino pretrain).")
    parser.add_argument("--eval-json", metavar="FILE", help="Output of `domino evaluate --json`.")
    add_checkpoint_flags(parser, required=False, tokenizer=False)  # the config and the sample generations
    parser.add_argument("--sample-prompt", action="append", metavar="TEXT", type=prompt_text,
                        help="Prompt for a sample generation (repeatable; default: two stock prompts).")
    parser.add_argument("--sample-tokens", type=int, default=24, metavar="N",
                        help="Tokens per sample generation (0: no samples).")
    parser.add_argument("--title", default="domino run report", help="Page title.")
    parser.add_argument("--output", required=True, metavar="FILE", help="The HTML file to write.")
    parser.set_defaults(func=run)
