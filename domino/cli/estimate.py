"""``domino estimate``: per-GPU memory, FLOPs and step time of a run, and the layouts that fit, before launch.

The formulas live in :mod:`domino.config.estimate`; this module maps flags to calls and prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from domino.config import ConfigError, add_config_flags, config_from_args
from domino.config.flags import add_dataclass_flags
from domino.config.step_time import LinkModel
from domino.config.deepspeed_memory import VALIDATION
from domino.config.estimate import (
    DEVICES, USABLE_FRACTION, describe, describe_pipeline, estimate_layout, fitting_layouts, layout_of,
)

#: Peak dense bf16 TFLOP/s assumed without --peak-tflops: an H100/H200 SXM (domino.train.throughput's table).
DEFAULT_PEAK_TFLOPS = 989.0
#: The same GPU's dense FP8 peak, assumed with --fp8-format (domino.train.throughput.KNOWN_FP8_PEAK_TFLOPS).
DEFAULT_FP8_PEAK_TFLOPS = 1979.0


def exposed(estimate) -> str:
    """The exposed communication by kind, e.g. ``tensor_parallel 0.120 s, data_parallel 0.030 s``."""
    parts = [f"{kind} {seconds:.3f} s" for kind, seconds in estimate.timing.exposed_s.items() if seconds > 0]
    return ", ".join(parts) or "none"


def run(args: argparse.Namespace) -> int:
    if args.gpus is not None and args.gpus < 1:
        raise ConfigError(f"--gpus must be >= 1, got {args.gpus}")
    if args.gpu_memory_gb is not None and args.gpu_memory_gb <= 0:
        raise ConfigError(f"--gpu-memory-gb must be > 0, got {args.gpu_memory_gb}")
    if not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu must be in (0, 1], got {args.mfu}")
    link = LinkModel(**{f.name: getattr(args, f.name) for f in dataclasses.fields(LinkModel)})
    link.check()
    config = config_from_args(args, world_size=args.gpus)
    p = config.parallel  # without --gpus: one replica of the layout the flags ask for
    gpus = args.gpus or p.tensor_model_parallel_size * p.context_parallel_size * p.pipeline_model_parallel_size
    default_peak = DEFAULT_FP8_PEAK_TFLOPS if config.train.fp8_format else DEFAULT_PEAK_TFLOPS
    options = dict(mfu=args.mfu, peak_tflops=config.logging.peak_tflops or default_peak, device=args.device,
                   link=link)
    asked = estimate_layout(config, layout_of(config, gpus), gpu_memory_gb=args.gpu_memory_gb, **options)
    fitting = fitting_layouts(config, gpus, args.gpu_memory_gb, **options) if args.gpu_memory_gb else []
    if args.json:
        out = asked.to_json()
        out["layouts_that_fit"] = [e.to_json() for e in fitting[:args.top]]
        print(json.dumps(out, indent=2))
        return 0
    print(f"model: {asked.parameters / 1e9:.3f} B parameters, {asked.flops_per_token / 1e9:.2f} GFLOP per token "
          f"(training, no recompute); step time at MFU {args.mfu:g} of {options['peak_tflops']:g} TFLOP/s per GPU: "
          f"{asked.step_time_s:.3f} s, of which {asked.exposed_communication_s:.3f} s communication not hidden "
          f"({exposed(asked)})")
    verdict = "" if args.gpu_memory_gb is None else (
        f" -> {'fits' if asked.fits else 'does NOT fit'} in {args.gpu_memory_gb:g} GiB "
        f"({100 * USABLE_FRACTION:g}% usable)")
    print(f"asked:  {describe(asked)}{verdict}")
    if asked.layout.pipeline_model_parallel_size > 1:
        print(f"pipeline: {describe_pipeline(asked)}")
    if asked.layout.context_parallel_size > 1:
        hidden = "hidden under attention" if config.parallel.cp_comm_type == "p2p" else "not hidden"
        print(f"context parallel: {asked.cp_bytes_per_step / 2**30:.3f} GiB sent per GPU per step "
              f"(--cp-comm-type {config.parallel.cp_comm_type}, {hidden})")
    print(f"validated: {VALIDATION['validated']}; NOT validated: {VALIDATION['not_validated']}")
    if args.gpu_memory_gb is not None:
        print(f"layouts that fit in {args.gpu_memory_gb:g} GiB x {gpus} GPUs, best first "
              f"({len(fitting)} in all):" if fitting else "no layout fits")
        for rank, estimate in enumerate(fitting[:args.top], 1):
            print(f"{rank:3d}. {describe(estimate)}, step {estimate.step_time_s:.3f} s "
                  f"(exposed communication {estimate.exposed_communication_s:.3f} s: {exposed(estimate)})")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``domino estimate``."""
    parser = subparsers.add_parser(
        "estimate", help="Per-GPU memory and step time of a run, and the layouts that fit.",
        description="Estimates per-GPU memory (weights, gradients, optimizer state per ZeRO stage, activations per "
                    "recompute and sequence-parallel setting and, with a pipeline, per stage with its micro-batches "
                    "in flight, logits, buffers), FLOPs per token, and the step time: compute at a stated MFU, the "
                    "pipeline bubble and the communication each layout exposes on a link model, for a preset or flags; with --gpu-memory-gb, lists the layouts (TP, PP, DP, ZeRO, "
                    "micro-batch, recompute, SP) that fit, fastest first. Formulas: docs/model.md, 'Memory estimate'.")
    parser.add_argument("--gpus", type=int, default=None,
                        help="GPUs of the run (default: one replica, TP x CP x PP of the flags).")
    parser.add_argument("--gpu-memory-gb", type=float, default=None, help="Memory of one GPU in GiB (e.g. 80).")
    parser.add_argument("--mfu", type=float, default=0.4, help="Model FLOPs utilisation for the step time "
                                                               "(default 0.4).")
    parser.add_argument("--device", choices=DEVICES, default="gpu",
                        help="Whose kernels to assume: gpu (fused attention, 1-byte dropout masks) or cpu.")
    parser.add_argument("--top", type=int, default=10, help="Fitting layouts shown (default 10).")
    parser.add_argument("--json", action="store_true", help="Print one JSON object.")
    add_dataclass_flags(parser, LinkModel, sections={f.name: "links (step time)"
                                                      for f in dataclasses.fields(LinkModel)})
    add_config_flags(parser, groups=("model", "parallel", "train", "logging"))
    parser.set_defaults(func=run)
