"""``domino pretrain``: GPT pretraining from Megatron-style flags (run under torchrun or alone)."""

from __future__ import annotations

import argparse
import json
import os

from domino.config import add_config_flags, config_from_args


def _run(args: argparse.Namespace) -> int:
    from domino.train.runtime_start import set_overlap_environment
    from domino.train.host_allocator import keep_step_buffers_in_heap
    from domino.parallel import kernels

    set_overlap_environment()  # before anything touches CUDA
    keep_step_buffers_in_heap()  # before the model and the data allocate
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # Every rank checks the flags and the device before torch.distributed, DeepSpeed or the data start.
    config = config_from_args(args, world_size=world_size, for_training=True)
    kernel_choice = kernels.from_environment()  # DOMINO_KERNELS, read once: a value given to the model
    from domino.runtime.agreement import agree
    from domino.train.gpt_recipe import GPTRecipe
    from domino.train.inprocess import train_with_restarts
    from domino.train.pretrain import pretrain

    def train(mesh, origin):
        # torch.distributed first: a data or tokenizer check that fails on one rank then stops every rank.
        recipe = agree("checking the data and the tokenizer", lambda: GPTRecipe(config, mesh, kernel_choice))
        return pretrain(config, recipe.model_builder, recipe.dataset_builder, recipe.forward_step,
                        recipe.padded_vocab_size, recipe.tokenizer, get_batch=recipe.batch, mesh=mesh,
                        origin=origin)

    result = train_with_restarts(config, train)  # again in this process after a failure, with --inprocess-restart
    if int(os.environ.get("RANK", "0")) == 0 and args.result_json:
        from domino.atomic_files import atomic_write_text

        atomic_write_text(args.result_json, json.dumps(vars(result), indent=2))
    # 128 + SIGTERM: a retryable exit for the training operator's ExitCode restart policy.
    return 143 if result.interrupted else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``domino pretrain``."""
    parser = subparsers.add_parser(
        "pretrain", help="Pretrain a GPT (DeepSpeed ZeRO, tensor parallel + Domino, checkpoints, evaluation).",
        description="Pretrain a GPT. Run alone for one process, or under a launcher for many: "
                    "`torchrun --nproc-per-node 2 -m domino pretrain --preset tiny --tensor-model-parallel-size 2 ...` "
                    "or `deepspeed --num_gpus 2 --module domino pretrain ...`. Megatron-LM's pretrain_gpt.py flags "
                    "are accepted (docs/megatron.md).")
    add_config_flags(parser)
    parser.add_argument("--result-json", metavar="FILE", default=None,
                        help="Write the run's final numbers (iteration, losses, tokens/s, checkpoint) here.")
    parser.set_defaults(func=_run)
