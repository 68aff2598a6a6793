"""Gradient norm and clipping at TP=2 x DP=2 equal the unsharded model's: tensor-parallel shards add up,
replicated parameters (LayerNorms, row-parallel biases) are counted once, and data-parallel replicas (which
hold the same, already reduced gradients) do not multiply the norm (domino.optim.clipping.clip_gradients)."""


import pytest
import torch

from distributed_helpers import run_distributed
from domino.config import ModelConfig
from domino.model import GPTModel
from domino.checkpoint.sharding import merge_tp_shards, shard_state_dict
from domino.runtime import state

MAX_NORM = 0.05  # well below the unclipped norm, so clipping really scales
VOCAB = 64  # divisible by TP=2


def tiny_config() -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8,
                       max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)


def random_batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"tokens": torch.randint(0, VOCAB, (4, 8), generator=g),
            "labels": torch.randint(0, VOCAB, (4, 8), generator=g), "weights": torch.rand(4, 8, generator=g)}


def _backward(model, batch):
    model.zero_grad(set_to_none=True)
    losses = model(batch["tokens"], labels=batch["labels"])
    (losses * batch["weights"]).sum().backward()


def _clip_body(rank, world_size, full_sd, batch, max_norm):
    import deepspeed

    from domino.optim.clipping import clip_gradients
    from domino.optim.deepspeed_runtime import _skip_shared_memory_op

    _skip_shared_memory_op()  # as pretrain's initialize_runtime: DeepSpeed's comm layer over our gloo group
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    mesh = state.initialize_model_parallel(2)
    model = GPTModel(tiny_config(), VOCAB, tp=mesh.tp)
    model.load_state_dict(shard_state_dict(full_sd, state.get_tensor_model_parallel_rank(), 2))
    _backward(model, batch)
    norm = clip_gradients(model.parameters(), mesh, max_norm)
    return norm, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_tp2_dp2_norm_and_clipped_gradients_equal_the_unsharded_computation():
    torch.manual_seed(11)
    reference = GPTModel(tiny_config(), VOCAB)
    batch = random_batch(seed=5)
    full_sd = {k: v.clone() for k, v in reference.state_dict().items()}
    _backward(reference, batch)
    expected_norm = torch.nn.utils.clip_grad_norm_(list(reference.parameters()), MAX_NORM).item()
    assert expected_norm > 4 * MAX_NORM
    expected = {n: p.grad for n, p in reference.named_parameters()}

    results = run_distributed(_clip_body, 4, full_sd, batch, MAX_NORM)  # ranks 0,1 and 2,3 are TP pairs
    for rank, (norm, _) in enumerate(results):
        assert float(norm) == pytest.approx(expected_norm, rel=1e-5), rank
    for pair in ((0, 1), (2, 3)):
        merged = merge_tp_shards([results[r][1] for r in pair])
        for name, grad in expected.items():
            torch.testing.assert_close(merged[name], grad, rtol=1e-4, atol=1e-7, msg=name)
