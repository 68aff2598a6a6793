"""Published Megatron-LM and DeepSpeed-Domino launch scripts run through `domino pretrain` (fixture:
``megatron_scripts.py``, each script's repository, path and commit noted there).

A user changes only paths, the launcher line and (on CPU) ``--fp16`` (dropped, or read as ``--bf16`` for the two
scripts with pipeline stages); the tests also append
:data:`SIZE_OVERRIDES` so a run takes seconds. Features not built yet fail at parse time with one line naming the
feature.
"""

import math
import os
import re
import subprocess
import sys

import pytest

from domino.config import ConfigError, add_config_flags, config_from_args
from domino.config.flags import ArgumentParser
from domino.config.schema import DataConfig
from distributed_helpers import free_port
from megatron_scripts import SCRIPTS, SIZE_OVERRIDES, fp16_as_bf16, without_fp16, write_megatron_gpt2_files
from train_helpers import child_env, pretrain_command, read_metrics, run_pretrain, train_losses


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    return write_megatron_gpt2_files(str(tmp_path_factory.mktemp("megatron-gpt2")))


def _variables(tmp_path, corpus_prefix, gpt2_files):
    return {"DATA_PATH": corpus_prefix, "CHECKPOINT_PATH": str(tmp_path / "checkpoints"), "WORLD_SIZE": "2",
            "TENSORBOARD_LOGS_PATH": str(tmp_path / "tb"), **gpt2_files}


def _parse(argv, world_size):
    parser = ArgumentParser(prog="domino pretrain")
    add_config_flags(parser)
    return config_from_args(parser.parse_args(argv), world_size=world_size, for_training=True)


#: What each script asks for that domino refuses, and the words of the refusal.
REFUSED = {
    "megatron-gpt3-175b": "--step-batch-size-schedule and --global-batch-size are mutually exclusive",
    "megatron-gpt3-175b-157006d": "--rampup-batch-size needs --train-samples, not --train-iters",
}


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_every_script_parses_as_written_or_names_the_missing_feature(name, tmp_path, gpt2_files):
    """The scripts' own sizes, at their own world size (TP x PP x DP), before any process starts."""
    argv = without_fp16(SCRIPTS[name].argv(_variables(tmp_path, "corpus_text_document", gpt2_files)))
    world_size = {"megatron-gpt3-175b": 128, "megatron-gpt3-175b-157006d": 128,
                  "megatron-pretrain-gpt-distributed-with-mp": 4}.get(name, 2)
    if name in REFUSED:
        with pytest.raises(ConfigError) as error:
            _parse(argv, world_size)
        assert REFUSED[name] in str(error.value) and "\n" not in str(error.value)
        return
    config = _parse(argv, world_size)
    assert config.data.vocab_file == gpt2_files["VOCAB_FILE"] and config.data.merge_file == gpt2_files["MERGE_FILE"]
    assert config.train.lr_decay_style == "cosine" and config.train.lr_warmup_fraction is not None
    assert config.train.adam_beta2 == (0.95 if name.startswith("megatron-gpt3-175b") else 0.999)  # Megatron's default
    tp = config.parallel.tensor_model_parallel_size
    assert config.parallel.domino_chunks == (2 if tp > 1 else 1)  # as DeepSpeed-Domino, without naming it


def _swap(argv, flag, new_flag=None, value=None):
    """``argv`` with ``flag VALUE`` replaced by ``new_flag value`` (or dropped)."""
    i = argv.index(flag)
    return argv[:i] + ([new_flag, value] if new_flag else []) + argv[i + 2:]


def _as_samples(argv):
    """--train-iters 500000 and --lr-decay-iters 430000 as the samples of 1536-sample batches."""
    argv = _swap(argv, "--train-iters", "--train-samples", str(500000 * 1536))
    return _swap(argv, "--lr-decay-iters", "--lr-decay-samples", str(430000 * 1536))


