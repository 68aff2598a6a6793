"""One mechanism cuts every pipeline stage (``domino.pipeline.stages.cut_stage``): a 1F1B stage and each
interleaved model chunk is a model of the whole model's class over the whole model's own modules, registered in
the whole model's order, so the optimizer sees a stage's parameters in the order the unsplit model has them
(its groups and, on resume, its state by position) and nothing is copied. One process, no pipeline group: the cut
needs only the stage's index."""

from __future__ import annotations

import pytest
import torch

from domino.config import parse_config
from domino.model import GPTModel
from domino.pipeline.stages import (
    TIED_EMBEDDING, VirtualStages, is_shared_copy, model_chunks, split_model, stored_name,
)

SHAPE = ["--num-layers", "8", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
         "--max-position-embeddings", "8", "--vocab-size", "64"]


def _whole(untied: bool) -> GPTModel:
    config = parse_config([*SHAPE, *(["--untie-embeddings-and-output-weights"] if untied else [])])
    torch.manual_seed(0)
    return GPTModel(config.model, 64)


@pytest.mark.parametrize("untied", [False, True])
@pytest.mark.parametrize("stages, virtual", [(2, 1), (4, 1), (2, 2), (2, 4)])
def test_every_stage_holds_the_whole_models_parameters_in_its_order_uncopied(stages, virtual, untied):
    whole_order = {name: i for i, (name, _) in enumerate(_whole(untied).named_parameters())}
    seen = []
    for rank in range(stages):
        whole = _whole(untied)
        by_name = dict(whole.named_parameters())
        stage = split_model(whole, rank, stages, virtual)
        assert isinstance(stage, VirtualStages if virtual > 1 else GPTModel)
        names = [stored_name(name, param) for name, param in stage.named_parameters()]
        own = [name for name, param in stage.named_parameters() if not is_shared_copy(param)]
        assert [whole_order[n] for n in own] == sorted(whole_order[n] for n in own), own
        if len(own) < len(names):  # the tied copy is the last stage's output layer: its last parameter
            assert is_shared_copy(list(stage.parameters())[-1])
        for name, param in stage.named_parameters():
            assert param is by_name[stored_name(name, param)]  # the whole model's tensor itself
        for chunk in model_chunks(stage):  # each chunk: the model's class, whose forward the schedule runs
            assert type(chunk) is GPTModel and chunk.tp is whole.tp
        seen += names
    tied_copy = [] if untied else [TIED_EMBEDDING]  # the last stage's copy, stored as the first stage's matrix
    assert sorted(seen) == sorted([*whole_order, *tied_copy])
