"""A tokenizer whose ids leave gaps: its vocabulary size is the highest id + 1, not its count of entries, and the
``.bin``'s token dtype follows it, so it preprocesses and trains end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from domino.data.errors import DataError
from domino.data.indexed_dataset import IndexedDataset
from domino.data.preprocess import preprocess
from domino.data.tokenizer import build_tokenizer
from train.train_helpers import TINY, run_pretrain

WORDS = 48


def _gapped_tokenizer(path, highest: int, entries: int) -> str:
    """A word-level ``tokenizer.json``: ``<|endoftext|>`` 0, then ``entries - 1`` words spread up to ``highest``."""
    step = (highest - 1) / (entries - 2)
    vocab = {"<|endoftext|>": 0, "[UNK]": highest, **{f"w{k}": 1 + round(k * step) for k in range(entries - 2)}}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(str(path))
    return str(path)


@pytest.mark.parametrize("highest, entries, dtype", [(70_000, 50, np.int32), (40_000, 201, np.uint16)])
def test_a_tokenizer_with_gaps_in_its_ids_preprocesses_and_trains(tmp_path, highest, entries, dtype):
    spec = _gapped_tokenizer(tmp_path / "tokenizer.json", highest, entries)
    source = tmp_path / "in.jsonl"
    # every word of the tokenizer, the highest id ([UNK]) included
    source.write_text("".join(json.dumps({"text": " ".join(f"w{(i * 7 + j) % WORDS}" for j in range(40)) + " zz"})
                              + "\n" for i in range(40)))
    result = preprocess([str(source)], str(tmp_path / "d"), tokenizer=spec)
    data = IndexedDataset(result.prefixes["text"])
    assert result.vocab_size == build_tokenizer(spec).vocab_size == highest + 1 and data.dtype == dtype
    assert int(max(data[i].max() for i in range(len(data)))) == highest
    proc = run_pretrain([*TINY, "--data-path", result.prefixes["text"], "--tokenizer", spec, "--split", "1,0,0",
                         "--train-iters", "2", "--save", str(tmp_path / "ckpt")])
    assert "done: 2 iterations" in proc.stdout + proc.stderr


def test_an_id_no_dataset_can_hold_is_refused_naming_the_tokenizer(tmp_path):
    path = tmp_path / "tokenizer.json"
    HFTokenizer(models.WordLevel({"<|endoftext|>": 0, "x": 1}, unk_token="x")).save(str(path))
    content = json.loads(path.read_text())
    content["model"]["vocab"]["x"] = 2 ** 31  # edited in the file: tokenizers' save walks every id up to it
    path.write_text(json.dumps(content))
    with pytest.raises(DataError, match=f"tokenizer {path}: token id 2,147,483,648 is beyond the largest id"):
        build_tokenizer(str(path))