@pytest.mark.parametrize("name, refusal, fix", [
    # Megatron 157006d6, arguments.py validate_args: "expected no batch-size rampup for iteration-based training".
    ("megatron-gpt3-175b-157006d", "--rampup-batch-size needs --train-samples, not --train-iters", _as_samples),
    # Megatron d98e8a64, arguments.py validate_args: "Cannot specify both --step-batch-size-schedule and
    # --global-batch-size"; its --train-iters domino refuses too (the learning rate counts samples).
    ("megatron-gpt3-175b", "--step-batch-size-schedule and --global-batch-size are mutually exclusive",
     lambda argv: _as_samples(_swap(argv, "--global-batch-size"))),
])
def test_the_175b_scripts_batch_flags_meet_megatrons_own_refusals(name, refusal, fix, tmp_path, gpt2_files):
    """Past pipeline parallelism, both 175B examples stop where Megatron's validate_args stops them; with the
    change Megatron needs they ramp 16 -> 1536 as Megatron's calculators do (tests/config/test_batch_schedule.py)."""
    from domino.config.batch_schedule import batch_schedule

    argv = without_fp16(SCRIPTS[name].argv(_variables(tmp_path, "corpus_text_document", gpt2_files)))
    argv += ["--pipeline-model-parallel-size", "1"]
    with pytest.raises(ConfigError, match=re.escape(refusal)) as error:
        _parse(argv, world_size=8)
    assert "\n" not in str(error.value)
    schedule = batch_schedule(_parse(fix(argv), world_size=8), data_parallel_size=1)
    assert schedule.global_batch_size_at(0) == 16 and schedule.global_batch_size == 1536
    # 2B tokens in: 15 of the ramp's 95 step-ups (one per 61677.6 samples) done; the schedule steps at 2.4B.
    assert schedule.global_batch_size_at(2 * 10**9 // 2048) == (256 if name.endswith("157006d") else 16)


def test_size_overrides_win(tmp_path, gpt2_files):
    argv = without_fp16(SCRIPTS["megatron-pretrain-gpt"].argv(_variables(tmp_path, "c", gpt2_files)))
    config = _parse(argv + SIZE_OVERRIDES, world_size=2)
    assert (config.model.num_layers, config.model.hidden_size, config.train.train_iters) == (2, 64, 3)
    assert config.data.data_impl == "mmap" and config.parallel.tensor_model_parallel_size == 2


def _check_run(metrics_file, log):
    losses = train_losses(metrics_file)
    assert sorted(losses) == [1, 2, 3]
    records = {r["iteration"]: r for r in read_metrics(metrics_file) if "eval" not in r}
    # Megatron's warm-up: the first step runs at --lr-warmup-init (0), the second at lr x samples / warm-up samples.
    assert records[1]["lr"] == 0.0 and records[2]["lr"] > 0.0
    assert any(r.get("eval") == "valid" for r in read_metrics(metrics_file))
    assert "--domino-chunks not given: 2" in log and "Domino chunks 2" in log


def test_megatron_pretrain_gpt_runs_under_torchrun(tmp_path, corpus_prefix, gpt2_files):
    script = SCRIPTS["megatron-pretrain-gpt"]
    metrics = tmp_path / "metrics.jsonl"
    argv = without_fp16(script.argv(_variables(tmp_path, corpus_prefix, gpt2_files)))
    proc = run_pretrain([*argv, *SIZE_OVERRIDES, "--metrics-file", str(metrics)], nproc=2, timeout=600,
                        torchrun=True)  # the one script run under torchrun itself; the others fork its environment
    _check_run(metrics, proc.stderr)
    assert (tmp_path / "checkpoints" / "latest").is_file()  # its --save, written at the end


def test_megatron_distributed_with_mp_runs_its_two_pipeline_stages_and_sequence_parallelism(
        tmp_path, corpus_prefix, gpt2_files):
    """Its TP 2 x PP 2 on 4 CPU processes, in bf16 for its --fp16 (mixed-precision stages): the one flag
    appended is the backend (gloo for its nccl); its --sequence-parallel runs inside each stage (TP 2, Domino 2
    chunks), as do its evaluation and its --save."""
    script = SCRIPTS["megatron-pretrain-gpt-distributed-with-mp"]
    metrics = tmp_path / "metrics.jsonl"
    argv = fp16_as_bf16(script.argv(_variables(tmp_path, corpus_prefix, gpt2_files)))
    assert "--bf16" in argv
    proc = run_pretrain([*argv, *SIZE_OVERRIDES, "--distributed-backend", "gloo", "--metrics-file", str(metrics)],
                        nproc=4, timeout=600)
    _check_run(metrics, proc.stderr)
    assert "--zero-stage not given: 0 (one data-parallel replica" in proc.stderr
    assert (tmp_path / "checkpoints" / "latest").is_file()  # its --save, written by the two stages


#: SIZE_OVERRIDES for a script with a batch-size ramp: the script's --global-batch-size stays (the ramp's increments
#: are counted up to it), PP 2, and the test adds --train-samples: at 157006d6, 32 are 3 iterations of the ramp's
#: first batch, 16 (8 micro-batches of 2): Megatron's update_train_iters (157006d6 megatron/training/training.py,
#: transcribed in tests/config/test_batch_schedule.py) counts ramp iterations while the consumed samples are
#: <= --train-samples, so the third starts at 32 and the run consumes 48.
RAMP_SIZE_OVERRIDES = _swap(_swap(SIZE_OVERRIDES, "--global-batch-size"), "--train-iters") + [
    "--pipeline-model-parallel-size", "2"]


@pytest.mark.parametrize("name, fix, samples", [
    # 157006d6: --rampup-batch-size; 32 samples are 3 iterations (Megatron's update_train_iters, above).
    ("megatron-gpt3-175b-157006d", _as_samples, "32"),
    # d98e8a64: --step-batch-size-schedule "0:16 ..." without --global-batch-size (Megatron's own rule); the
    # schedule's iterations run while the consumed samples are below --train-samples: 48 are 3 iterations.
    ("megatron-gpt3-175b", lambda argv: _as_samples(_swap(argv, "--global-batch-size")), "48"),
])
def test_megatron_175b_script_trains_its_ramp_at_tp2_pp2(name, fix, samples, tmp_path, corpus_prefix, gpt2_files):
    """Megatron's GPT-3 175B example at both commits with the one change Megatron itself needs (its
    --train-iters and --lr-decay-iters as samples; at d98e8a64 also no --global-batch-size), shrunk by appended
    size flags to TP 2 x PP 2 on 4 CPU processes: its batch ramp runs, every iteration at the ramp's first batch
    (16, not the script's 1536: the first step-up comes after 61677.6 samples, or 2.4B tokens), 8 micro-batches per
    stage and step, Domino 2 chunks, in bf16 for its --fp16 (mixed-precision stages)."""
    metrics = tmp_path / "metrics.jsonl"
    argv = fix(fp16_as_bf16(SCRIPTS[name].argv(_variables(tmp_path, corpus_prefix, gpt2_files))))
    assert "--bf16" in argv
    proc = run_pretrain([*argv, *RAMP_SIZE_OVERRIDES, "--train-samples", samples, "--metrics-file", str(metrics)],
                        nproc=4, timeout=600)
    _check_run(metrics, proc.stderr)
    assert "global batch 16 (micro 2 x DP 1 x accumulation 8), TP 2" in proc.stderr  # 4 ranks: TP 2 x PP 2
    assert "--zero-stage not given: 0 (one data-parallel replica" in proc.stderr
    records = [r for r in read_metrics(metrics) if "eval" not in r]
    assert [(r["consumed_samples"], r["batch_size"]) for r in records] == [(16, 16), (32, 16), (48, 16)]
    assert all(math.isfinite(r["lm_loss"]) for r in records)
    assert (tmp_path / "checkpoints" / "latest").is_file()  # its --save, written by the two stages


def test_megatron_2021_script_runs_with_its_checkpoint_activations(tmp_path, corpus_prefix, gpt2_files):
    """Megatron v2.0's `python pretrain_gpt.py ...` (one process): --checkpoint-activations is read as a full,
    uniform recompute of one layer at a time, said once in the log; gloo stands in for its nccl on CPU."""
    script = SCRIPTS["megatron-pretrain-gpt-2021"]
    metrics = tmp_path / "metrics.jsonl"
    argv = without_fp16(script.argv(_variables(tmp_path, corpus_prefix, gpt2_files)))
    proc = run_pretrain([*argv, *SIZE_OVERRIDES, "--tensor-model-parallel-size", "1", "--distributed-backend", "gloo",
                         "--metrics-file", str(metrics)], nproc=1, timeout=600)
    assert sorted(train_losses(metrics)) == [1, 2, 3]
    notes = [line for line in proc.stderr.splitlines() if "--checkpoint-activations is an older" in line]
    assert len(notes) == 1 and "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1" \
        in notes[0]
    assert (tmp_path / "checkpoints" / "latest").is_file()


def test_ds_domino_gpt3_script_runs_under_the_deepspeed_launcher(tmp_path, corpus_prefix, gpt2_files):
    """`deepspeed --num_gpus 2 --module domino pretrain ...` (the launcher passes --local_rank=N before `pretrain`)."""
    script = SCRIPTS["ds-domino-gpt3-2.7b"]
    metrics = tmp_path / "metrics.jsonl"
    argv = without_fp16(script.argv(_variables(tmp_path, corpus_prefix, gpt2_files)))
    bindir = os.path.dirname(sys.executable)
    command = [os.path.join(bindir, "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
               "--module", "domino", "pretrain", *argv, *SIZE_OVERRIDES, "--metrics-file", str(metrics)]
    env = child_env({"PATH": bindir + os.pathsep + os.environ.get("PATH", "")})
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "--local_rank=1" in proc.stdout + proc.stderr
    _check_run(metrics, proc.stdout + proc.stderr)


def test_ds_domino_gpt3_6_7b_script_runs(tmp_path, corpus_prefix, gpt2_files):
    """The 2.7B script's flags plus --no-gradient-accumulation-fusion (no effect here), on 2 processes."""
    script = SCRIPTS["ds-domino-gpt3-6.7b"]
    metrics = tmp_path / "metrics.jsonl"
    argv = without_fp16(script.argv(_variables(tmp_path, corpus_prefix, gpt2_files)))
    proc = run_pretrain([*argv, *SIZE_OVERRIDES, "--metrics-file", str(metrics)], nproc=2, timeout=600)
    _check_run(metrics, proc.stderr)


@pytest.mark.parametrize("name", ["ds-domino-llama-7b", "ds-domino-llama-13b"])
def test_ds_domino_llama_scripts_run(name, tmp_path, corpus_prefix, gpt2_files):
    """DeepSpeed-Domino's LLaMA flags (rope, SwiGLU with its --ffn-hidden-size 11008, RMSNorm with
    --layernorm-epsilon 1e-6; 13B also --llama-model and --disable-bias-linear) train at TP 2 with Domino."""
    script = SCRIPTS[name]
    metrics = tmp_path / "metrics.jsonl"
    argv = without_fp16(script.argv(_variables(tmp_path, corpus_prefix, gpt2_files)))
    proc = run_pretrain([*argv, *SIZE_OVERRIDES, "--metrics-file", str(metrics)], nproc=2, timeout=600)
    _check_run(metrics, proc.stderr)


def test_refused_script_fails_on_every_rank_with_one_line(tmp_path, corpus_prefix, gpt2_files):
    script = SCRIPTS["megatron-pretrain-gpt-distributed-with-mp"]
    argv = without_fp16(script.argv(_variables(tmp_path, corpus_prefix, gpt2_files))) + SIZE_OVERRIDES
    proc = subprocess.run(pretrain_command(argv, nproc=2), env=child_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("domino pretrain: error:")]
    assert len(lines) == 2 and all("world size 2 is not divisible by --tensor-model-parallel-size 2 x "
                                   "--pipeline-model-parallel-size 2" in line for line in lines)  # one per rank
    assert not re.search(r'File ".*/domino/', proc.stderr)  # no traceback through domino's code
    assert "torch.distributed initialised" not in proc.stderr  # refused before any work


def test_megatron_gpt2_vocab_and_merges_give_the_ids_of_tokenizer_gpt2(gpt2_files):
    """Megatron's gpt2-vocab.json/gpt2-merges.txt, read via --vocab-file/--merge-file, tokenize exactly as
    --tokenizer gpt2 and as transformers' GPT2Tokenizer (the same OpenAI algorithm Megatron's gpt2_tokenization.py
    ports) reading the same two files."""
    from transformers import GPT2Tokenizer

    from domino.data.builtin_corpora import builtin_documents
    from domino.data.tokenizer import build_tokenizer, tokenizer_for_run

    files = tokenizer_for_run(DataConfig(vocab_file=gpt2_files["VOCAB_FILE"], merge_file=gpt2_files["MERGE_FILE"]))
    named = build_tokenizer("gpt2")
    reference = GPT2Tokenizer(gpt2_files["VOCAB_FILE"], gpt2_files["MERGE_FILE"])
    texts = [doc.texts[0] for _, doc in zip(range(8), builtin_documents("shakespeare-small"))]
    texts += ["Don't  stop:\tx = f(3.14e-2) // naïve café 東京 🙂\n\n  end", "    leading spaces and trailing   ",
              "numbers 1234567890 and CAPS WORDS'S we'll they've"]
    for text in texts:
        ids = files.encode(text)
        assert ids == named.encode(text) == reference.encode(text)
    assert files.vocab_size == named.vocab_size == 50257 and files.eod == named.eod == 50256
    assert files.decode(files.encode(texts[-3])) == texts[-3]


@pytest.mark.parametrize("argv, message", [
    (["--tokenizer-type", "GPT2BPETokenizer"], "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file"),
    (["--tokenizer-type", "SentencePieceTokenizer"], "--tokenizer-type SentencePieceTokenizer is not supported"),
    (["--tokenizer-type", "NullTokenizer"], "--tokenizer-type NullTokenizer needs --vocab-size"),
    (["--vocab-file", "v.json"], "--vocab-file and --merge-file go together"),
    (["--data-impl", "lazy"], "--data-impl lazy: only mmap"),
], ids=["gpt2bpe-without-files", "sentencepiece", "null-without-vocab", "vocab-without-merges", "data-impl-lazy"])
def test_megatron_data_flags_fail_clearly(argv, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _parse(["--mock-data", "--train-iters", "1", *argv], world_size=1)


def test_tokenizer_types(tmp_path, gpt2_files):
    from domino.data.errors import DataError
    from domino.data.tokenizer import build_tokenizer, tokenizer_for_run
    from domino.runtime.mesh import ParallelMesh
    from domino.train.gpt_recipe import GPTRecipe

    gpt2 = build_tokenizer("gpt2")
    gpt2.save(str(tmp_path / "hf"))
    hf = tokenizer_for_run(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "hf")))
    assert hf.encode("Hello, Megatron!") == gpt2.encode("Hello, Megatron!")
    with pytest.raises(DataError, match="--tokenizer-model 'gpt2-large': not a local tokenizer.json"):
        tokenizer_for_run(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="gpt2-large"))
    with pytest.raises(DataError, match="--merge-file /nonexistent: file not found"):
        tokenizer_for_run(DataConfig(vocab_file=gpt2_files["VOCAB_FILE"], merge_file="/nonexistent"))
    # NullTokenizer, as Megatron's _NullTokenizer: ids below --vocab-size, end-of-document = --vocab-size.
    null = GPTRecipe(_parse(["--mock-data", "--train-iters", "1", "--tokenizer-type", "NullTokenizer",
                             "--vocab-size", "1000"], world_size=1), ParallelMesh.single())
    assert null.tokenizer is None and null.eod == 1000 and null.padded_vocab_size == 1024


