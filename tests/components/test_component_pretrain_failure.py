"""The pretrain step when its training job fails: PretrainFailed naming the job, its exit code and the last
log lines; no model manifest is written. A real local job (the launcher's local backend) that fails on a
corrupt dataset index."""

import pytest

from components.manifest import write_manifest
from components.pretrain.step import PretrainFailed, PretrainSettings, run_pretrain


def test_a_failing_job_raises_pretrain_failed_with_exit_code_and_log_tail(tmp_path):
    prefix = tmp_path / "data" / "corpus_text_document"
    prefix.parent.mkdir()
    prefix.with_suffix(".bin").write_bytes(b"\x00" * 64)
    prefix.with_suffix(".idx").write_bytes(b"not an MMIDIDX index at all")
    dataset = tmp_path / "dataset.json"
    write_manifest(str(dataset), {"prefix": str(prefix)})
    settings = PretrainSettings(shared_root=str(tmp_path / "shared"), run_id="failing-run", backend="local",
                                nproc_per_node=1, tensor_model_parallel_size=1, domino_chunks=1, train_iters=2,
                                eval_iters=0, eval_interval=0, job_timeout_s=600)
    model = tmp_path / "model.json"
    lines = []
    with pytest.raises(PretrainFailed) as failure:
        run_pretrain(settings, str(dataset), str(model), log=lines.append)
    message = str(failure.value)
    assert message.startswith("job gpt-pretrain-failing-run: Failed (exit code 1)"), message
    # OnFailure (the default, docs/cluster.md "Restarts"): restarted until the backoff limit (3 x nodes), then failed.
    assert "BackoffLimitExceeded" in message and "3 restart(s) reached backoffLimit 3" in message, message
    assert "log lines of the master" in message, message
    assert f"{prefix}.idx: truncated header" in "\n".join(lines)  # the cause reached the step's log
    assert not model.exists()
