"""Megatron-LM compatibility of the command line: no abbreviations, launcher flags, Domino's default, notes
for flags without effect, refusals naming the feature, and device checks."""

import argparse
import logging
import re
from pathlib import Path

import pytest

from domino.cli.main import build_parser
from domino.config import ConfigError, DominoConfig, parse_config
from domino.config.flags import config_to_dict, flag_name
from domino.config.legacy_flags import LEGACY_FLAGS
from domino.config.schema import KernelConfig
from domino.config.validate import advisories, check_device

DOCS = Path(__file__).resolve().parents[2] / "docs" / "megatron.md"


def _all_parsers(parser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_parsers(sub)


def test_no_domino_parser_accepts_abbreviations():
    parsers = list(_all_parsers(build_parser()))
    assert len(parsers) > 15 and all(p.allow_abbrev is False for p in parsers)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["pretrain", "--seq", "32"])
    assert build_parser().parse_args(["pretrain", "--seq-length", "32"]).seq_length == 32


def test_pipeline_config_overrides_refuse_abbreviations():
    from domino.launch.pretrain_args import resolve_pretrain
    from domino.launch.spec import JobSpec

    with pytest.raises(ValueError, match="--seq"):
        resolve_pretrain(JobSpec(name="gpt", image="i", pretrain_args=["--mock-data", "--train-iters", "1",
                                                                        "--seq", "32"]))


def test_launch_check_refuses_abbreviations():
    from domino.launch.pretrain_flags import _RaisingParser

    assert _RaisingParser().allow_abbrev is False


@pytest.mark.parametrize("argv", [["--local_rank=1", "pretrain"], ["--local-rank", "1", "pretrain"],
                                  ["pretrain", "--local_rank=1"], ["pretrain", "--local-rank", "1"]])
def test_launcher_local_rank_is_accepted_before_or_after_the_verb(argv):
    args = build_parser().parse_args(argv)
    assert args.command == "pretrain"


@pytest.mark.parametrize("argv, chunks, reason", [
    (["--tensor-model-parallel-size", "2"], 2, "is even"),
    (["--tensor-model-parallel-size", "2", "--micro-batch-size", "3"], 1, "--micro-batch-size 3 is odd"),
    ([], 1, "--tensor-model-parallel-size 1"),
    (["--tensor-model-parallel-size", "2", "--domino-chunks", "1"], 1, None),
])
def test_domino_is_on_by_default_where_it_can_work(argv, chunks, reason, caplog):
    with caplog.at_level(logging.INFO, logger="domino.config.flags"):
        config = parse_config(argv, world_size=2)
    assert config.parallel.domino_chunks == chunks
    notes = [r.getMessage() for r in caplog.records if "--domino-chunks not given" in r.getMessage()]
    assert (notes and reason in notes[0]) if reason else not notes


def test_kernel_flags_are_accepted_with_one_note_each(caplog):
    argv = ["--use-flash-attn", "--attention-backend", "flash", "--no-gradient-accumulation-fusion",
            "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
            "--no-async-tensor-model-parallel-allreduce", "--no-persist-layer-norm", "--use-distributed-optimizer",
            "--causal-lm"]
    with caplog.at_level(logging.INFO, logger="domino.config.flags"):
        config = parse_config(argv)
    notes = [r.getMessage() for r in caplog.records if "accepted for Megatron-LM compatibility" in r.getMessage()]
    assert len(notes) == len(argv) - 1  # --attention-backend flash is one flag with its value
    assert all("no effect" in note for note in notes)
    assert config.kernels.use_flash_attn and config.kernels.gradient_accumulation_fusion is False
    assert advisories(DominoConfig()) == []


def test_every_kernel_flag_is_documented():
    text = DOCS.read_text()
    for name, default in vars(KernelConfig()).items():
        flag = "--no-" + name.replace("_", "-") if default is True else flag_name(name)
        assert f"`{flag}`" in text, flag


