"""``--param`` parsing and checks, and cron validation."""

import pytest

from pipelines.cron import CronError, validate_cron
from pipelines.params import ParamError, check_training_config, markdown_table, parse_param_args, pipeline_parameters


def test_values_get_the_parameter_types():
    values = parse_param_args(["train_iters=5", "lr=0.01", "warm_start=yes", "corpus=kjv", "keep-failed-jobs=0",
                               "tolerations=[\"a:NoSchedule\"]"])
    assert values == {"train_iters": 5, "lr": 0.01, "warm_start": True, "corpus": "kjv", "keep_failed_jobs": False,
                      "tolerations": "[\"a:NoSchedule\"]"}


@pytest.mark.parametrize("item, message", [
    ("train_iters", "--param 'train_iters': expected NAME=VALUE"),
    ("train_iters=2.5", "--param train_iters=2.5: expected integer"),
    ("lr=fast", "--param lr=fast: expected float"),
    ("bogus=1", "--param bogus: the pipeline has no such parameter; known: shared_root"),
    ("backend=slurm", "--param backend=slurm: expected one of cluster, local"),
    ("job_api=mpijob", "--param job_api=mpijob: expected one of pytorchjob, trainjob"),
    ("config_overrides={bad", "--param config_overrides: not JSON"),
    ("node_selector=[]", "--param node_selector: expected a JSON object"),
    ("nodes=0", "--param nodes=0: must be at least 1"),
    ("min_improvement=1.5", "--param min_improvement=1.5: must be in [0, 1)"),
])
def test_bad_params_name_the_parameter(item, message):
    with pytest.raises(ParamError) as error:
        parse_param_args([item])
    assert message in str(error.value)


def test_training_config_is_checked_as_the_pretrain_step_will():
    check_training_config({})  # the defaults are a valid tiny TP=2 run
    with pytest.raises(ParamError, match="--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 8"):
        check_training_config({"tensor_model_parallel_size": 8, "nproc_per_node": 8})
    with pytest.raises(ParamError, match="'data_path' is set by the run's layout"):
        check_training_config({"config_overrides": '{"data_path": ["x"]}'})
    with pytest.raises(ParamError, match="--zero-stage"):
        check_training_config({"zero_stage": 3})
    check_training_config({"zero_stage": -1, "micro_batch_size": -1})  # not given: the preset's, domino's choice


def test_parameter_table_covers_the_documented_names():
    names = set(pipeline_parameters())
    assert {"corpus", "preset", "tensor_model_parallel_size", "domino_chunks", "zero_stage", "gpus_per_node", "warm_start",
            "pvc_name", "node_selector", "tolerations", "min_improvement"} <= names


@pytest.mark.parametrize("cron", ["0 0 3 * * 0", "0 */15 * * * *", "30 0 2 ? * MON-FRI", "0 0 0 1 JAN,JUL ?",
                                  "0  0 3 * *  SUN", "@weekly", "@every 6h"])
def test_valid_crons(cron):
    assert validate_cron(cron) == " ".join(cron.split())


@pytest.mark.parametrize("cron, message", [
    ("", "has 0 fields"),
    ("60 0 3 * * 0", "second value '60' is outside 0-59"),
    ("0 0 3 32 * 0", "day of month value '32' is outside 1-31"),
    ("0 0 5-3 * * 0", "hour range '5-3' runs backwards"),
    ("0 ? 3 * * 0", "'?' is only allowed in the day fields"),
    ("0 0 3 * * 0/0", "step must be at least 1"),
    ("0 0 3 * * %", "day of week field '%' is not a cron field"),
])
def test_invalid_crons(cron, message):
    with pytest.raises(CronError) as error:
        validate_cron(cron)
    assert message in str(error.value)


def test_docs_parameter_table_lists_exactly_the_pipeline_parameters():
    import os
    import re

    doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "pipeline.md"), encoding="utf-8").read()
    table = markdown_table()
    assert table in doc, "docs/pipeline.md's table is stale: paste `domino pipeline params --markdown` over it"
    documented = re.findall(r"^\| `(\w+)` \|", doc, flags=re.M)
    assert documented == list(pipeline_parameters())  # one table, every parameter once


def test_the_domino_command_does_not_import_kfp_until_a_pipeline_command_runs():
    import subprocess
    import sys

    code = ("import sys; from domino.cli.main import build_parser; build_parser(); "
            "assert not [m for m in sys.modules if m == 'kfp' or m.startswith(('kfp.', 'pipelines', 'components'))]")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_kfp_token_comes_from_a_file_or_the_environment_and_never_over_plain_http(tmp_path, monkeypatch):
    from pipelines.kfp_client import token_from

    monkeypatch.delenv("KFP_TOKEN", raising=False)
    assert token_from("http://kfp.example.com") is None  # no token: nothing to protect
    path = tmp_path / "token"
    path.write_text("secret\n")
    assert token_from("https://kfp.example.com", str(path)) == "secret"
    assert token_from("http://localhost:8080", str(path)) == "secret"
    assert token_from("http://127.0.0.1:8080", str(path)) == "secret"
    with pytest.raises(ValueError, match="refusing to send the API token over plain http"):
        token_from("http://kfp.example.com:80", str(path))
    monkeypatch.setenv("KFP_TOKEN", "from-env")
    assert token_from("https://kfp.example.com") == "from-env"
    with pytest.raises(ValueError, match="plain http"):
        token_from("kfp.example.com:8888")
    with pytest.raises(ValueError, match="--token-file .*: cannot read it"):
        token_from("https://kfp.example.com", str(tmp_path / "missing"))


def test_the_demo_sets_every_training_setting_it_depends_on():
    """`make demo`'s result must not move when a global default changes: its model, optimizer and schedule
    come from the demo preset, its loop settings from explicit pipeline parameters."""
    from domino.config.preset_store import load
    from pipelines.local_run import DEMO_PARAMS, QUICK_PARAMS

    preset = load(DEMO_PARAMS["preset"])
    for field in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "max_position_embeddings",
                  "hidden_dropout", "attention_dropout", "init_method_std", "lr", "min_lr", "lr_decay_style",
                  "lr_warmup_iters", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad",
                  "initial_loss_scale", "seed"):
        assert field in preset, field
    for name in ("train_iters", "micro_batch_size", "global_batch_size", "split", "eval_interval", "eval_iters",
                 "log_interval", "tensor_model_parallel_size", "domino_chunks", "tokenizer_vocab_size"):
        assert name in DEMO_PARAMS, name
    check_training_config(DEMO_PARAMS)
    check_training_config(QUICK_PARAMS)
    parse_param_args([f"{name}={value}" for name, value in DEMO_PARAMS.items()])  # every name is a parameter


def test_tokenizer_vocab_size_below_the_byte_alphabet_is_rejected():
    with pytest.raises(ParamError, match="tokenizer_vocab_size=100: must be 0 .* or at least 257"):
        parse_param_args(["tokenizer_vocab_size=100"])
