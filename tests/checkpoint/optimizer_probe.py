"""Test helper, run under torchrun: builds a run's engine from `domino pretrain` flags, resumes ``--load`` into it
and writes what the optimizer then holds, gathered to whole tensors, to ``OUT`` (a safetensors file, rank 0).

``python optimizer_probe.py OUT PRETRAIN-FLAGS...``; used to prove that a resume on another layout leaves the
optimizer state equal to the checkpoint's.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from domino.checkpoint import discovery, resume, sharding
from domino.cli.main import build_parser
from domino.config import config_from_args
from domino.parallel import random as tp_random
from domino.runtime.mesh import collective_device
from domino.optim import state as optimizer_state
from domino.optim.build import build_optimizer
from domino.train import runtime_start
from domino.train.gpt_recipe import GPTRecipe


def main(out: str, argv) -> None:
    args = build_parser().parse_args(["pretrain", *argv])
    config = config_from_args(args, world_size=int(os.environ.get("WORLD_SIZE", "1")), for_training=True)
    mesh = runtime_start.initialize_runtime(config)
    ckpt, warm = discovery.find_checkpoint(config)
    config, _ = resume.choose_zero_stage(ckpt, config, warm, mesh.dp.size)
    recipe = GPTRecipe(config, mesh)
    config, padded, _ = resume.keep_padded_vocab(ckpt, config, recipe.padded_vocab_size, warm)
    tp_random.model_parallel_seed(config.train.seed, mesh.tp.rank)
    with collective_device(mesh.tp.process_group):
        model = recipe.model_builder(config, mesh)
    optimizer = build_optimizer(model, config, mesh)
    resume.READ_BATCH_BYTES = 1  # every parameter its own collective read: the batched path is what is compared
    resume.load_checkpoint(optimizer, config, mesh, ckpt, padded)
    local, scalars = optimizer_state.gather(optimizer)
    shards = [None] * mesh.tp.size
    dist.all_gather_object(shards, local, group=mesh.tp.process_group)
    if dist.get_rank() == 0:
        full = shards[0] if len(shards) == 1 else sharding.merge_tp_shards(shards)
        save_file({k: v.contiguous() for k, v in full.items()}, out, metadata={"step": str(scalars.step)})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)
