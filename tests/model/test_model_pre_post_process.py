"""A model split into a first stage (embeddings) and a last stage (final LN, output layer) composes exactly."""

from __future__ import annotations

import torch

from domino.model import GPTModel
from model_fixtures import VOCAB, assert_close_rel, random_batch, tiny_config


def test_two_stages_equal_the_whole_model():
    torch.manual_seed(4)
    whole = GPTModel(tiny_config(num_layers=2), VOCAB)
    first = GPTModel(tiny_config(num_layers=1), VOCAB, post_process=False)
    last = GPTModel(tiny_config(num_layers=1), VOCAB, pre_process=False)
    sd = whole.state_dict()
    first.load_state_dict({k: v for k, v in sd.items() if k.startswith(("embedding.", "layers.0."))})
    last_sd = {k.replace("layers.1.", "layers.0."): v for k, v in sd.items() if k.startswith(("layers.1.", "final_"))}
    last_sd["output_layer.weight"] = sd["embedding.word_embeddings.weight"]
    last.load_state_dict(last_sd)
    batch = random_batch(seed=5)
    hidden = first(batch["tokens"])
    assert hidden.shape == (8, 4, 32)  # [s, b, h]: what a pipeline stage sends on
    assert_close_rel(last(hidden, labels=batch["labels"]), whole(batch["tokens"], labels=batch["labels"]), 1e-6,
                     "two-stage losses")
