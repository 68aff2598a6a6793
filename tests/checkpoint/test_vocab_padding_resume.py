"""Resume on another TP size with the default GPT-2 tokenizer and no extra flag (issue 36, item 3), real gloo ranks.

GPT-2's 50,257 ids pad to 50,432 rows at TP 2 and 50,304 at TP 1 (``--make-vocab-size-divisible-by 128`` x TP, as
Megatron pads). A TP 2 checkpoint resumed at TP 1 keeps its 50,432 rows, so it continues the TP 2 run's losses
(fp32, no dropout: within 1e-4 relative, the elastic-resume tolerance); the layout comes from
``--parallel-layout derive`` on one pod of two processes, so that path needs no flag either. There the run is
DP 2 where the checkpoint was DP 1 ZeRO 0: it runs ZeRO 1, what ``domino estimate`` and ``derive`` assume, and says
so in one line. A checkpoint whose rows the new TP cannot split (``--make-vocab-size-divisible-by 1``: 50,257 rows
at TP 1, resumed at TP 2) is re-padded: the real rows of the weights and of every optimizer tensor are the
checkpoint's, the padding rows zero.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpoint.test_elastic_resume import _probe
from train.train_helpers import run_pretrain, train_losses

from domino.checkpoint import fragment_io, on_disk
from domino.launch import JobSpec
from domino.launch.parallel_layout import layout_flags

# No --vocab-size: the mock data and the model take the default GPT-2 tokenizer's vocabulary (offline package).
RUN = ["--preset", "tiny", "--mock-data", "--log-interval", "1", "--num-workers", "0", "--seed", "7",
       "--train-iters", "4", "--eval-iters", "0", "--eval-interval", "0", "--global-batch-size", "8",
       "--num-layers", "1"]
GPT2_VOCAB = 50257


def _save(tmp: Path, name: str, flags, nproc: int) -> Path:
    save = tmp / name
    run_pretrain([*RUN, *flags, "--save", str(save), "--save-interval", "2", "--metrics-file",
                  str(tmp / f"{name}.jsonl")], nproc=nproc, timeout=600)
    return save


@pytest.mark.timeout(900)  # five jobs of one or two processes on a loaded 2-core machine
def test_a_tp2_checkpoint_resumes_at_tp1_through_derive_and_an_unsplittable_one_is_repadded(tmp_path):
    tp2 = _save(tmp_path, "tp2", ["--tensor-model-parallel-size", "2"], nproc=2)
    assert on_disk.read_checkpoint_meta(tp2 / "iter_0000002")["padded_vocab_size"] == 50432
    reference = train_losses(tmp_path / "tp2.jsonl")

    # The re-admitted job on one pod of two processes: derive appends the TP flag, nothing else.
    spec = JobSpec(name="gpt", image="i", nodes=1, nproc_per_node=2, pretrain_args=list(RUN),
                   parallel_layout="derive")
    derived = layout_flags(spec)
    assert derived == ["--tensor-model-parallel-size", "1"]
    metrics = tmp_path / "tp1.jsonl"
    proc = run_pretrain([*RUN, *derived, "--load", str(tp2 / "iter_0000002"), "--save", str(tmp_path / "tp1"),
                         "--metrics-file", str(metrics)], nproc=2, timeout=600)
    log = proc.stdout + proc.stderr
    assert ("padded vocabulary: keeping the checkpoint's 50432 rows at TP=1 (--make-vocab-size-divisible-by 50432;"
            " this run's padding alone gives 50304)") in log, log[-3000:]
    assert ("--zero-stage not given: 1 (2 data-parallel replicas); the checkpoint's ZeRO 0 was for DP 1" in log
            ), log[-3000:]
    resumed = train_losses(metrics)
    assert sorted(resumed) == [3, 4], resumed
    assert all(abs(resumed[i] - reference[i]) <= 1e-4 * abs(reference[i]) for i in resumed), (resumed, reference)
    saved = on_disk.read_checkpoint_meta(tmp_path / "tp1" / "iter_0000004")
    assert saved["padded_vocab_size"] == 50432 and saved["config"]["parallel"]["zero_stage"] == 1

    # 50,257 rows cannot be split over TP 2: re-padded to TP 2's own 50,432, the real rows' state the checkpoint's.
    unpadded = _save(tmp_path, "tp1-unpadded", ["--make-vocab-size-divisible-by", "1"], nproc=1)
    ckpt = unpadded / "iter_0000002"
    flags = [*RUN, "--tensor-model-parallel-size", "2"]
    held = _probe(tmp_path, unpadded, flags, nproc=2, tag=ckpt.name)
    stored = fragment_io.read_state(on_disk.Checkpoint.read(ckpt))
    assert sorted(held) == sorted(stored)
    for name, tensor in stored.items():
        if "word_embeddings" in name:
            assert held[name].shape[0] == 50432 and tensor.shape[0] == GPT2_VOCAB, name
            assert torch.equal(held[name][:GPT2_VOCAB], tensor) and not held[name][GPT2_VOCAB:].any(), name
        else:
            assert torch.equal(held[name], tensor), name
    proc = run_pretrain([*flags, "--load", str(ckpt), "--metrics-file", str(tmp_path / "repadded.jsonl")], nproc=2,
                        timeout=600)
    assert ("the checkpoint's 50257 rows cannot be split over TP=2: re-padded to this run's 50432"
            in proc.stdout + proc.stderr), (proc.stdout + proc.stderr)[-3000:]
    assert sorted(train_losses(tmp_path / "repadded.jsonl")) == [3, 4]

