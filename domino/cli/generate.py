"""``domino generate``: continue a prompt with a checkpoint (KV cache; greedy or sampled)."""

from __future__ import annotations

import argparse
import json

from domino.cli.checkpoint_flags import add_checkpoint_flags
from domino.config import ConfigError


def prompt_text(text: str) -> str:
    """An argparse type: prompt text the tokenizer can encode. A byte that is not UTF-8 on the command line
    reaches Python as a lone surrogate U+DC80..U+DCFF (PEP 383), which the tokenizer refuses with a bare
    TypeError, so it is named here, before a checkpoint is loaded."""
    from domino.data.text_inputs import first_surrogate

    at = first_surrogate(text)
    if at is None:
        return text
    point = ord(text[at])
    what = f"byte 0x{point - 0xDC00:02x}" if 0xDC80 <= point <= 0xDCFF else f"lone surrogate U+{point:04X}"
    raise argparse.ArgumentTypeError(f"not valid UTF-8 text ({what} at character {at + 1})")


def _prompt_ids(text: str):
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        ids = [-1]
    if any(i < 0 for i in ids):  # before the checkpoint is loaded; the upper bound needs its vocabulary
        raise ConfigError(f"--prompt-ids must be comma-separated integers >= 0, got {text!r}")
    return ids


def run(args: argparse.Namespace) -> int:
    from domino.eval.generate import generate
    from domino.eval.runtime import default_device, is_output_rank, parse_dtype, setup_tensor_parallel, teardown
    from domino.eval.sampling import SamplingConfig
    from domino.checkpoint.live_reads import one_process, read_live
    from domino.checkpoint.model_loading import build_model_from_checkpoint

    sampled = any(v is not None for v in (args.temperature, args.top_k, args.top_p))
    if args.greedy and sampled:
        raise ConfigError("--greedy cannot be combined with --temperature, --top-k or --top-p")
    sampling = SamplingConfig(greedy=args.greedy, temperature=args.temperature or 1.0, top_k=args.top_k or 0,
                              top_p=1.0 if args.top_p is None else args.top_p)
    sampling.check()
    prompt_ids = _prompt_ids(args.prompt_ids) if args.prompt_ids is not None else None
    dtype = parse_dtype(args.dtype)
    mesh = setup_tensor_parallel(args.tensor_model_parallel_size)
    try:
        # A live run may prune the checkpoint while it is read: one process reads the new latest, ranks say so.
        model, _, tokenizer = read_live(args.load, lambda ckpt: build_model_from_checkpoint(
            ckpt, mesh.tp, device=default_device(), dtype=dtype, tokenizer_spec=args.tokenizer), retry=one_process())
        if prompt_ids is None:
            prompt_ids = tokenizer.encode(args.prompt)
        result = generate(model, tokenizer, prompt_ids, args.max_new_tokens, sampling, seed=args.seed,
                          use_cache=not args.no_cache, stop_at_eod=not args.no_stop_at_eod)
    finally:
        teardown()
    if is_output_rank():
        if args.json:
            print(json.dumps({"token_ids": result.token_ids, "text": result.text}))
        else:
            print(result.text)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``domino generate``."""
    parser = subparsers.add_parser(
        "generate", help="Continue a prompt with a checkpoint.",
        description="Generates tokens after a prompt with a domino checkpoint (any TP size; run under torchrun "
                    "for tensor parallelism). Each new token costs one position thanks to the KV cache; "
                    "generation stops at the end-of-document token.")
    add_checkpoint_flags(parser, tensor_model_parallel_size=True, dtype=True)
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", type=prompt_text, help="Prompt text (encoded with the checkpoint's tokenizer).")
    prompt.add_argument("--prompt-ids", metavar="IDS", help="Prompt token ids, comma-separated: 1,2,3.")
    parser.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="Tokens to generate at most.")
    parser.add_argument("--greedy", action="store_true", help="Always take the most likely token.")
    parser.add_argument("--temperature", type=float, metavar="T", help="Sampling temperature (default 1.0).")
    parser.add_argument("--top-k", type=int, metavar="K", help="Sample among the K most likely tokens (0: all).")
    parser.add_argument("--top-p", type=float, metavar="P", help="Nucleus sampling probability mass (1.0: all).")
    parser.add_argument("--seed", type=int, default=0, help="Sampling seed (same seed, same tokens).")
    parser.add_argument("--json", action="store_true", help='Print {"token_ids": [...], "text": "..."}.')
    parser.add_argument("--no-cache", action="store_true", help="Recompute the whole sequence every step (slow).")
    parser.add_argument("--no-stop-at-eod", action="store_true", help="Keep going past end-of-document.")
    parser.set_defaults(func=run)
