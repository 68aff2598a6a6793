"""A validated config is a value (issue 55, item 5): nothing assigns into it after parsing; resolving a default
makes a new one, and the one that was validated is unchanged."""

from __future__ import annotations

import dataclasses

import pytest

from domino.checkpoint.resume import keep_padded_vocab
from domino.config import DominoConfig, parse_config
from domino.config.validate import resolve_domino_chunks, resolve_zero_stage


@pytest.mark.parametrize("group", DominoConfig.GROUPS)
def test_every_section_refuses_assignment_after_validation(group):
    config = parse_config(["--preset", "tiny"])
    section = getattr(config, group)
    name = dataclasses.fields(section)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(section, name, getattr(section, name))
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(config, group, section)


def test_resolution_returns_a_new_value_and_leaves_the_given_one_alone():
    config = DominoConfig().replace(tensor_model_parallel_size=2, micro_batch_size=2)
    chunked, note = resolve_domino_chunks(config)
    assert chunked.parallel.domino_chunks == 2 and config.parallel.domino_chunks is None and "2" in note
    assert resolve_domino_chunks(chunked) == (chunked, None)
    staged, note = resolve_zero_stage(config, data_parallel_size=1)
    assert staged.parallel.zero_stage == 0 and config.parallel.zero_stage is None and note
    assert staged.model is config.model  # the groups not changed are shared, not copied


def test_replace_takes_flat_names_and_refuses_unknown_ones():
    config = DominoConfig().replace(num_layers=3, lr=0.5, load="/ckpt")
    assert (config.model.num_layers, config.train.lr, config.checkpoint.load) == (3, 0.5, "/ckpt")
    with pytest.raises(KeyError):
        DominoConfig().replace(no_such_setting=1)


def test_a_fresh_start_keeps_the_runs_own_padding_without_copying_the_config():
    config = parse_config(["--preset", "tiny"])
    assert keep_padded_vocab(None, config, 512, weights_only=False) == (config, 512, None)
