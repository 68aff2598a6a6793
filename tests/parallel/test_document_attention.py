"""Per-document attention from document starts equals attention under the dense ``[b, 1, s, s]`` mask, outputs and
gradients, by every kernel choice (segmented on CPU, varlen on CUDA with CPU stand-ins for its flash ops, dense),
inside the model too, and the segmented path never builds an ``s x s`` tensor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from domino.data.batch import dense_document_mask, get_ltor_masks_and_position_ids
from domino.parallel import document_attention as D
from domino.parallel.kernels import CPU_KERNELS, CUDA_KERNELS, PLAIN_KERNELS, kernels_for

EOD = 0


def _starts(b, s, seed=11, rate=0.15):
    """Document starts of ``b`` rows of ``s`` tokens with end-of-document tokens at random places (the last row has
    none: one document), as the batch builds them."""
    g = torch.Generator().manual_seed(seed)
    tokens = 1 + torch.randint(0, 5, (b, s), generator=g)
    tokens[:-1][torch.rand(b - 1, s, generator=g) < rate] = EOD
    return get_ltor_masks_and_position_ids(tokens, EOD, False, True, False)[0]


def _qkv(seed, b=3, heads=4, groups=2, s=24, d=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, s, d, generator=g, dtype=torch.float64).float().requires_grad_(True)
            for n in (heads, groups, groups)]


def _dense_reference(q, k, v, starts):
    """SDPA under Megatron's mask: the reference every path must equal."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=~dense_document_mask(starts),
                                          enable_gqa=k.shape[1] != q.shape[1])


def _flash_forward_on_cpu(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                          return_debug_mask, scale=None):
    """``aten::_flash_attention_forward``'s varlen form, on CPU: THD inputs, one causal sequence per
    ``cu_seqlens`` interval; ``lse`` ``[heads, tokens]`` as flash's varlen kernel returns it."""
    assert torch.equal(cum_seq_q, cum_seq_k) and cum_seq_q.dtype == torch.int32 and is_causal and dropout_p == 0
    bounds = cum_seq_q.tolist()
    assert bounds[0] == 0 and bounds[-1] == query.shape[0] and max(b - a for a, b in zip(bounds, bounds[1:])) == max_q
    outs, lses = [], []
    for a, b in zip(bounds, bounds[1:]):
        q, k, v = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        n = q.shape[1] // k.shape[1]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k.repeat_interleave(n, 1), v.repeat_interleave(n, 1), 0.0, True, scale=scale)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    empty = torch.empty(0)
    return torch.cat(outs), torch.cat(lses, dim=1), empty, empty, empty


def _flash_backward_on_cpu(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                           dropout_p, is_causal, rng_state, unused, scale=None):
    grads = [torch.zeros_like(t) for t in (query, key, value)]
    bounds = cum_seq_q.tolist()
    for a, b in zip(bounds, bounds[1:]):
        q, k, v, o, do = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (query, key, value, out, grad_out))
        n = q.shape[1] // k.shape[1]
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k.repeat_interleave(n, 1), v.repeat_interleave(n, 1), o, logsumexp[:, a:b].unsqueeze(0), 0.0,
            True, scale=scale)
        dk, dv = (g[0].unflatten(0, (-1, n)).sum(1) for g in (dk, dv))
        for grad, piece in zip(grads, (dq[0], dk, dv)):
            grad[a:b] += piece.transpose(0, 1)
    return tuple(grads)


@pytest.mark.parametrize("kernels", [CPU_KERNELS, CUDA_KERNELS, PLAIN_KERNELS], ids=["segmented", "varlen", "dense"])
@pytest.mark.parametrize("groups", [4, 2])
def test_document_attention_equals_the_dense_mask(monkeypatch, kernels, groups):
    """Outputs and q, k, v gradients of each choice equal SDPA under the dense mask (fails if a document is cut in
    the wrong place, a piece's gradient lands elsewhere, or cu_seqlens miss a sample's first document)."""
    monkeypatch.setattr(D, "flash_varlen_ops", lambda: (_flash_forward_on_cpu, _flash_backward_on_cpu))
    monkeypatch.setattr(D, "VARLEN_DTYPES", (torch.float32,))  # the stand-ins take fp32, as the tests compare
    q, k, v = _qkv(1, groups=groups)
    starts = _starts(3, 24)
    assert len(set(starts[0].tolist())) > 2 and set(starts[-1].tolist()) == {0}
    ref = _dense_reference(q, k, v, starts)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    out = D.document_attention(q, k, v, starts, kernels=kernels)
    again = D.document_attention(q, k, v, starts, kernels=kernels)  # the next layer: varlen finds its cu_seqlens kept
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert torch.equal(again, out) and hasattr(starts, D.CU_SEQLENS) == (kernels is CUDA_KERNELS)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_each_device_takes_its_document_kernel_and_bad_starts_are_refused(monkeypatch):
    def no_flash():
        raise AssertionError("fp32 reached FlashAttention")

    monkeypatch.setattr(D, "flash_varlen_ops", no_flash)
    q, k, v = _qkv(0)
    # FlashAttention takes no fp32: those inputs go the segmented way.
    torch.testing.assert_close(D.document_attention(q, k, v, _starts(3, 24), kernels=CUDA_KERNELS),
                               _dense_reference(q, k, v, _starts(3, 24)), rtol=1e-5, atol=1e-5)
    assert kernels_for(torch.device("cuda")).document_attention == "varlen"
    assert kernels_for(torch.device("cpu")).document_attention == "segmented"
    assert PLAIN_KERNELS.document_attention == "dense" and torch.float32 not in D.VARLEN_DTYPES
    cu, longest = D.cu_seqlens(torch.tensor([[0, 0, 2, 2, 2], [0, 1, 1, 1, 4]]))
    assert cu.tolist() == [0, 2, 5, 6, 9, 10] and longest == 3
    with pytest.raises(ValueError, match=r"document starts of shape \(3, 12\) for a batch of 3 sequences of 24"):
        D.document_attention(q, k, v, _starts(3, 12))


class _SquareTensors(TorchDispatchMode):
    """Records the shapes of every op's outputs whose last two dimensions are ``s x s``."""

    def __init__(self, s):
        super().__init__()
        self.s, self.seen = s, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and tuple(t.shape[-2:]) == (self.s, self.s):
                self.seen.append((str(func), tuple(t.shape)))
        return out


def test_a_model_with_document_starts_equals_the_dense_mask_and_builds_no_square_mask():
    """The tiny GPT with the batch's document starts gives the dense mask's losses and gradients, and its forward
    and backward make no ``[.., s, s]`` tensor (the dense path makes several: the check can see them)."""
    from domino.config.flags import parse_config
    from domino.model import GPTModel

    s = 24
    config = parse_config(["--preset", "tiny", "--mock-data", "--seq-length", str(s), "--attention-dropout", "0",
                           "--hidden-dropout", "0"]).model
    torch.manual_seed(0)
    model = GPTModel(config, 128)
    tokens = torch.randint(0, 128, (3, s), generator=torch.Generator().manual_seed(5))
    starts = _starts(3, s)
    positions = torch.arange(s) - starts

    def run(mask):
        model.zero_grad(set_to_none=True)
        losses = model(tokens, positions, mask, labels=tokens)
        losses.sum().backward()
        return losses.detach(), [p.grad.clone() for p in model.parameters()]

    squares = _SquareTensors(s)
    with squares:
        losses, grads = run(starts)
    assert squares.seen == []
    dense = _SquareTensors(s)
    with dense:
        ref_losses, ref_grads = run(dense_document_mask(starts))
    assert dense.seen
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
