"""``domino goodput``: where a run's wall time went, over all its attempts (from ``<save>/goodput.jsonl``)."""

from __future__ import annotations

import argparse
import json
import time


def run(args: argparse.Namespace) -> int:
    from domino.goodput.accounting import account, format_report
    from domino.goodput.ledger import read_events

    report = account(read_events(args.load), now=time.time() if args.live else None)
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``domino goodput``."""
    parser = subparsers.add_parser(
        "goodput", help="Report a run's goodput: productive time against start-up, saves, evaluation, lost and "
                        "idle time, over every attempt.",
        description="Reads the goodput ledger a run's rank 0 keeps in its --save directory (one record per "
                    "attempt: start-up, saves, evaluation, progress, how it ended) and prints where the wall time "
                    "went; the parts add up to the wall time, goodput = productive / wall (docs/training.md).")
    parser.add_argument("--load", required=True, metavar="DIR", help="The run's save root (its --save).")
    parser.add_argument("--json", action="store_true", help="Print the report as JSON.")
    parser.add_argument("--live", action="store_true",
                        help="The newest attempt is still running: count it up to now (default: to its last record).")
    parser.set_defaults(func=run)
