"""Bounds on untrusted input data, in one place (light: the command line imports it to show the defaults)."""

#: Default of ``domino preprocess --max-document-chars``: the most text the tokenizer takes in one call. A call
#: costs about 130 bytes of memory per character (the encodings with their offsets), so ~1.3 GB per worker
#: at this cap; a longer document (one huge JSON line, a ``.txt`` without blank lines) is encoded slice by slice.
MAX_DOCUMENT_CHARS = 10_000_000

#: Default of ``domino preprocess --max-line-bytes``: the longest input line (decompressed, newline included)
#: read into memory. A JSON line is parsed whole, so it is the one bound on what one line can cost (~3-4x its
#: size while it is decoded and parsed); a longer line (a one-line ``.jsonl.gz`` bomb) is a clear error, or is
#: skipped, read through in bounded blocks, with ``--skip-bad-lines``.
MAX_LINE_BYTES = 64 << 20

#: Tokens read per block when a dataset's token ids are checked against the vocabulary (16 MiB of int32).
TOKEN_CHECK_BLOCK = 1 << 22
