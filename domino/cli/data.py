"""``domino preprocess``, ``merge-datasets`` and ``train-tokenizer`` (thin wrappers over :mod:`domino.data`)."""

from __future__ import annotations

import argparse
import json

from domino.data.builtin_corpora import list_builtin_corpora
from domino.data.limits import MAX_DOCUMENT_CHARS, MAX_LINE_BYTES


def _add_input_flags(parser: argparse.ArgumentParser, input_flag: str) -> None:
    parser.add_argument(input_flag, dest="input", nargs="+", metavar="PATH",
                        help=".jsonl/.json/.txt files (optionally .gz or .zst), .parquet files, directories or "
                             "glob patterns (quote globs), several allowed")
    parser.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                        help="JSON keys holding the text; one output dataset per key (default: text)")
    parser.add_argument("--txt-document-per-file", action="store_true",
                        help="a whole .txt file is one document (default: blank-line-separated blocks)")
    parser.add_argument("--skip-bad-lines", action="store_true",
                        help="drop and count malformed/undecodable lines instead of stopping at the first")
    parser.add_argument("--builtin-corpus", metavar="NAME",
                        help="use a built-in demo corpus instead of input files (see --list-builtin-corpora)")
    parser.add_argument("--list-builtin-corpora", action="store_true", help="list the built-in corpora and exit")


def _list_corpora() -> int:
    for name, description in list_builtin_corpora().items():
        print(f"{name:20s} {description}")
    return 0


def _run_preprocess(args: argparse.Namespace) -> int:
    if args.list_builtin_corpora:
        return _list_corpora()
    if not args.output_prefix:
        args.parser.error("--output-prefix is required")
    from domino.data.preprocess import preprocess

    result = preprocess(args.input, args.output_prefix, tokenizer=args.tokenizer, json_keys=args.json_keys,
                        append_eod=args.append_eod, workers=args.workers, skip_bad_lines=args.skip_bad_lines,
                        builtin_corpus=args.builtin_corpus, txt_document_per_file=args.txt_document_per_file,
                        progress=False if args.no_progress else None, max_document_chars=args.max_document_chars,
                        max_line_bytes=args.max_line_bytes)
    if args.json:
        print(json.dumps({**result.__dict__, "tokens_per_second": result.tokens_per_second}, indent=2))
    else:
        for key, prefix in result.prefixes.items():
            print(f"wrote {prefix}.bin and {prefix}.idx  (key {key})")
        print(f"preprocess: {result.summary()}")
    return 0


def _run_merge(args: argparse.Namespace) -> int:
    from domino.data.merge import merge_datasets

    result = merge_datasets(args.input, args.output_prefix)
    if args.json:
        print(json.dumps(result.__dict__, indent=2))
    else:
        print(f"wrote {result.prefix}.bin and {result.prefix}.idx")
        print(result.summary())
    return 0


def _run_train_tokenizer(args: argparse.Namespace) -> int:
    if args.list_builtin_corpora:
        return _list_corpora()
    from domino.data.tokenizer_training import train_tokenizer

    tokenizer = train_tokenizer(args.input, args.vocab_size, args.output, json_keys=args.json_keys,
                                builtin_corpus=args.builtin_corpus, min_frequency=args.min_frequency,
                                txt_document_per_file=args.txt_document_per_file,
                                skip_bad_lines=args.skip_bad_lines)
    print(f"wrote {args.output}: byte-level BPE, vocab size {tokenizer.vocab_size}, "
          f"end-of-document {tokenizer.eod_token!r} = {tokenizer.eod}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``preprocess``, ``merge-datasets`` and ``train-tokenizer``."""
    pre = subparsers.add_parser(
        "preprocess", help="tokenise text into Megatron .bin/.idx datasets",
        description="Tokenise .jsonl/.txt files (or a built-in corpus) into {prefix}_{key}_document.bin/.idx, "
                    "the format of Megatron-LM's preprocess_data.py. Output appears only when complete.")
    _add_input_flags(pre, "--input")
    pre.add_argument("--output-prefix", metavar="PREFIX", help="output path prefix (required)")
    pre.add_argument("--tokenizer", default="gpt2",
                     help="gpt2 (default), a tokenizer.json file, or a directory with tokenizer.json or "
                          "vocab.json + merges.txt")
    pre.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                     help="append the end-of-document token to every document (default: on)")
    pre.add_argument("--workers", type=int, default=1,
                     help="tokeniser threads, one core each, capped at the CPUs available (default: 1)")
    pre.add_argument("--max-document-chars", type=int, default=MAX_DOCUMENT_CHARS, metavar="N",
                     help="the most text the tokenizer takes in one call (~130 bytes of memory per character); "
                          f"longer documents are encoded N characters at a time (default: {MAX_DOCUMENT_CHARS:,})")
    pre.add_argument("--max-line-bytes", type=int, default=MAX_LINE_BYTES, metavar="N",
                     help="the longest input line read into memory (decompressed); a longer one is an error naming "
                          f"the file and line, or is skipped with --skip-bad-lines (default: {MAX_LINE_BYTES:,})")
    pre.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")
    pre.add_argument("--json", action="store_true", help="print the result as JSON")
    pre.set_defaults(func=_run_preprocess, parser=pre)

    merge = subparsers.add_parser(
        "merge-datasets", help="concatenate .bin/.idx datasets into one (as Megatron's tools/merge_datasets.py)",
        description="Concatenate indexed datasets, in the order given, into OUT.bin/OUT.idx: the bytes that "
                    "preprocessing all their inputs in one run writes. Token dtypes and tokenizers (from the "
                    ".meta.json sidecars) must agree. Streams with flat memory; output appears only when complete.")
    merge.add_argument("--input", nargs="+", required=True, metavar="PREFIX",
                       help="dataset prefixes (PREFIX.bin + PREFIX.idx), or directories: every dataset in one, "
                            "in sorted order")
    merge.add_argument("--output-prefix", required=True, metavar="OUT", help="output path prefix")
    merge.add_argument("--json", action="store_true", help="print the result as JSON")
    merge.set_defaults(func=_run_merge, parser=merge)

    train = subparsers.add_parser(
        "train-tokenizer", help="train a byte-level BPE tokenizer with an end-of-document token",
        description="Train a GPT-2 style byte-level BPE (Hugging Face tokenizers) with <|endoftext|> as "
                    "end-of-document token; the output directory works as --tokenizer DIR.")
    _add_input_flags(train, "--input")
    train.add_argument("--vocab-size", type=int, default=8192, help="vocabulary size (default: 8192)")
    train.add_argument("--output", metavar="DIR", help="output directory (required)")
    train.add_argument("--min-frequency", type=int, default=2, help="minimum pair count for a merge (default: 2)")
    train.set_defaults(func=_run_train_tokenizer, parser=train)

    def _check_output(args: argparse.Namespace) -> int:
        if not args.list_builtin_corpora and not args.output:
            train.error("--output is required")
        return _run_train_tokenizer(args)

    train.set_defaults(func=_check_output)
