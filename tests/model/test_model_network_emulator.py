"""An emulated TP link (``DOMINO_SIMULATED_NETWORK``) slows collectives but leaves training bit-identical."""

from __future__ import annotations

import pytest
import torch

from distributed_helpers import run_distributed
from domino.runtime import comm_timing as C
from domino.runtime import state
from domino.runtime.network_emulator import LinkEmulator, LinkSpec
from model_fixtures import VOCAB, build_model, random_batch, tiny_config


def _training_body(rank, world_size, chunks_list, spec, sequence_parallel=False):
    state.initialize_model_parallel(2)
    out = {}
    for chunks in chunks_list:
        for emulated in (False, True):
            state.set_tensor_model_parallel_link(LinkEmulator(spec) if emulated else None)
            torch.manual_seed(11)
            model = build_model(tiny_config(), VOCAB, chunks, sequence_parallel)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            C.pop_modelled_comm_seconds(state.current_mesh().tp.link)
            losses, modelled = [], []
            for step in range(3):
                batch = random_batch(seed=step)
                loss = model(batch["tokens"], labels=batch["labels"]).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
                modelled.append(C.pop_modelled_comm_seconds(state.current_mesh().tp.link))
            out[(chunks, emulated)] = {"losses": torch.stack(losses), "modelled": modelled,
                                       "params": [p.detach().clone() for p in model.parameters()]}
    return out


@pytest.mark.parametrize("transfer", ["launch", "wait"])
def test_emulated_link_leaves_training_bit_identical(transfer):
    spec = LinkSpec(latency_us=0.0, gbps=0.2, transfer=transfer)
    cfg = tiny_config()
    b, s, h, layers = 4, cfg.seq_length, cfg.hidden_size, cfg.num_layers
    # Per step, fp32: embedding (forward) + 2 per layer forward + 2 per layer backward + output layer input
    # gradient, all [b, s, h]; the loss's max, sum and target-logit all-reduces, [b, s] each. 2(n-1)/n = 1.
    wire_bytes = 4 * ((2 + 4 * layers) * b * s * h + 3 * b * s)
    for rank_result in run_distributed(_training_body, 2, (1, 2, 4), spec):
        for chunks in (1, 2, 4):
            off, on = rank_result[(chunks, False)], rank_result[(chunks, True)]
            assert torch.equal(off["losses"], on["losses"]), f"chunks={chunks}: losses differ"
            assert all(torch.equal(a, b) for a, b in zip(off["params"], on["params"]))
            assert off["modelled"] == [0.0] * 3
            # Every TP collective went over the emulated link, and Domino moves the same bytes in more pieces.
            assert on["modelled"] == [pytest.approx(spec.seconds(wire_bytes))] * 3


@pytest.mark.parametrize("transfer", ["launch", "wait"])
def test_emulated_link_leaves_sequence_parallel_training_bit_identical(transfer):
    """Sequence parallelism's asynchronous all-gathers and reduce-scatters on the emulated link (with
    ``transfer=wait`` gloo writes the gathered buffer inside ``wait()``, after autograd has seen it)."""
    spec = LinkSpec(latency_us=0.0, gbps=0.2, transfer=transfer)
    for rank_result in run_distributed(_training_body, 2, (1, 2), spec, True):
        for chunks in (1, 2):
            off, on = rank_result[(chunks, False)], rank_result[(chunks, True)]
            assert torch.equal(off["losses"], on["losses"]), f"chunks={chunks}: losses differ"
            assert all(torch.equal(a, b) for a, b in zip(off["params"], on["params"]))
            assert off["modelled"] == [0.0] * 3 and min(on["modelled"]) > 0
