"""What the report says about a run besides its metrics: what ran, and how good the samples are.

Plain Python, no kfp; :func:`components.evaluate.step.run_evaluate` calls these. Every fact is a
sentence with its unit, and a fact the manifests do not hold is left out rather than shown empty.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple

logger = logging.getLogger(__name__)


def _count(value: Any, unit: str) -> str:
    return f"{int(value):,} {unit}"


def run_facts(model: Dict[str, Any], dataset: Dict[str, Any], test: Dict[str, Any],
              parameters: Optional[int] = None) -> List[Tuple[str, str]]:
    """The report's "what ran" rows from the pretrain and preprocess manifests and the test result.

    Args:
        model: The pretrain step's manifest (``config``, ``iterations``, ``tokens_seen``, ``world_size``, ...).
        dataset: The preprocess step's manifest (``source``, ``documents``, ``tokens``, ``tokenizer``, ...).
        test: The new model's test result (``tokens``, ``data``).
        parameters: The model's parameter count (padded vocabulary rows included), when known.
    """
    config = model.get("config") or {}
    parallel, shape = config.get("parallel") or {}, config.get("model") or {}
    rows: List[Tuple[str, str]] = []
    tp, world = parallel.get("tensor_model_parallel_size"), model.get("world_size")
    if tp and world:
        rows.append(("layout", f"{world} processes = tensor parallel {tp} x data parallel {world // tp}; "
                               f"Domino chunks {parallel.get('domino_chunks')}; ZeRO stage {parallel.get('zero_stage')}"))
    if shape:
        size = f", {parameters / 1e6:.2f} M parameters" if parameters else ""
        rows.append(("model", f"GPT, {shape['num_layers']} layers, width {shape['hidden_size']}, "
                              f"{shape['num_attention_heads']} heads, {shape['seq_length']}-token context{size}"))
    if "tokenizer" in dataset:
        rows.append(("tokenizer", f"{dataset['tokenizer']} ({_count(dataset['vocab_size'], 'tokens')})"))
    if "documents" in dataset:
        rows.append(("data", f"{dataset.get('source', dataset.get('prefix'))}: {_count(dataset['documents'], 'documents')}, "
                             f"{_count(dataset['tokens'], 'tokens')}"))
    if "iterations" in model:
        seen = f", {_count(model['tokens_seen'], 'tokens')} seen" if "tokens_seen" in model else ""
        rows.append(("training", f"{_count(model['iterations'], 'iterations')}{seen}"))
    if model.get("train_wall_s"):
        speed = f" ({model['tokens_per_s']:,.0f} tokens/s)" if model.get("tokens_per_s") else ""
        rows.append(("training wall time", f"{model['train_wall_s']:.0f} s, job start to end{speed}"))
    if test.get("tokens"):
        rows.append(("test evaluation", f"{_count(test['tokens'], 'tokens')} of the {test.get('data', 'test data')}"))
    if "checkpoint" in model or "checkpoint_dir" in model:
        rows.append(("model location", str(model.get("checkpoint") or model["checkpoint_dir"])))
    return rows


def sample_quality(checkpoint_dir: str, data_prefix: str, split: Optional[str], prompts: List[str],
                   max_new_tokens: int, sampling, seed: int) -> Dict[str, Any]:
    """Samples for the report, the share of their words found in the corpus, and the unigram baseline.

    Returns:
        ``samples`` (prompt/completion dicts), ``parameters``, ``word_fraction`` (None without words),
        ``unigram`` (the baseline result, None without a split), ``notes`` (sentences for the report).
    """
    from domino.eval.generate import generate_samples
    from domino.eval.quality import corpus_words, unigram_baseline, word_fraction
    from domino.checkpoint.model_loading import build_model_from_checkpoint

    model, _, tokenizer = build_model_from_checkpoint(checkpoint_dir)
    result: Dict[str, Any] = {"parameters": sum(p.numel() for p in model.parameters()), "notes": [],
                              "word_fraction": None, "unigram": None, "samples": []}
    if prompts:
        result["samples"] = generate_samples(model, prompts, max_new_tokens, tokenizer=tokenizer,
                                             sampling=sampling, seed=seed)
        found, total = word_fraction((s["completion"] for s in result["samples"]), corpus_words(data_prefix, tokenizer))
        how = "greedy" if sampling.greedy else f"sampled at temperature {sampling.temperature:g}, top-k {sampling.top_k}"
        share = f"; {found} of their {total} words ({found / total:.0%}) are words of the corpus" if total else ""
        result["word_fraction"] = found / total if total else None
        result["notes"].append(f"Up to {max_new_tokens} new tokens per prompt, {how}, seed {seed}{share}.")
    if split:
        result["unigram"] = unigram_baseline(data_prefix, split, tokenizer.vocab_size)
    return result
