"""Mutation check: plausible one-line bugs, each applied to a temporary copy of the repository, must make the
tests that target that file fail. Not part of `make test` (pytest collects only ``test_*.py``).

    python tests/mutations/run.py                  # every mutation, prints the table
    python tests/mutations/run.py --only ce-skips-global-max --json out.json
    python tests/mutations/run.py --list

Each mutation names an exact source snippet, its replacement, and the pytest node ids that must catch it.
The repository is copied (sources and tests only) to a temporary folder, the snippet is replaced there, and
only the named tests run, with ``PYTHONPATH`` pointing at the copy. A snippet that no longer occurs exactly
once is reported as ``stale`` (the code moved on: update the mutation). Exit status 0 only when every
mutation was caught. docs/testing.md holds the last table and how to add a mutation.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence

REPO = Path(__file__).resolve().parents[2]
COPIED = ("domino", "components", "pipelines", "tests", "k8s", "conftest.py", "pyproject.toml", "README.md",
          "Dockerfile", ".dockerignore", "Makefile")


@dataclass(frozen=True)
class Mutation:
    """One plausible bug: replace ``old`` (exactly one occurrence) in ``path`` by ``new``."""

    name: str
    path: str
    old: str
    new: str
    tests: Sequence[str]
    """pytest node ids (files, ``file::test``, or ``file::test[param]``) that must fail on the mutant."""


MUTATIONS: List[Mutation] = [
    Mutation("atomic-write-in-place", "domino/atomic_files.py",
             "    temporary, handle = open_owned_temporary(path, mode)\n    try:",
             "    temporary, handle = path, open(path, mode)\n    try:",
             ["tests/test_atomic_files.py"]),
    Mutation("checkpoint-latest-before-rename", "domino/checkpoint/checkpointing.py",
             "    os.replace(tmp, final)\n    fsync_directory(root)\n"
             "    on_disk.write_latest(root, tag)\n",
             "    on_disk.write_latest(root, tag)\n"
             "    os.replace(tmp, final)\n    fsync_directory(root)\n",
             ["tests/checkpoint/test_checkpoint_commit.py"]),
    Mutation("checkpoint-prune-before-latest", "domino/checkpoint/checkpointing.py",
             "    on_disk.write_latest(root, tag)\n"
             "    _prune(root, config.checkpoint.keep_last, keep=tag, iteration=iteration)\n",
             "    _prune(root, config.checkpoint.keep_last, keep=tag, iteration=iteration)\n"
             "    on_disk.write_latest(root, tag)\n",
             ["tests/checkpoint/test_checkpoint_commit.py"]),
    Mutation("async-save-commits-before-every-part-is-durable", "domino/checkpoint/async_save.py",
             "        flag = torch.tensor([1 if self._pending.done.is_set() else 0], dtype=torch.int32)",
             "        flag = torch.tensor([1], dtype=torch.int32)",
             ["tests/checkpoint/test_async_save.py"]),
    Mutation("async-save-two-in-flight", "domino/checkpoint/async_save.py",
             "        self.wait()  # at most one save in flight\n", "",
             ["tests/checkpoint/test_async_save.py"]),
    Mutation("async-save-sigterm-exits-without-waiting", "domino/train/trainer.py",
             "                self._committed(self.saver.wait())  # the save in flight is committed before the process "
             "exits\n", "",
             ["tests/checkpoint/test_resume.py::test_sigterm_saves_and_the_restart_continues_exactly"]),
    Mutation("async-save-training-ends-without-waiting", "domino/train/trainer.py",
             "        self._committed(self.saver.wait())  # an asynchronous final save is written while the model is "
             "evaluated\n", "",
             ["tests/checkpoint/test_async_save.py"]),
    Mutation("async-save-forgets-a-ranks-write-error", "domino/checkpoint/async_save.py",
             "                pending.error = checkpointing.own_failure(caught)\n",
             "                pending.error = None\n",
             ["tests/checkpoint/test_async_save.py::"
              "test_a_background_write_failing_on_one_rank_stops_every_rank_with_one_line"]),
    Mutation("checkpoint-rng-not-restored", "domino/checkpoint/resume.py",
             "    if not c.no_load_rng and _same_layout(meta, mesh):\n        rng = torch.load(",
             "    if False:\n        rng = torch.load(",
             ["tests/checkpoint/test_checkpoint_commit.py"]),
    Mutation("ce-skips-global-max", "domino/parallel/cross_entropy.py",
             "    global_max = all_reduce_max_(local_max.clone(), tp)", "    global_max = local_max.clone()",
             ["tests/parallel/test_parallel_cross_entropy.py::"
              "test_huge_logits_split_over_ranks_match_f_cross_entropy_on_the_gathered_logits[2]"]),
    Mutation("promote-on-missing-decision", "components/promote/step.py",
             '    verdict = decision.get("promote")', '    verdict = decision.get("promote", True)',
             ["tests/components/test_component_registry_gate.py"]),
    Mutation("gate-equal-perplexity-promotes", "components/evaluate/step.py",
             "    if new_ppl < threshold:", "    if new_ppl <= threshold:",
             ["tests/components/test_component_registry_gate.py"]),
    Mutation("collectives-copy-backward-no-all-reduce", "domino/parallel/collectives.py",
             "        return all_reduce_(grad.contiguous(), ctx.group, kind=\"all-reduce bwd\"), None",
             "        return grad.contiguous(), None",
             ["tests/parallel/test_parallel_collectives.py"]),
    Mutation("domino-reads-sum-before-wait", "domino/overlap/steps.py",
             "        self.handle.wait()  # wait for the all-reduce launched in __init__: its sum is read right here\n"
             "        return bias_dropout_add(self.partial, self.bias, residual, layer.hidden_dropout, layer.training,\n"
             "                                layer.kernels)",
             "        out = bias_dropout_add(self.partial, self.bias, residual, layer.hidden_dropout, layer.training,\n"
             "                               layer.kernels)\n"
             "        self.handle.wait()\n        return out",
             ["tests/model/test_model_domino_schedule.py::test_every_sum_is_read_only_after_its_wait"]),
    Mutation("sequence-parallel-linear-keeps-the-gathered-sequence", "domino/overlap/slots.py",
             "        return self.part\n\n    def restore(self, kept: torch.Tensor) -> Callable[[], torch.Tensor]:\n"
             "        \"\"\"Launches the all-gather of the kept slice; returns a callable that waits and returns the "
             "sequence.\"\"\"\n",
             "        return x\n\n    def restore(self, kept: torch.Tensor) -> Callable[[], torch.Tensor]:\n"
             "        return lambda: kept\n",
             ["tests/model/test_model_sequence_parallel.py::"
              "test_sequence_parallel_keeps_less_per_rank_and_trains_with_dropout"]),
    Mutation("sample-index-document-off-by-one", "domino/data/sample_index.py",
             'holder = np.searchsorted(ends, positions, side="right")',
             'holder = np.searchsorted(ends, positions, side="left")',
             ["tests/data/test_data_sample_index.py"]),
    Mutation("blending-ties-go-to-the-last-dataset", "domino/data/blending.py",
             "            if error > best_error:", "            if error >= best_error:",
             ["tests/data/test_data_gpt_dataset.py"]),
    Mutation("launcher-failed-job-counts-as-success", "domino/launch/kube_backend.py",
             '        if tracker.phase == "Succeeded":', '        if tracker.phase in ("Succeeded", "Failed"):',
             ["tests/launch/test_launch_kube.py"]),
    Mutation("manifest-checks-sizes-only", "domino/checkpoint/manifest.py",
             "        if actual != expected:", "        if actual[\"size\"] != expected[\"size\"]:",
             ["tests/checkpoint/test_checkpoint_integrity.py::test_manifest_records_and_detects"]),
    Mutation("launcher-deletes-failed-jobs", "domino/launch/outcome.py",
             "        return succeeded or stopped", "        return True",
             ["tests/launch/test_launch_kube.py"]),
    Mutation("step-reads-loss-on-host", "domino/train/trainer.py",
             '            iteration_loss += stats["lm loss"].detach()',
             '            iteration_loss += float(stats["lm loss"])',
             ["tests/train/test_host_syncs.py::test_tp2_domino_iterations_read_nothing_on_the_host"]),
    Mutation("bf16-step-never-skips", "domino/optim/bf16_step.py",
             "    self.optimizer.found_inf = self.found_inf", "    self.optimizer.found_inf = None",
             ["tests/train/test_device_decided_steps.py::test_bf16_zero1_step_equals_deepspeeds_clipped_or_not"]),
    Mutation("zero-step-unscales-with-the-updated-scale", "domino/optim/zero_step.py",
             "    prev_scale = prev_scale.clone() if isinstance(prev_scale, torch.Tensor) else prev_scale",
             "    prev_scale = prev_scale",
             ["tests/train/test_device_decided_steps.py::"
              "test_fp16_zero1_loss_scaling_on_the_device_equals_deepspeeds"]),
    Mutation("zero-step-skips-per-pipeline-stage", "domino/optim/zero_step.py",
             "    if pp.size > 1:",
             "    if False:",
             ["tests/train/test_pipeline_stages_agree.py"]),
    Mutation("second-writer-never-waits", "domino/checkpoint/save_root.py",
             "            held = try_lock_descriptor(self._descriptor)",
             "            held = try_lock_descriptor(self._descriptor) or True",
             ["tests/checkpoint/test_save_root_lock.py", "tests/checkpoint/test_leftover_sweep.py"]),
    Mutation("holder-never-sweeps", "domino/checkpoint/save_root.py",
             "        leftovers.sweep(self.root, self.token if self.carried else \"\")",
             "        pass",
             ["tests/checkpoint/test_checkpoint_commit.py", "tests/checkpoint/test_leftover_sweep.py"]),
    Mutation("live-read-never-rereads", "domino/checkpoint/live_reads.py",
             "    return now.name if deleted or through_root else None",
             "    return None",
             ["tests/checkpoint/test_live_reads.py"]),
    Mutation("trainjob-status-token-read-once", "domino/tracking/trainer_status.py",
             "    with open(endpoint.token) as f:\n        token = f.read().strip()\n",
             "    token = post.__dict__.setdefault(\"token\", open(endpoint.token).read().strip())\n",
             ["tests/tracking/test_trainer_status.py::test_the_poster_sends_the_newest_figures_paced_and_reads_the_rotated_token"]),
    Mutation("trainjob-status-unpaced", "domino/tracking/trainer_status.py",
             "                self._next_at = self._clock() + self.interval_s\n",
             "                self._next_at = self._clock()\n",
             ["tests/tracking/test_trainer_status.py::test_the_poster_sends_the_newest_figures_paced_and_reads_the_rotated_token"]),
    Mutation("trainjob-status-warns-every-failure", "domino/tracking/trainer_status.py",
             "        if self._warned_at is not None and now - self._warned_at < REPEAT_WARNING_S:\n",
             "        if False:\n",
             ["tests/tracking/test_trainer_status.py::test_a_failing_server_is_said_once_and_backed_off"]),
    Mutation("trainjob-status-fractional-progress", "domino/tracking/trainer_status.py",
             "100 * iteration // max(train_iters, 1)",
             "100 * iteration / max(train_iters, 1)",
             ["tests/tracking/test_trainer_status.py::test_a_record_becomes_a_status_the_trainer_accepts"]),
    Mutation("temporary-directory-shared-by-writers", "domino/checkpoint/checkpointing.py",
             '    return root, tag, root / f".tmp-{tag}.{writer}", root / tag',
             '    return root, tag, root / f".tmp-{tag}", root / tag',
             ["tests/checkpoint/test_save_root_lock.py::"
              "test_a_sigkilled_holder_holds_nothing_the_next_run_takes_the_root_at_once"]),
    Mutation("snapshot-copy-failure-leaves-its-peers-waiting", "domino/checkpoint/checkpointing.py",
             "        except Exception as error:  # noqa: BLE001  (re-raised below)",
             "        except ZeroDivisionError as error:",
             ["tests/train/test_pipeline_stages_agree.py"]),
    Mutation("chunked-loss-forgets-the-one-hot", "domino/parallel/chunked_cross_entropy.py",
             "-inside.to(probs.dtype).unsqueeze(-1))  # minus the one-hot",
             "0 * inside.to(probs.dtype).unsqueeze(-1))",
             ["tests/parallel/test_parallel_chunked_cross_entropy.py::"
              "test_chunked_equals_the_one_buffer_loss_and_f_cross_entropy_in_fp32[5]"]),
    Mutation("resume-drops-the-checkpoints-padding", "domino/checkpoint/resume.py",
             "    kept = config.replace(make_vocab_size_divisible_by=divisor)\n", "    kept = config\n",
             ["tests/checkpoint/test_vocab_padding_resume.py"]),
    Mutation("schedule-change-not-checked", "domino/train/schedule_check.py",
             "    diffs = _differences(stored, schedule, config, data_parallel_size)", "    diffs = []",
             ["tests/checkpoint/test_schedule_record.py"]),
    Mutation("per-tensor-names-unchecked", "domino/checkpoint/tools.py",
             "            on_disk.check_file_name(name,", "            (name,",
             ["tests/checkpoint/test_hostile_names.py::"
              "test_convert_per_tensor_refuses_a_name_that_would_leave_the_output"]),
    Mutation("checkpoints-ordered-by-name", "domino/checkpoint/discovery.py",
             "n is not None and (below is None or n < below))[::-1]]",
             "n is not None and (below is None or p.name < tag))[::-1]]",
             ["tests/checkpoint/test_hostile_names.py::test_checkpoints_past_ten_million_iterations_order_by_number"]),
    Mutation("segment-attention-dropout-on-the-default-stream", "domino/model/segments.py",
             "tp_dropout=draws_tp_dropout(attention))", "tp_dropout=False)",
             ["tests/model/test_model_compiled_segments.py::"
              "test_attention_dropout_in_a_segment_draws_the_tp_stream"]),
    Mutation("context-parallel-block-compiled-whole", "domino/model/stack.py",
             "                                model.tp.size > 1 or model.cp.size > 1, model.kernels)",
             "                                model.tp.size > 1, model.kernels)",
             ["tests/model/test_model_compiled_segments.py::test_context_parallel_blocks_are_not_compiled_whole"]),
]


def copy_repository(destination: Path) -> None:
    """Copies what the tests need (no .git, virtual environment or caches) to ``destination``."""
    ignore = shutil.ignore_patterns("__pycache__", ".pytest_cache", "*.egg-info", "build")
    for name in COPIED:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, destination / name, ignore=ignore)
        elif source.exists():
            shutil.copy2(source, destination / name)


def stale_reason(mutation: Mutation, root: Path = REPO) -> str:
    """Why ``mutation`` cannot be applied under ``root`` (its snippet is not there exactly once, or a named test
    file is gone), or "" when it can."""
    found = (root / mutation.path).read_text().count(mutation.old)
    if found != 1:
        return f"snippet found {found} times in {mutation.path}"
    missing = [node for node in mutation.tests if not (root / node.split("::")[0]).is_file()]
    return f"no test file for {', '.join(missing)}" if missing else ""


def run_one(mutation: Mutation, timeout: float) -> dict:
    """Applies ``mutation`` in a fresh copy, runs its tests; returns a row of the table."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutation.name}-") as tmp:
        copy = Path(tmp) / REPO.name
        copy.mkdir()
        copy_repository(copy)
        # Tests read ../shared (the CRD schemas, the upstream manifests the fake API server is modelled on), as
        # CI's clone does: without it they would fail by crashing and count a mutant as caught.
        if (REPO.parent / "shared").is_dir():
            os.symlink(REPO.parent / "shared", Path(tmp) / "shared")
        target = copy / mutation.path
        stale = stale_reason(mutation, copy)
        if stale:
            return {"mutation": mutation.name, "caught": "stale", "by": stale,
                    "seconds": round(time.perf_counter() - started, 1)}
        target.write_text(target.read_text().replace(mutation.old, mutation.new))
        env = {**os.environ, "PYTHONPATH": str(copy), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rf",
                   *mutation.tests]
        try:
            proc = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
            output, code = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as expired:
            output, code = f"{expired.stdout or ''}", -1
    failed = re.findall(r"^FAILED (\S+)", output, flags=re.M)
    errors = re.findall(r"^ERROR (\S+)", output, flags=re.M)
    if code == 0:
        caught, by = "NOT CAUGHT", "every targeted test passed"
    elif code == -1:
        caught, by = "timeout", f"no verdict within {timeout:.0f} s"
    elif failed:
        caught, by = "caught", failed[0]
    elif errors:  # a test that could not even start (collection, fixture) is no verdict on the mutant
        caught, by = "error", errors[0]
    else:
        caught, by = "caught", f"pytest exit {code}: " + (output.strip().splitlines() or [""])[-1][:80]
    return {"mutation": mutation.name, "caught": caught, "by": by, "seconds": round(time.perf_counter() - started, 1)}


def table(rows: List[dict]) -> str:
    """A Markdown table of ``rows``."""
    lines = ["| mutation | caught | by which test | seconds |", "| --- | --- | --- | ---: |"]
    lines += [f"| {r['mutation']} | {r['caught']} | `{r['by']}` | {r['seconds']:.1f} |" for r in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutations")
    parser.add_argument("--list", action="store_true", help="list the mutations and their tests, run nothing")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON to FILE")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per mutation (default 900)")
    args = parser.parse_args(list(argv))
    chosen = MUTATIONS
    if args.only:
        unknown = sorted(set(args.only) - {m.name for m in MUTATIONS})
        if unknown:
            parser.error(f"--only: unknown mutation(s) {', '.join(unknown)}; see --list")
        chosen = [m for m in MUTATIONS if m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name:45s} {m.path:35s} {' '.join(m.tests)}")
        return 0
    rows = []
    for mutation in chosen:
        rows.append(run_one(mutation, args.timeout))
        print(f"{rows[-1]['mutation']}: {rows[-1]['caught']} ({rows[-1]['by']}, {rows[-1]['seconds']:.1f} s)",
              file=sys.stderr, flush=True)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(r["caught"] == "caught" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
