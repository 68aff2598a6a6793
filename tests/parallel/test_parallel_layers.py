"""TP layers: parameter attributes, agreement with dense layers on 2 ranks, TP-invariant initialisation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distributed_helpers import run_distributed
from domino.model import GPTModel
from domino.checkpoint.sharding import partition_dim, shard_state_dict
from domino.runtime import state
from domino.runtime.mesh import MeshGroup
from domino.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

from domino.config import ModelConfig

VOCAB = 64


def tiny_config() -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8,
                       hidden_dropout=0.0, attention_dropout=0.0)


def test_sharded_and_replicated_attributes():
    col, row, emb = ColumnParallelLinear(4, 6), RowParallelLinear(6, 4), VocabParallelEmbedding(8, 4)
    for p, dim in ((col.weight, 0), (col.bias, 0), (row.weight, 1), (emb.weight, 0)):
        assert p.tensor_model_parallel is True and p.partition_dim == dim and p.partition_stride == 1
    assert not hasattr(row.bias, "tensor_model_parallel")  # replicated: counted once by the grad norm
    model = GPTModel(tiny_config(), VOCAB)
    for name, p in model.named_parameters():
        sharded = getattr(p, "tensor_model_parallel", False)
        assert sharded == (partition_dim(name) is not None), name
        if sharded:
            assert p.partition_dim == partition_dim(name), name


def test_indivisible_sizes_are_rejected_with_a_clear_message():
    import domino.model.transformer as transformer

    three = MeshGroup.shapes_only(3)  # rank 0 of a TP group of 3: sizes only, no process group
    with pytest.raises(ValueError, match="--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"):
        transformer.ParallelSelfAttention(tiny_config(), 0, three)
    with pytest.raises(ValueError, match="output size of a column-parallel linear"):
        ColumnParallelLinear(4, 8, tp=three)


def _body(rank, world_size, x, tokens, dense):
    tp = state.initialize_model_parallel(2).tp
    out = {}
    torch.manual_seed(11)
    col = ColumnParallelLinear(4, 6, gather_output=True, tp=tp)
    row = RowParallelLinear(6, 4, input_is_parallel=False, tp=tp)
    emb = VocabParallelEmbedding(8, 4, tp=tp)
    out["init"] = {"col": col.weight.detach().clone(), "row": row.weight.detach().clone(),
                   "emb": emb.weight.detach().clone()}
    with torch.no_grad():
        col.weight.copy_(dense["col_w"].chunk(2, 0)[rank]); col.bias.copy_(dense["col_b"].chunk(2)[rank])
        row.weight.copy_(dense["row_w"].chunk(2, 1)[rank]); row.bias.copy_(dense["row_b"])
        emb.weight.copy_(dense["emb"].chunk(2, 0)[rank])
    xi = x.clone().requires_grad_(True)
    y = row(col(xi))
    y.sum().backward()
    out["y"], out["x_grad"] = y.detach(), xi.grad
    out["emb"] = emb(tokens)
    # Row-parallel fc2 of the MLP: GeLU fused, the bias handed back to be added after the all-reduce.
    fc2 = RowParallelLinear(6, 4, skip_bias_add=True, tp=tp)
    with torch.no_grad():
        fc2.weight.copy_(dense["row_w"].chunk(2, 1)[rank]); fc2.bias.copy_(dense["row_b"])
    pre = x.repeat(1, 2)[:, :6].chunk(2, 1)[rank].clone().requires_grad_(True)
    y_mlp, bias = fc2.forward_gelu(pre)
    y_mlp.sum().backward()
    out["mlp"], out["mlp_bias_returned"], out["mlp_pre_grad"] = y_mlp.detach(), bias is fc2.bias, pre.grad
    torch.manual_seed(5)
    out["gpt"] = GPTModel(tiny_config(), VOCAB, tp=tp).state_dict()
    return out


def test_two_ranks_match_dense_layers_and_init_is_tp_invariant():
    g = torch.Generator().manual_seed(1)
    dense = {"col_w": torch.randn(6, 4, generator=g), "col_b": torch.randn(6, generator=g),
             "row_w": torch.randn(4, 6, generator=g), "row_b": torch.randn(4, generator=g),
             "emb": torch.randn(8, 4, generator=g)}
    x = torch.randn(3, 4, generator=g)
    tokens = torch.randint(0, 8, (2, 5), generator=g)
    results = run_distributed(_body, 2, x, tokens, dense)

    xr = x.clone().requires_grad_(True)
    ref = F.linear(F.linear(xr, dense["col_w"], dense["col_b"]), dense["row_w"], dense["row_b"])
    ref.sum().backward()
    torch.manual_seed(11)
    col1, row1, emb1 = ColumnParallelLinear(4, 6), RowParallelLinear(6, 4), VocabParallelEmbedding(8, 4)
    torch.manual_seed(5)
    gpt1 = GPTModel(tiny_config(), VOCAB).state_dict()
    pre = x.repeat(1, 2)[:, :6].clone().requires_grad_(True)
    ref_mlp = F.linear(F.gelu(pre), dense["row_w"])
    ref_mlp.sum().backward()
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["mlp"], ref_mlp.detach(), rtol=1e-6, atol=1e-6)
        assert r["mlp_bias_returned"]  # TP=2: the bias is added by the caller, after the reduction
        torch.testing.assert_close(r["mlp_pre_grad"], pre.grad.chunk(2, 1)[rank], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(r["y"], ref.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(r["x_grad"], xr.grad, rtol=1e-6, atol=1e-6)
        assert torch.equal(r["emb"], F.embedding(tokens, dense["emb"]))
        assert torch.equal(r["init"]["col"], col1.weight.detach().chunk(2, 0)[rank])
        assert torch.equal(r["init"]["row"], row1.weight.detach().chunk(2, 1)[rank])
        assert torch.equal(r["init"]["emb"], emb1.weight.detach().chunk(2, 0)[rank])
        expected = shard_state_dict(gpt1, rank, 2)
        assert r["gpt"].keys() == expected.keys()
        for name in expected:
            assert torch.equal(r["gpt"][name], expected[name]), name


@pytest.mark.parametrize("gelu", [False, True])
def test_single_rank_row_parallel_adds_its_bias_in_the_gemm(gelu):
    """At TP=1 the all-reduce is an identity: skip_bias_add hands back (Y with bias, None)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 6, generator=g)
    row = RowParallelLinear(6, 4, skip_bias_add=True)
    with torch.no_grad():
        row.bias.copy_(torch.randn(4, generator=g))
    w, b = (t.detach().clone().requires_grad_(True) for t in (row.weight, row.bias))
    xi, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y, bias = row.forward_gelu(xi) if gelu else row(xi)
    ref = F.linear(F.gelu(xr) if gelu else xr, w, b)
    assert bias is None
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)
    y.pow(2).sum().backward()
    ref.pow(2).sum().backward()
    for ours, theirs in ((xi.grad, xr.grad), (row.weight.grad, w.grad), (row.bias.grad, b.grad)):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape,dim", [((24, 8), 0), ((8, 24), 1), ((20, 4), 0)])
def test_init_is_the_same_full_matrix_at_tp_1_2_4(shape, dim):
    """Each rank draws only its shard (blocks with their own generators), yet the shards of TP=2 and TP=4 put
    together are the TP=1 matrix, and the default generator ends in the same state for every TP size."""
    import domino.parallel.layers as layers

    def draw(rank, world):
        torch.manual_seed(3)
        weight = layers._sharded_normal(shape, 0.02, dim, MeshGroup.shapes_only(world, rank)).detach()
        return weight, torch.get_rng_state()

    full, after = draw(0, 1)
    assert full.shape == shape and 0.01 < full.std() < 0.03
    for world in (2, 4):
        shards = [draw(rank, world) for rank in range(world)]
        assert all(s[0].shape[dim] == shape[dim] // world for s in shards)
        assert torch.equal(torch.cat([s[0] for s in shards], dim=dim), full), world
        assert all(torch.equal(s[1], after) for s in shards)
    # 22 rows: gcd(22, 20160) = 2 blocks, fine for TP 2; TP 11 would cut them, so one block per row.
    assert layers.init_blocks(22, 2) == 2 and layers.init_blocks(22, 11) == 22