@pytest.mark.parametrize("argv, message", [
    (["--group-query-attention", "--num-query-groups", "3"],
     "--num-attention-heads 4 is not divisible by --num-query-groups 3"),
    (["--group-query-attention", "--num-query-groups", "2", "--tensor-model-parallel-size", "4"],
     "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4"),
    (["--position-embedding-type", "rope", "--rotary-percent", "0.1"],
     "--rotary-percent 0.1 rotates 1 of the 16 dimensions of a head"),
    (["--normalization", "BatchNorm"], "--normalization must be LayerNorm or RMSNorm, got 'BatchNorm'"),
    (["--use-rope-scaling"], "--use-rope-scaling scales rotary embeddings: it needs --position-embedding-type rope"),
    (["--position-embedding-type", "rope", "--use-rope-scaling", "--rope-scaling-factor", "0.5"],
     "--rope-scaling-factor must be >= 1, got 0.5"),
    (["--swiglu", "--hidden-size", "16"], "--ffn-hidden-size must be >= 1, got 0 (the --swiglu default"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform"],
     "--recompute-granularity full needs --recompute-num-layers between 1 and --num-layers 2, got None"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "1"],
     "--recompute-granularity full needs --recompute-method uniform or block"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
      "--tensor-model-parallel-size", "2", "--zero-stage", "2"],
     "--recompute-granularity full with --domino-chunks 2 needs --zero-stage 0 or 1"),
    (["--recompute-activations", "--recompute-num-layers", "1"],
     "--recompute-num-layers: only with --recompute-granularity full"),
    (["--recompute-activations", "--recompute-granularity", "full", "--recompute-method", "block",
      "--recompute-num-layers", "1"], "--recompute-activations means --recompute-granularity selective"),
    (["--sequence-parallel", "--tensor-model-parallel-size", "4", "--num-attention-heads", "4", "--seq-length", "6"],
     "--sequence-parallel: --seq-length 6 is not divisible by --tensor-model-parallel-size 4"),
    (["--pipeline-model-parallel-size", "2", "--zero-stage", "2"],
     "--zero-stage 2 with --pipeline-model-parallel-size 2: not supported (ZeRO-2 reduces gradients inside"),
    (["--overlap-grad-reduce"], "--overlap-grad-reduce needs --pipeline-model-parallel-size > 1"),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "3"],
     "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"),
    (["--position-embedding-type", "alibi"], "--position-embedding-type must be learned_absolute or rope"),
    (["--attention-backend", "magic"], "--attention-backend must be one of flash, fused, unfused, local, auto"),
    (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    (["--train-iters", "5", "--lr-warmup-samples", "8"], "--lr-warmup-samples: only with --train-samples"),
])
def test_refusals_name_the_flag_and_feature(argv, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(argv)


def test_megatron_defaults():
    t, m, lg = DominoConfig().train, DominoConfig().model, DominoConfig().logging
    assert (t.adam_beta2, t.lr_decay_style, t.eval_iters, t.eval_interval, lg.log_interval) == (0.999, "linear", 100,
                                                                                                1000, 100)
    assert (t.initial_loss_scale, m.hidden_dropout, m.attention_dropout) == (2.0 ** 32, 0.1, 0.1)
    tiny = parse_config(["--preset", "tiny"])  # presets keep their own (fast) values
    assert (tiny.train.adam_beta2, tiny.train.lr_decay_style, tiny.logging.log_interval,
            tiny.train.eval_iters) == (0.95, "cosine", 5, 2)


def test_save_interval_without_save_is_a_warning_not_an_error(caplog):
    with caplog.at_level(logging.WARNING, logger="domino.config.flags"):
        parse_config(["--mock-data", "--train-iters", "1", "--save-interval", "5"])
    assert any("--save-interval 5 without --save" in r.getMessage() for r in caplog.records)


def test_device_checks():
    fp16, nccl = parse_config(["--fp16"]), parse_config(["--distributed-backend", "nccl"])
    with pytest.raises(ConfigError, match="--fp16 needs a CUDA GPU"):
        check_device(fp16, cuda=False)
    with pytest.raises(ConfigError, match="--distributed-backend nccl needs CUDA GPUs"):
        check_device(nccl, cuda=False)
    check_device(fp16, cuda=False, cpu_fp16=True)
    check_device(nccl, cuda=True)
    check_device(parse_config(["--bf16"]), cuda=False)  # DeepSpeed's CPU accelerator supports bf16


_FULL = ["--recompute-granularity", "full"]


@pytest.mark.parametrize("old, new", [
    (["--checkpoint-activations"], [*_FULL, "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
    (["--checkpoint-activations", "--checkpoint-num-layers", "2"],
     [*_FULL, "--recompute-method", "uniform", "--recompute-num-layers", "2"]),
    (["--activations-checkpoint-method", "block"], [*_FULL, "--recompute-method", "block", "--recompute-num-layers", "1"]),
    (["--activations-checkpoint-method", "uniform", "--activations-checkpoint-num-layers", "2"],
     [*_FULL, "--recompute-method", "uniform", "--recompute-num-layers", "2"]),
    (["--checkpoint-activations", "--activations-checkpoint-num-layers", "4"],
     [*_FULL, "--recompute-method", "uniform", "--recompute-num-layers", "4"]),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--checkpoint-num-layers", "3"],
     [*_FULL, "--recompute-method", "block", "--recompute-num-layers", "3"]),
    (["--checkpoint-num-layers", "2"], []),  # Megatron v2.0: no effect without --checkpoint-activations
    (["--model-parallel-size", "2"], ["--tensor-model-parallel-size", "2"]),
    (["--batch-size", "2"], ["--micro-batch-size", "2"]),
    (["--warmup", "0.05"], ["--lr-warmup-fraction", "0.05"]),
], ids=lambda argv: " ".join(argv))
def test_older_megatron_spellings_parse_as_the_modern_ones_with_one_note(old, new, caplog):
    with caplog.at_level(logging.WARNING, logger="domino.config.flags"):
        modern = parse_config([*new, "--num-layers", "4"], world_size=2)
    assert not [r for r in caplog.records if "older Megatron-LM spelling" in r.getMessage()]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="domino.config.flags"):
        legacy = parse_config([*old, "--num-layers", "4"], world_size=2)
    assert config_to_dict(legacy) == config_to_dict(modern)
    notes = [r.getMessage() for r in caplog.records if "older Megatron-LM spelling" in r.getMessage()]
    given = [arg for arg in old if arg in {flag.flag for flag in LEGACY_FLAGS}]
    assert sorted(note.split()[0] for note in notes) == sorted(given)  # one note per old flag, said once


@pytest.mark.parametrize("argv, message", [
    (["--checkpoint-activations", "--recompute-method", "block", "--recompute-granularity", "full",
      "--recompute-num-layers", "1"], "--checkpoint-activations means --recompute-method uniform; it contradicts "
                                      "--recompute-method block"),
    (["--checkpoint-activations", "--activations-checkpoint-method", "block"],
     "--checkpoint-activations means --activations-checkpoint-method uniform; it contradicts"),
    (["--model-parallel-size", "2", "--tensor-model-parallel-size", "1"],
     "--model-parallel-size means --tensor-model-parallel-size 2; it contradicts --tensor-model-parallel-size 1"),
    (["--activations-checkpoint-method", "all"], None),
])
def test_older_spellings_that_contradict_the_modern_ones_are_refused(argv, message):
    if message is None:  # Megatron's own choices: argparse's one-line error
        with pytest.raises(SystemExit):
            parse_config(argv)
        return
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(argv, world_size=2)


def test_every_older_spelling_is_documented():
    text = DOCS.read_text()
    assert all(f"`{flag.flag}" in text for flag in LEGACY_FLAGS)
