"""The Domino schedule really overlaps: other work runs between every all-reduce's launch and its wait.

The all-reduces are replaced by recording stand-ins (one process), and a dispatch mode records every matmul
and attention kernel, so the test sees the exact order in which the schedule issues work.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import domino.overlap.schedule as schedule
import domino.overlap.slots as slots
import domino.overlap.steps as steps
from model_fixtures import VOCAB, build_model, tiny_config

_HEAVY = ("aten.mm", "aten.addmm", "aten.bmm", "flash_attention")


class _Recorder(TorchDispatchMode):
    def __init__(self, log):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(name in str(func) for name in _HEAVY):
            self.log.append(("op", None))
        return func(*args, **(kwargs or {}))


class _Handle:
    def __init__(self, log, ident):
        self.log, self.ident = log, ident

    def wait(self):
        self.log.append(("wait", self.ident))
        return True


def _ops_between_launch_and_wait(log):
    where = {}
    for i, (kind, ident) in enumerate(log):
        if kind != "op":
            where.setdefault(ident, {})[kind] = i
    assert all(set(w) == {"launch", "wait"} for w in where.values()), "an all-reduce was never waited on"
    return [sum(1 for kind, _ in log[w["launch"] + 1:w["wait"]] if kind == "op") for w in where.values()]


@pytest.fixture
def recorded(monkeypatch):
    log, count = [], [0]

    def fake_all_reduce_async(x, group):
        count[0] += 1
        log.append(("launch", count[0]))
        return _Handle(log, count[0])

    for module in (schedule, steps, slots):  # the embedding rows', the row-parallel sums' and the gradients'
        monkeypatch.setattr(module, "all_reduce_async", fake_all_reduce_async)
    return log


@pytest.mark.parametrize("chunks", [2, 3])
def test_forward_and_backward_all_reduces_are_overlapped(recorded, chunks):
    torch.manual_seed(0)
    model = build_model(tiny_config(), VOCAB, chunks)
    tokens = torch.randint(0, VOCAB, (6, 8))
    with _Recorder(recorded):
        loss = model(tokens, labels=tokens).sum()
    forward = _ops_between_launch_and_wait(recorded)
    # The word embeddings' all-reduce per chunk (launched first): chunk 0 waits for its own right away, every
    # other chunk after the chunks before it started (ops in between).
    assert len(forward) == chunks + 2 * 2 * chunks
    embedding, layers = forward[:chunks], forward[chunks:]
    assert embedding[0] == 0 and all(n >= 1 for n in embedding[1:]), embedding
    # 2 row-parallel all-reduces per layer per chunk, each hidden behind one step of every other chunk;
    # only the last layer's fc2 all-reduces of the chunks finishing last have nothing left to hide behind.
    assert all(n >= 1 for n in layers[:-(chunks - 1) or None]), layers
    recorded.clear()
    with _Recorder(recorded):
        loss.backward()
    backward = _ops_between_launch_and_wait(recorded)
    # The output layer's input gradient, one all-reduce over the joined chunks (launched first: a batch chunk of
    # the [s, b, h] gradient is strided, as in DeepSpeed-Domino), then QKV and fc1 input gradients.
    assert len(backward) == 2 * 2 * chunks + 1
    assert backward[0] >= 1  # the output layer's all-reduce overlaps its weight-gradient GEMM
    # Each overlaps at least its own weight-gradient GEMM; all but the very last also other chunks' work.
    assert min(backward) >= 1
    assert sorted(backward)[1] >= 2


def test_embedding_dropout_keeps_the_whole_batch_embedding_all_reduce(recorded):
    """With embedding dropout in training the mask is drawn for the whole batch (as without Domino), so the
    embeddings are all-reduced before the stack; in evaluation (no dropout) per chunk, inside the stack."""
    torch.manual_seed(0)
    model = build_model(tiny_config(hidden_dropout=0.1), VOCAB, 2)
    tokens = torch.randint(0, VOCAB, (4, 8))
    launches = lambda: sum(1 for kind, _ in recorded if kind == "launch")  # noqa: E731
    model.train()
    model(tokens, labels=tokens)
    assert launches() == 2 * 2 * 2
    recorded.clear()
    model.eval()
    with torch.no_grad():
        model(tokens, labels=tokens)
    assert launches() == 2 + 2 * 2 * 2


def test_sync_path_issues_no_async_collectives(recorded):
    model = build_model(tiny_config(), VOCAB, 1)
    tokens = torch.randint(0, VOCAB, (2, 8))
    model(tokens, labels=tokens).sum().backward()
    assert recorded == []


def test_batch_smaller_than_chunks_runs_synchronously(recorded):
    torch.manual_seed(0)
    model = build_model(tiny_config(), VOCAB, 4)
    tokens = torch.randint(0, VOCAB, (2, 8))
    model(tokens, labels=tokens).sum().backward()
    assert recorded == []
    positions = torch.arange(8).unsqueeze(0)
    with pytest.raises(ValueError, match="micro-batch size 2 is smaller than --domino-chunks 4"):
        model.stack(model.stack.embed(tokens, positions), positions, None, None, None)


class _LateHandle:
    """An all-reduce still in flight: until ``wait()`` the buffer holds garbage (NaN), as a real in-place
    all-reduce's buffer may; ``wait()`` lands the result (one process: the sum is the tensor itself)."""

    def __init__(self, x: torch.Tensor, group) -> None:
        self.x, self.result = x, x.detach().clone()
        x.detach().fill_(float("nan"))

    def wait(self):
        self.x.detach().copy_(self.result)
        return True


@pytest.mark.parametrize("chunks", [2, 3])
def test_every_sum_is_read_only_after_its_wait(monkeypatch, chunks):
    """With all-reduces that complete late, the Domino schedule gives the synchronous path's loss and
    gradients exactly: nothing reads a partial sum or a gradient before waiting for its all-reduce."""
    torch.manual_seed(0)
    model = build_model(tiny_config(), VOCAB, chunks)
    tokens = torch.randint(0, VOCAB, (6, 8))
    reference = build_model(tiny_config(), VOCAB, 1)
    reference.load_state_dict(model.state_dict())
    expected = reference(tokens, labels=tokens).sum()
    expected.backward()

    for module in (schedule, steps, slots):
        monkeypatch.setattr(module, "all_reduce_async", _LateHandle)
    loss = model(tokens, labels=tokens).sum()
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, ref.grad, rtol=1e-5, atol=1e-6, msg=name)


class _MaskBuilds(TorchDispatchMode):
    """Counts kernels that write a new boolean tensor (building or inverting a mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.bool and out.dim() == 4:
            self.count += 1
        return out


@pytest.mark.parametrize("chunks", [1, 2])
def test_reset_attention_mask_is_built_once_per_batch(monkeypatch, chunks):
    """--reset-attention-mask: every layer and chunk attends with views of one mask, made once per forward."""
    from model_fixtures import random_batch

    import domino.model.transformer as transformer

    batch = random_batch(seed=3, batch=4)
    model = build_model(tiny_config(num_layers=3), VOCAB, chunks)
    storages = []
    sdpa = transformer.F.scaled_dot_product_attention

    def recording_sdpa(q, k, v, attn_mask=None, **kwargs):
        storages.append(attn_mask.untyped_storage().data_ptr())
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(transformer.F, "scaled_dot_product_attention", recording_sdpa)
    builds = _MaskBuilds()
    with builds:
        model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    assert len(storages) == 3 * chunks  # one attention per layer and chunk
    assert len(set(storages)) == 1 and storages[0] != batch["attention_mask"].untyped_storage().data_ptr()
    assert builds.count == 1
