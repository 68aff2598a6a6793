"""Context parallelism's attention equals unsplit causal SDPA, outputs and gradients, on real gloo groups: the ring
(``p2p``) and the all-to-all over heads (``a2a``)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from distributed_helpers import run_distributed
from domino.data.batch import dense_document_mask, get_ltor_masks_and_position_ids
from domino.parallel import attention_blocks as B
from domino.parallel import ring_attention as R
from domino.parallel.all_to_all_attention import all_to_all_attention, chunk_orders
from domino.parallel.context_split import local_token_indices
from domino.parallel.kernels import PLAIN_KERNELS
from domino.runtime.mesh import MeshGroup, ParallelMesh


def _qkv(seed, b=2, heads=4, groups=2, s=16, d=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, s, d, generator=g, dtype=torch.float64).float() for n in (heads, groups, groups)]


def test_chunks_pair_early_with_late_and_cover_the_sequence_once():
    for n in (1, 2, 3, 4):
        held = torch.cat([local_token_indices(8 * n, MeshGroup.shapes_only(n, r)) for r in range(n)])
        assert sorted(held.tolist()) == list(range(8 * n))
        for r in range(n):
            first, second = local_token_indices(8 * n, MeshGroup.shapes_only(n, r)).view(2, 4)[:, 0] // 4
            assert (first.item(), second.item()) == (r, 2 * n - 1 - r)
    with pytest.raises(ValueError, match="4 equal chunks"):
        local_token_indices(10, MeshGroup.shapes_only(2, 0))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("groups", [4, 2])
def test_block_kernels_equal_sdpa_and_each_other(causal, groups):
    q, k, v = _qkv(0, groups=groups, s=12)
    if not causal:  # a block of other keys: fewer of them than queries
        k, v = k[:, :, :8], v[:, :, :8]
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=groups != 4)
    dout = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    scale = q.shape[-1] ** -0.5
    for forward, backward in ((B.math_forward, B.math_backward), (B.cpu_flash_forward, B.cpu_flash_backward)):
        out, lse = forward(q.detach(), k.detach(), v.detach(), causal, scale)
        torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-5)
        assert lse.shape == q.shape[:3]
        grads = backward(dout, q.detach(), k.detach(), v.detach(), out, lse, causal, scale)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_block_kernels_take_a_mask_and_give_rows_it_hides_nothing():
    """A block of a per-document mask: rows it lets see something equal SDPA's; rows it hides whole come back as
    ``lse = -inf`` and a zero output from both kernels (the fused CPU kernel's own answer there is ``lse = 0``,
    which the merge would count as a block of weight 1)."""
    q, k, v = _qkv(4, s=12)
    k, v = k[:, :, :8], v[:, :, :8]
    mask = torch.rand(1, 1, 12, 8, generator=torch.Generator().manual_seed(2)) < 0.5
    mask[..., 3:, 0] = True
    mask[..., :3, :] = False  # the first three rows see no key of this block
    seen = [t.clone().requires_grad_(True) for t in (q[:, :, 3:], k, v)]
    ref = F.scaled_dot_product_attention(*seen, attn_mask=mask[:, :, 3:], enable_gqa=True)
    dout = torch.randn(q.shape)
    dout[:, :, :3] = 0
    ref_grads = torch.autograd.grad(ref, seen, dout[:, :, 3:])
    scale = q.shape[-1] ** -0.5
    for forward, backward in ((B.math_forward, B.math_backward), (B.cpu_flash_forward, B.cpu_flash_backward)):
        out, lse = forward(q, k, v, False, scale, mask)
        torch.testing.assert_close(out[:, :, 3:], ref.detach(), rtol=1e-5, atol=1e-5)
        assert (out[:, :, :3] == 0).all() and torch.isneginf(lse[:, :, :3]).all()
        assert torch.isfinite(lse[:, :, 3:]).all()
        dq, dk, dv = backward(dout, q, k, v, out, lse.nan_to_num(neginf=0.0), False, scale, mask)
        torch.testing.assert_close(dq[:, :, 3:], ref_grads[0], rtol=1e-4, atol=1e-5)
        assert (dq[:, :, :3] == 0).all()
        torch.testing.assert_close(dk, ref_grads[1], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(dv, ref_grads[2], rtol=1e-4, atol=1e-5)


def test_ring_of_one_is_plain_causal_sdpa():
    q, k, v = _qkv(1)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(R.ring_attention(q, k, v, MeshGroup()), want)


def _document_mask(b, s):
    """``[b, 1, s, s]``, True = may attend: causal within documents that start at random places of each row."""
    g = torch.Generator().manual_seed(11)
    segment = torch.cumsum((torch.rand(b, s, generator=g) < 0.15).long(), dim=1)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    return (causal & (segment.unsqueeze(2) == segment.unsqueeze(1))).unsqueeze(1)


def _document_starts(b, s):
    """``[b, s]`` document starts (documents ending at random places; the last row one document) as the batch
    gives them, for ``--reset-attention-mask`` without a dense mask."""
    g = torch.Generator().manual_seed(13)
    tokens = 1 + torch.randint(0, 5, (b, s), generator=g)
    tokens[:-1][torch.rand(b - 1, s, generator=g) < 0.2] = 0
    return get_ltor_masks_and_position_ids(tokens, 0, False, True, False)[0]


def _ring_body(rank, world_size, plain, comm_type="p2p", heads=4, groups=2, documents=False):
    """``documents``: False (causal), True (a dense mask of the whole sequence) or "starts" (each rank's chunks'
    document starts, the batch's form; compared with SDPA under the dense mask they stand for)."""
    cp = ParallelMesh.build(1, context_parallel_size=world_size).cp
    attention = R.ring_attention if comm_type == "p2p" else all_to_all_attention
    q, k, v = _qkv(7, s=8 * world_size, heads=heads, groups=groups)  # the whole sequence, the same on every rank
    index = local_token_indices(q.shape[2], cp)
    mask = _document_mask(q.shape[0], q.shape[2]) if documents else None
    if documents == "starts":
        starts = _document_starts(q.shape[0], q.shape[2])
        mask = ~dense_document_mask(starts)
        attention = partial(attention, attend_mask=starts.index_select(1, index))
    elif mask is not None:
        attention = partial(attention, attend_mask=mask)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, attn_mask=mask, is_causal=mask is None, enable_gqa=heads != groups)
    ref_grads = torch.autograd.grad(ref, full, dout)
    local = [t.index_select(2, index).requires_grad_(True) for t in (q, k, v)]
    out = attention(*local, cp, kernels=PLAIN_KERNELS if plain else None)
    grads = torch.autograd.grad(out, local, dout.index_select(2, index))
    want = [ref.detach().index_select(2, index)] + [g.index_select(2, index) for g in ref_grads]
    return [(got.detach() - w).abs().max().item() for got, w in zip([out, *grads], want)]


