"""Running the whole pipeline on this machine with ``kfp.local`` (what ``make demo`` does).

Every step runs as a local subprocess (``SubprocessRunner(use_venv=False)``: this environment's Python
with domino installed), the training "job" runs through the launcher's local backend (one process per
replica, with the operator's environment), and the shared volume is a folder. Everything lands under one
output folder::

    DIR/shared/runs/<run id>/{data,checkpoints,metrics.jsonl}   what the steps and the job wrote
    DIR/shared/promoted.json                                   the promotion registry
    DIR/artifacts/gpt-pretrain-<time>/<step>/...               kfp artifacts (manifests, report)
    DIR/report.html, DIR/summary.json                          the latest run's report and outcome
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from components.manifest import write_manifest
from domino.atomic_files import atomic_write
from pipelines.gpt_pretrain import PIPELINE_NAME, build_pipeline

#: ``make demo``: every setting the demo's result depends on, explicitly (the model and optimizer in the
#: ``demo`` preset). Chosen from measured loss curves on the 2-core machine: see docs/pipeline.md.
DEMO_PARAMS: Dict[str, Any] = {
    "corpus": "shakespeare", "tokenizer_vocab_size": 2048, "preset": "demo", "split": "90,5,5",
    "train_iters": 600, "micro_batch_size": 16, "global_batch_size": 16,
    "eval_interval": 100, "eval_iters": 4, "log_interval": 20,
    "nodes": 1, "nproc_per_node": 2, "tensor_model_parallel_size": 2, "domino_chunks": 2,
    "eval_batches": 40, "sample_tokens": 60,
    "sample_prompts": "Romeo.\\n|KING HENRY.\\nMy lords,|To be, or not to be|First Witch.\\n",
}
#: ``domino pipeline run --quick``: the pipeline's defaults, a ~30 s plumbing run (tiny model, GPT-2
#: tokenizer, 20 iterations) that proves every step works and learns nothing worth reading.
QUICK_PARAMS: Dict[str, Any] = {}


@dataclass
class LocalRunResult:
    """Where a local run's outputs landed, and its final numbers.

    Attributes:
        output_dir: The run's output folder.
        run_id: The pipeline run id (its folder under ``shared/runs``).
        checkpoint_dir: The trained model's checkpoint save root.
        model_manifest: The ``Model`` artifact (JSON manifest).
        report: The HTML report (copied to ``output_dir/report.html``).
        metrics_file: The training metrics (JSON lines).
        summary_file: ``summary.json`` with everything below.
        dataset: The Dataset manifest: prefix, documents, tokens, dataset_key, reused (found complete from an
            earlier run, nothing tokenised), groups, groups_tokenized.
        train: Pretrain summary: iterations, tokens_seen, final losses, tokens_per_s, mfu.
        test: Evaluation: test_loss, test_ppl, token_accuracy, incumbent_ppl, promote, reason.
        promoted: Whether the registry now names this run's model.
        seconds: Wall-clock time of the run.
    """

    output_dir: str
    run_id: str
    checkpoint_dir: str
    model_manifest: str
    report: str
    metrics_file: str
    summary_file: str
    dataset: Dict[str, Any]
    train: Dict[str, Any]
    test: Dict[str, Any]
    promoted: bool
    seconds: float

    def describe(self) -> str:
        """A short human summary: how good the model is, how to continue, and where everything is."""
        t, e = self.train, self.test
        minutes, seconds = divmod(round(self.seconds), 60)
        lines = [f"pipeline run {self.run_id} finished in {minutes} min {seconds:02d} s; outputs under {self.output_dir}"]
        lines += ["  " + line for line in self.verdict()]
        lines += [
            f"  trained {t.get('iterations')} iterations on {t.get('tokens_seen', 0):,} tokens "
            f"({_num(t.get('tokens_per_s'), ',.0f')} tokens/s); final train loss {_num(t.get('final_train_loss'))}, "
            f"valid loss {_num(t.get('final_valid_loss'))}",
            f"  dataset: {self.dataset.get('prefix')} ("
            + ("reused: same inputs and tokenizer as an earlier run" if self.dataset.get("reused") else
               f"tokenised {self.dataset.get('groups_tokenized')} of {self.dataset.get('groups')} shard groups")
            + ")",
            f"  promotion: {'PROMOTED' if self.promoted else 'not promoted'} ({e.get('reason')})",
            f"  model (checkpoint): {self.checkpoint_dir}",
            f"  HTML report:        {self.report}",
            f"  training metrics:   {self.metrics_file}",
            f"  summary:            {self.summary_file}",
        ]
        return "\n".join(lines)

    def verdict(self) -> List[str]:
        """How good the model is (against the unigram baseline of its tokenizer) and how to continue."""
        e = self.test
        ppl, unigram = e.get("test_ppl"), e.get("unigram_ppl")
        held_out = f"{e.get('test_tokens', 0):,} held-out tokens"
        if unigram and ppl < unigram:
            quality = (f"test perplexity {ppl:.1f} on {held_out}, {unigram / ppl:.1f}x lower than a unigram model "
                       f"of the same tokenizer ({unigram:.1f})")
        elif unigram:
            quality = (f"test perplexity {ppl:.1f} on {held_out}, no better than a unigram model of the same "
                       f"tokenizer ({unigram:.1f}): it has learned little beyond token frequencies")
        else:
            quality = f"test perplexity {ppl:.1f} on {held_out}"
        if e.get("sample_word_fraction") is not None:
            quality += f"; {e['sample_word_fraction']:.0%} of the sampled words are words of the corpus"
        # A prompt without line breaks, quoted for a POSIX shell: pasted, the command runs nothing but domino.
        prompts = [s["prompt"] for s in e.get("samples") or [] if "\n" not in s["prompt"]]
        prompt = (prompts or ["To be, or not to be"])[0]
        return [f"model: {quality}.",
                f"continue: domino generate --load {shlex.quote(self.checkpoint_dir)} --prompt {shlex.quote(prompt)} "
                "--max-new-tokens 100 --temperature 0.8 --top-k 40"]


def _num(value: Any, spec: str = ".4f") -> str:
    return "-" if value is None else format(float(value), spec)


def _read_json(path: str) -> Dict[str, Any]:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _new_run_folder(artifacts: str, before: List[str]) -> str:
    fresh = sorted(d for d in os.listdir(artifacts) if d.startswith(PIPELINE_NAME) and d not in before)
    if len(fresh) != 1:
        raise RuntimeError(f"expected one new pipeline run folder in {artifacts}, found {fresh}")
    return os.path.join(artifacts, fresh[0])


def run_local(output_dir: str, params: Optional[Dict[str, Any]] = None,
              log: Callable[[str], None] = print) -> LocalRunResult:
    """Runs the pipeline locally; the training job uses the launcher's local backend.

    Args:
        output_dir: Folder for everything the run writes (created; earlier runs' registry is reused, so a
            second run with ``warm_start=True`` continues from the first run's promoted model).
        params: Pipeline parameters overriding the defaults (``shared_root`` defaults to
            ``output_dir/shared`` and ``backend`` to ``local``).
        log: Receives the summary line.

    Raises:
        RuntimeError: a step failed (kfp.local names the task; its log is above).
    """
    from kfp import local

    started = time.time()
    output_dir = os.path.abspath(output_dir)
    artifacts = os.path.join(output_dir, "artifacts")
    os.makedirs(artifacts, exist_ok=True)
    values = {"shared_root": os.path.join(output_dir, "shared"), "backend": "local", **(params or {})}
    before = os.listdir(artifacts)
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=artifacts, raise_on_error=True)
    with warnings.catch_warnings():
        # The steps name the domino image; here this environment, which has domino installed, stands in.
        warnings.filterwarnings("ignore", message=".*custom or non-Python base image", category=RuntimeWarning)
        build_pipeline()(**values)
    run_folder = _new_run_folder(artifacts, before)

    model_manifest = os.path.join(run_folder, "pretrain", "model")
    train = _read_json(model_manifest)
    test = _read_json(os.path.join(run_folder, "evaluate", "decision"))
    registry_file = os.path.join(values["shared_root"], "promoted.json")
    current = (_read_json(registry_file).get("current") or {}) if os.path.exists(registry_file) else {}
    result = LocalRunResult(
        output_dir=output_dir, run_id=train["run_id"], checkpoint_dir=train["checkpoint_dir"],
        model_manifest=model_manifest, report=os.path.join(output_dir, "report.html"),
        metrics_file=train["metrics_file"], summary_file=os.path.join(output_dir, "summary.json"),
        dataset=_read_json(os.path.join(run_folder, "merge-datasets", "dataset")),
        train={k: v for k, v in train.items() if k != "config"}, test=test,
        promoted=current.get("run_id") == train["run_id"], seconds=time.time() - started,
    )
    with open(os.path.join(run_folder, "evaluate", "report"), "rb") as source, atomic_write(result.report) as out:
        shutil.copyfileobj(source, out)
    write_manifest(result.summary_file, dataclasses.asdict(result))
    log(result.describe())
    return result