def test_every_flag_of_the_scripts_is_in_the_megatron_guide():
    from pathlib import Path

    guide = (Path(__file__).resolve().parents[2] / "docs" / "megatron.md").read_text()
    flags = {token for script in SCRIPTS.values() for token in script.flags.split() if token.startswith("--")}
    assert flags and not [flag for flag in sorted(flags) if flag not in guide]


def test_megatron_pretrain_gpt_runs_with_context_parallel_size_2(tmp_path, corpus_prefix, gpt2_files):
    """The 2023 example with Megatron's ``--context-parallel-size 2`` (``_add_distributed_args``,
    megatron/training/arguments.py; the Llama 3 examples set it through their CP_SIZE) on 2 gloo processes:
    each rank trains on two of the sequence's four chunks, TP 1 x CP 2 x DP 1, and the run trains, evaluates and
    saves as at CP 1. Megatron's other ``--cp-comm-type`` values are refused in one line naming the flag."""
    script = SCRIPTS["megatron-pretrain-gpt"]
    metrics = tmp_path / "metrics.jsonl"
    argv = [*without_fp16(script.argv(_variables(tmp_path, corpus_prefix, gpt2_files))), *SIZE_OVERRIDES,
            "--tensor-model-parallel-size", "1", "--context-parallel-size", "2"]
    for comm in ("allgather", "a2a+p2p"):
        with pytest.raises(ConfigError, match=rf"^--cp-comm-type {re.escape(comm)}: must be one of p2p, a2a$"):
            _parse([*argv, "--cp-comm-type", comm], world_size=2)
    proc = run_pretrain([*argv, "--metrics-file", str(metrics)], nproc=2, timeout=600)
    assert "global batch 4 (micro 2 x DP 1 x accumulation 2), TP 1, CP 2," in proc.stderr, proc.stderr[-3000:]
    losses = train_losses(metrics)
    assert sorted(losses) == [1, 2, 3] and all(math.isfinite(v) for v in losses.values())
    assert any(r.get("eval") == "valid" for r in read_metrics(metrics))
    assert (tmp_path / "checkpoints" / "latest").is_file()