@pytest.mark.parametrize("world_size,plain,documents", [(2, False, False), (4, False, False), (2, True, False),
                                                        (2, False, True), (4, False, True), (2, True, True),
                                                        (2, False, "starts"),
                                                        (2, True, "starts")])
def test_ring_attention_equals_unsplit_attention_forward_and_backward(world_size, plain, documents):
    """Each rank's output and its q, k and v gradients equal unsplit SDPA's at its tokens, plain causal and with
    per-document masks, with either block kernel: fails if the chunk order, the per-step visibility, a block's
    part of the mask, the log-sum-exp merge or the key/value gradients' trip home is wrong. With each rank's
    document starts (no dense mask): the per-document sub-blocks (segmented) and the block masks built from the
    starts (plain) equal SDPA under the dense mask."""
    for errors in run_distributed(_ring_body, world_size, plain, "p2p", 4, 2, documents):
        assert max(errors) < 1e-5, errors


def _dropout_body(rank, world_size, p=0.3, documents=False):
    """The ring with dropout against unsplit attention given the same masks: the ones the ring drew (recorded);
    with ``documents``, under each rank's document starts (the sub-blocks take their parts of the block's masks)."""
    cp = ParallelMesh.build(1, context_parallel_size=world_size).cp
    q, k, v = _qkv(5, s=8 * world_size)
    b, heads, total, _ = q.shape
    index = local_token_indices(total, cp)
    drawn, draw = [], R._keep_mask
    R._keep_mask = lambda *args: drawn.append(draw(*args)) or drawn[-1]
    local = [t.index_select(2, index).requires_grad_(True) for t in (q, k, v)]
    hidden = torch.ones(total, total, dtype=torch.bool).triu(1)
    starts = None
    if documents:
        whole = _document_starts(b, total)
        hidden, starts = dense_document_mask(whole), whole.index_select(1, index)
    torch.manual_seed(100 + rank)
    out = R.ring_attention(*local, cp, attend_mask=starts, dropout=p)
    after_forward = torch.get_rng_state()
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad(out, local, dout.index_select(2, index))
    replayed = len(drawn) == 2 * world_size and all(torch.equal(a, b) for a, b in zip(drawn[:world_size],
                                                                                       drawn[world_size:]))
    kept = torch.zeros(b, heads, total, total)  # the whole sequence's keep mask: each rank fills its rows
    for step, keep in enumerate(drawn[:world_size]):
        owner, _, rows, keys = R._block_of(step, cp, index.numel() // 2)
        owner_index = local_token_indices(total, MeshGroup.shapes_only(world_size, owner))
        kept[:, :, index[rows].unsqueeze(1), owner_index[keys].unsqueeze(0)] = keep.float()
    torch.distributed.all_reduce(kept)
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    fq, fk, fv = full[0], *(t.repeat_interleave(2, dim=1) for t in full[1:])
    scores = (fq @ fk.transpose(-1, -2)) * fq.shape[-1] ** -0.5
    probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
    ref = (probs * kept / (1 - p)) @ fv
    ref_grads = torch.autograd.grad(ref, full, dout)
    want = [ref.detach().index_select(2, index)] + [g.index_select(2, index) for g in ref_grads]
    errors = [(got.detach() - w).abs().max().item() for got, w in zip([out, *grads], want)]
    dropped = 1 - torch.cat([d.flatten() for d in drawn]).float().mean().item()
    return errors, replayed, torch.equal(after_forward, torch.get_rng_state()), dropped


@pytest.mark.parametrize("world_size,documents", [(2, False), (4, False), (2, True)])
def test_ring_dropout_equals_unsplit_attention_with_the_same_masks(world_size, documents):
    """Dropout block by block, rescaled by the merge, is unsplit dropout: output and gradients equal unsplit
    attention given the masks the ring drew; backward draws the same masks again and leaves the generator as
    forward left it. Fails if a block's probabilities are dropped before the merge's rescaling is right, the
    backward draws other masks, or the dropped probabilities' gradient is not scaled. Under document starts too
    (per-document sub-blocks, each taking its part of its block's mask)."""
    for errors, replayed, generator_kept, dropped in run_distributed(_dropout_body, world_size, 0.3, documents):
        assert max(errors) < 1e-5, errors
        assert replayed and generator_kept
        assert 0.2 < dropped < 0.4, dropped


@pytest.mark.parametrize("world_size,heads,groups,documents", [(2, 4, 2, False), (4, 4, 4, False), (4, 8, 4, False),
                                                                (2, 4, 2, True), (2, 4, 2, "starts")])
def test_all_to_all_attention_equals_unsplit_attention_forward_and_backward(world_size, heads, groups, documents):
    """The head exchange (``--cp-comm-type a2a``): each rank's output and gradients equal unsplit SDPA's at its
    tokens (GQA and MHA; and with per-document masks of the whole sequence, or each rank's chunks' document
    starts, gathered); fails if the chunks are put in the
    wrong order or a head group goes to the wrong rank."""
    for errors in run_distributed(_ring_body, world_size, False, "a2a", heads, groups, documents):
        assert max(errors) < 1e-5, errors


def test_chunk_orders_put_the_ranks_chunks_in_position_order_and_back():
    for n in (1, 2, 3, 4):
        to_positions, to_ranks = chunk_orders(n, torch.device("cpu"))
        received = torch.cat([local_token_indices(2 * n, MeshGroup.shapes_only(n, r)) for r in range(n)])
        assert received[to_positions].tolist() == list(range(2 * n))
        assert torch.arange(2 * n)[to_ranks].tolist() == received.tolist()


def test_all_to_all_attention_refuses_heads_it_cannot_split():
    q, k, v = _qkv(2, heads=4, groups=2)
    with pytest.raises(ValueError, match="4 query and 2 key/value heads per rank are not both divisible by 4"):
        all_to_all_attention(q, k, v, MeshGroup.shapes_only(4, 0))


def test_a_context_parallel_model_defaults_to_its_chunks_positions():
    """Without explicit ids (a middle pipeline stage reads no batch) a CP rank's tokens keep their true positions."""
    from domino.config.flags import parse_config
    from domino.model import GPTModel

    config = parse_config(["--preset", "tiny", "--mock-data"]).model
    model = GPTModel(config, 128, cp=MeshGroup.shapes_only(2, 1))
    positions = model._position_ids(32, torch.device("cpu"), None, None)
    assert positions.tolist() == [list(range(16, 32)) + list(range(32, 48))]
    with pytest.raises(ValueError, match="exceed --max-position-embeddings 64"):
        model._position_ids(40, torch.device("cpu"), None, None)
