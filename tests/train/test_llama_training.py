"""A tiny LLaMA (rope, SwiGLU, RMSNorm, no biases, GQA, untied output) trains at TP=2 with Domino exactly as at TP=1."""

import pytest
import torch

from domino.checkpoint import model_shards, on_disk
from train_helpers import run_pretrain, train_losses

# As test_parallel_equivalence.py: an Adam epsilon far above rounding noise keeps the comparison about the math.
COMMON = ["--preset", "tiny-llama", "--log-interval", "1", "--num-workers", "0", "--seed", "7", "--train-iters", "3",
          "--eval-iters", "0", "--eval-interval", "0", "--micro-batch-size", "4", "--global-batch-size", "4",
          "--lr-warmup-iters", "0", "--adam-eps", "1e-4", "--make-vocab-size-divisible-by", "64"]


def _run(tmp_path, corpus_prefix, name, nproc, layout):
    metrics, save = tmp_path / f"{name}.jsonl", tmp_path / name
    run_pretrain([*COMMON, "--data-path", corpus_prefix, "--save", str(save), "--metrics-file", str(metrics),
                  *layout], nproc=nproc)
    return train_losses(metrics), model_shards.load_full_state_dict(on_disk.resolve_checkpoint_dir(save))


def test_tiny_llama_tp2_domino_trains_like_tp1(tmp_path, corpus_prefix):
    ref_losses, ref_params = _run(tmp_path, corpus_prefix, "tp1", 1, [])
    losses, params = _run(tmp_path, corpus_prefix, "tp2", 2, ["--tensor-model-parallel-size", "2",
                                                              "--domino-chunks", "2"])
    assert sorted(ref_losses) == [1, 2, 3] and ref_losses[3] < ref_losses[1]  # it learns
    for iteration, loss in ref_losses.items():
        assert abs(losses[iteration] - loss) <= 1e-5 * loss, (iteration, losses[iteration], loss)
    assert params.keys() == ref_params.keys() and "output_layer.weight" in params
    assert not any(name.endswith("bias") for name in params)
    for name, tensor in ref_params.items():
        error = (params[name] - tensor).abs().max().item()
        assert error <= 1e-5 * tensor.abs().max().item(), (name, error)
    assert not torch.equal(params["output_layer.weight"], params["embedding.word_embeddings.weight"])


def test_a_preset_vocabulary_smaller_than_the_tokenizer_is_refused(corpus_prefix):
    proc = run_pretrain(["--preset", "llama2-7b", "--num-layers", "1", "--hidden-size", "64", "--num-attention-heads",
                         "4", "--ffn-hidden-size", "64", "--tensor-model-parallel-size", "1", "--train-iters", "1",
                         "--num-workers", "0", "--data-path", corpus_prefix], check=False, timeout=120)
    assert proc.returncode == 2
    assert "--vocab-size 32000 is smaller than tokenizer gpt2's 50257 ids" in proc.stderr


def test_loading_a_gpt_checkpoint_into_a_llama_run_names_the_differences(tmp_path):
    from domino.config import ConfigError, config_to_dict, parse_config
    from domino.checkpoint.resume import check_compatible

    gpt = parse_config(["--preset", "tiny"])
    llama = parse_config(["--preset", "tiny", "--position-embedding-type", "rope", "--swiglu",
                          "--ffn-hidden-size", "256", "--group-query-attention", "--num-query-groups", "2"])
    meta = {"config": config_to_dict(gpt), "padded_vocab_size": 128}
    check_compatible(meta, gpt, tmp_path)
    with pytest.raises(ConfigError) as error:
        check_compatible(meta, llama, tmp_path)
    message = str(error.value)
    assert "rope: checkpoint False vs run True" in message and "swiglu: checkpoint False vs run True" in message
    assert "query_groups: checkpoint 4 vs run 2" in message and "ffn_size" not in message


def test_a_rope_checkpoint_loads_with_more_positions_a_learned_table_does_not(tmp_path):
    """Rotary positions have no parameters, so a longer context is a legal load; a learned table's size is not."""
    from domino.config import ConfigError, config_to_dict, parse_config
    from domino.checkpoint.resume import check_compatible

    rope = ["--preset", "tiny", "--position-embedding-type", "rope"]
    short = parse_config([*rope, "--seq-length", "32", "--max-position-embeddings", "32"])
    check_compatible({"config": config_to_dict(short), "padded_vocab_size": 128},
                     parse_config([*rope, "--seq-length", "64", "--max-position-embeddings", "64"]), tmp_path)
    learned = parse_config(["--preset", "tiny", "--seq-length", "32", "--max-position-embeddings", "32"])
    with pytest.raises(ConfigError, match="num_positions: checkpoint 32 vs run 64"):
        check_compatible({"config": config_to_dict(learned), "padded_vocab_size": 128},
                         parse_config(["--preset", "tiny", "--seq-length", "64", "--max-position-embeddings", "64"]),
                         tmp_path)
