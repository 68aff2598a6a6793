"""Hugging Face export/import: transformers loads the export offline and agrees with our model."""

import json

import pytest
import torch
import transformers

from domino.config import ConfigError
from domino.eval.generate import generate_ids
from domino.checkpoint.hf_interop import export_hf, import_hf
from domino.checkpoint import on_disk as wio
from domino.checkpoint import model_loading
from eval_checkpoints import save_checkpoint, tiny_config, tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("hf")
    tokenizer = tiny_tokenizer(root / "tok")
    config = tiny_config(str(root / "tok"))
    model = tiny_model(config, tokenizer.vocab_size, seed=5)
    save_checkpoint(root / "ckpt", model, config, tp=2, tokenizer=tokenizer)  # export must merge TP shards
    return root, model, tokenizer


def test_export_matches_transformers(saved, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root, model, tokenizer = saved
    out = export_hf(root / "ckpt", root / "hf")
    assert {"config.json", "model.safetensors", "tokenizer.json", "vocab.json", "merges.txt"} <= {
        p.name for p in out.iterdir()}
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(out), local_files_only=True).eval()
    assert hf.config.vocab_size == tokenizer.vocab_size
    tokens = torch.tensor([tokenizer.encode("To be, or not to be, that is")])
    with torch.no_grad():
        ours = model(tokens)[..., :tokenizer.vocab_size]
        theirs = hf(tokens).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4 * ours.abs().max().item())
    prompt = tokens[0, :4].tolist()
    with torch.no_grad():
        hf_greedy = hf.generate(tokens[:, :4], max_new_tokens=12, do_sample=False, eos_token_id=None,
                                pad_token_id=tokenizer.eod)[0, 4:].tolist()
    assert hf_greedy == generate_ids(model, prompt, 12, vocab_size=tokenizer.vocab_size)
    hf_tok = transformers.GPT2TokenizerFast.from_pretrained(str(out), local_files_only=True)
    assert hf_tok.encode("To be, or not") == tokenizer.encode("To be, or not")


def test_import_round_trip(saved):
    root, model, tokenizer = saved
    hf_dir = export_hf(root / "ckpt", root / "hf2")
    ckpt = import_hf(hf_dir, root / "imported", make_vocab_size_divisible_by=8)
    assert wio.resolve_checkpoint_dir(root / "imported") == ckpt
    meta = wio.read_checkpoint_meta(ckpt)
    assert meta["tensor_model_parallel_size"] == 1 and meta["padded_vocab_size"] == model.vocab_size
    imported, _, imported_tok = model_loading.build_model_from_checkpoint(root / "imported")
    assert imported_tok.encode("whether 'tis") == tokenizer.encode("whether 'tis")
    original = model.state_dict()
    for name, tensor in imported.state_dict().items():
        if name == "embedding.word_embeddings.weight":  # padding rows come back as zeros
            torch.testing.assert_close(tensor[:tokenizer.vocab_size], original[name][:tokenizer.vocab_size])
            assert not tensor[tokenizer.vocab_size:].any()
        else:
            torch.testing.assert_close(tensor, original[name], rtol=0, atol=0)
    # Exporting the import again gives the same Hugging Face weights.
    again = export_hf(root / "imported", root / "hf3")
    from safetensors.torch import load_file
    first, second = load_file(str(hf_dir / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_refusals(saved, tmp_path):
    root, _, _ = saved
    with pytest.raises(ConfigError, match="already exists and is not empty"):
        export_hf(root / "ckpt", root / "tok")
    with pytest.raises(ConfigError, match="does not exist"):
        export_hf(tmp_path / "missing", tmp_path / "out")
    hf_dir = export_hf(root / "ckpt", tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "activation_function": "relu"}))
    with pytest.raises(ConfigError, match="activation_function 'relu'"):
        import_hf(hf_dir, tmp_path / "imp")
    (hf_dir / "config.json").write_text(json.dumps(config))
    (hf_dir / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="pickled pytorch_model.bin files are not read"):
        import_hf(hf_dir, tmp_path / "imp")
    assert not (tmp_path / "imp").exists()


def test_an_output_that_is_or_holds_the_input_is_refused_and_nothing_is_deleted(saved, tmp_path):
    root, _, _ = saved
    hf_dir = export_hf(root / "ckpt", tmp_path / "models" / "hf")
    (tmp_path / "models" / "notes.txt").write_text("unrelated")
    before = sorted(p.name for p in hf_dir.iterdir())
    for output in (hf_dir, tmp_path / "models"):  # the input itself, or a folder holding it
        with pytest.raises(ConfigError, match=f"--output {output} is or contains --input {hf_dir}"):
            import_hf(hf_dir, output, overwrite=True)
    assert sorted(p.name for p in hf_dir.iterdir()) == before and (tmp_path / "models" / "notes.txt").exists()
    with pytest.raises(ConfigError, match="is or contains --load"):
        export_hf(root / "ckpt", root / "ckpt", overwrite=True)
    assert wio.resolve_checkpoint_dir(root / "ckpt").is_dir()


def test_published_folders_are_readable_by_others_per_the_umask(saved, tmp_path):
    import os
    import stat

    root, _, _ = saved
    previous = os.umask(0o022)
    try:
        exported = export_hf(root / "ckpt", tmp_path / "hf")
        imported = import_hf(exported, tmp_path / "imported")
    finally:
        os.umask(previous)
    for folder in (exported, tmp_path / "imported", imported):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o755, folder
