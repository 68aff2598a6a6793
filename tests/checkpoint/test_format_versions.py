"""Checkpoints of format 1 (each rank's optimizer state in ``optim/rank_NNNNN.pt``) still resume, bit for bit, on
the layout that wrote them; on another layout they are refused in one line that says how to convert them.

The format-1 checkpoint is written by the code that still can write it (the fallback for an optimizer without a
state by name, ``domino.optim.state.supports``, patched to say so), with its ``checkpoint.json`` reduced to what
format 1 held. Everything runs in one real gloo process, ``pretrain()`` called in-process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from distributed_helpers import run_distributed

ARGS = ["--preset", "tiny", "--mock-data", "--vocab-size", "256", "--log-interval", "1", "--num-workers", "0",
        "--seed", "7", "--save-interval", "2", "--eval-iters", "0", "--eval-interval", "0", "--hidden-dropout", "0.1",
        "--global-batch-size", "8"]


def _train(out: Path, name: str, iters: int, *extra: str) -> dict:
    from domino.config import parse_config
    from domino.train.gpt_recipe import GPTRecipe
    from domino.runtime.state import current_mesh
    from domino.train.pretrain import pretrain

    metrics = out / f"{name}.jsonl"
    config = parse_config([*ARGS, "--train-iters", str(iters), "--metrics-file", str(metrics), *extra])
    mesh = current_mesh()  # the one initialize_runtime built for every run of this process
    recipe = GPTRecipe(config, mesh)
    pretrain(config, recipe.model_builder, recipe.dataset_builder, recipe.forward_step, recipe.padded_vocab_size,
             recipe.tokenizer, mesh=mesh)
    return {r["iteration"]: r["lm_loss"] for r in map(json.loads, metrics.read_text().splitlines())}


def _as_format_1(ckpt: Path) -> None:
    meta = json.loads((ckpt / "checkpoint.json").read_text())
    for key in ("optimizer", "global_batch_size", "schedule"):
        del meta[key]
    meta["format_version"] = 1
    (ckpt / "checkpoint.json").write_text(json.dumps(meta))
    (ckpt / "manifest.json").unlink()  # a hand-edited checkpoint: loaded unverified, as one without a manifest


def _old_and_new(rank, world_size, out_dir):
    import pytest

    from domino.optim import state as optimizer_state
    from domino.config import ConfigError

    from domino.config import parse_config
    from domino.train.runtime_start import initialize_runtime

    initialize_runtime(parse_config(ARGS))  # once per process: every _train below is a run of this process
    out = Path(out_dir)
    reference = _train(out, "reference", 6)
    old = out / "old"
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(optimizer_state, "supports", lambda optimizer: False)
        _train(out, "old", 6, "--save", str(old), "--exit-interval", "4")  # the schedule of 6 iterations
    _as_format_1(old / "iter_0000004")
    layout = {"per_rank_files": sorted(p.name for p in (old / "iter_0000004" / "optim").iterdir())}
    moved = out / "moved"
    shutil.copytree(old, moved)
    meta = json.loads((moved / "iter_0000004" / "checkpoint.json").read_text())
    (moved / "iter_0000004" / "checkpoint.json").write_text(json.dumps({**meta, "data_parallel_size": 2}))
    resumed = _train(out, "resumed", 6, "--load", str(old), "--save", str(old))
    new_meta = json.loads((old / "iter_0000006" / "checkpoint.json").read_text())

    try:  # the copy, as if DP=2 had written it
        _train(out, "refused", 6, "--load", str(moved))
        refusal = None
    except ConfigError as error:
        refusal = str(error)
    return {"reference": reference, "resumed": resumed, "new_format": new_meta["format_version"],
            "new_optimizer": new_meta["optimizer"]["format"], "refusal": refusal, **layout}


def test_a_format_1_checkpoint_resumes_exactly_on_its_layout_and_is_refused_on_another(tmp_path):
    (report,) = run_distributed(_old_and_new, 1, str(tmp_path))
    assert report["per_rank_files"] == ["rank_00000.pt"]
    assert sorted(report["resumed"]) == [5, 6]
    assert report["resumed"] == {i: report["reference"][i] for i in (5, 6)}  # bit for bit, RNG streams included
    assert (report["new_format"], report["new_optimizer"]) == (2, "by-name")  # its next save is layout-free
    assert report["refusal"] and "\n" not in report["refusal"]
    assert ("its optimizer state is per rank (format 1), saved with TP=1 x DP=2, this run is TP=1 x DP=1; resume "
            "it once on its own layout" in report["refusal"]), report["refusal"]


def test_deepspeeds_fp16_state_without_zero_is_refused_in_one_line():
    """fp16 at ZeRO 0 saved per rank only as DeepSpeed's FP16_Optimizer, whose state domino's own ZeRO 0 cannot
    load: refused before anything is read; fp32 at ZeRO 0 (torch's AdamW then as now) still loads."""
    import pytest

    from domino.checkpoint.on_disk import Checkpoint
    from domino.checkpoint.resume import _check_per_rank
    from domino.config import ConfigError, parse_config
    from domino.runtime.mesh import ParallelMesh

    meta = {"format_version": 2, "tensor_model_parallel_size": 1, "data_parallel_size": 1,
            "config": {"parallel": {"zero_stage": 0}, "train": {"fp16": True}}}
    fp16 = parse_config([*ARGS, "--fp16", "--zero-stage", "0"])
    with pytest.raises(ConfigError, match="DeepSpeed's fp16 optimizer's at --zero-stage 0.*--no-load-optim"):
        _check_per_rank(Checkpoint(Path("old"), meta), fp16, ParallelMesh.single())
    meta["config"]["train"]["fp16"] = False
    _check_per_rank(Checkpoint(Path("old"), meta), parse_config([*ARGS, "--zero-stage", "0"]), ParallelMesh.single())
