"""Autoregressive text generation with a KV cache, on one process or tensor-parallel.

The prompt is run once to fill the cache; after that each new token costs a forward pass over one
position. Every TP rank runs the same loop: logits are gathered over the vocabulary, the token is chosen
from a generator seeded identically on every rank, and TP rank 0's choice is broadcast so that all ranks
always feed the same token.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from domino.config import ConfigError
from domino.eval.sampling import SamplingConfig, sample_next_token
from domino.parallel.collectives import MeshGroup, gather_from_tp_region

if TYPE_CHECKING:  # the checkpoint package is imported where a checkpoint is read
    from domino.checkpoint.on_disk import Checkpoint

logger = logging.getLogger(__name__)


@dataclass
class Generation:
    """The result of :func:`generate`.

    Attributes:
        token_ids: the new tokens (the prompt excluded; an end-of-document token that stopped
            generation is included).
        text: ``token_ids`` decoded (without the end-of-document token).
        prompt_ids: the prompt.
        stopped_at_eod: whether generation ended on the end-of-document token.
    """

    token_ids: List[int]
    text: str
    prompt_ids: List[int] = field(default_factory=list)
    stopped_at_eod: bool = False

    def to_json(self) -> Dict[str, Any]:
        """The JSON object ``domino generate --json`` prints."""
        return asdict(self)


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _num_positions(model: torch.nn.Module) -> Optional[int]:
    config = getattr(model, "config", None)
    return getattr(config, "num_positions", None)


def _full_vocab_logits(model: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """The last position's logits over the whole (padded) vocabulary, on every TP rank."""
    last = logits[:, -1, :].float().contiguous()
    return gather_from_tp_region(last, model.tp) if getattr(model, "parallel_output", True) else last


def _broadcast_from_tp_src(token: torch.Tensor, tp: MeshGroup) -> torch.Tensor:
    """The first TP rank's sampled token on every rank of ``tp``, so every rank feeds the same token on."""
    if tp.size > 1:
        dist.broadcast(token, src=tp.first_rank, group=tp.process_group)
    return token


@torch.no_grad()
def generate_ids(
    model: torch.nn.Module,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: Optional[SamplingConfig] = None,
    seed: int = 0,
    eod: Optional[int] = None,
    vocab_size: Optional[int] = None,
    use_cache: bool = True,
) -> List[int]:
    """Generates up to ``max_new_tokens`` ids after ``prompt_ids``; returns only the new ids.

    Args:
        model: a ``GPTModel`` (any TP size; vocab-parallel or full logits).
        prompt_ids: the prompt, at least one token.
        max_new_tokens: how many tokens to generate at most.
        sampling: greedy or sampling settings (default: greedy).
        seed: seeds the sampling generator (same seed, same tokens).
        eod: stop after generating this token (included in the result).
        vocab_size: the tokenizer's real vocabulary; padding ids beyond it are never generated.
        use_cache: run one position per new token with a KV cache (``False`` re-runs the whole
            sequence each step: the slow reference the cache is tested against).

    Raises:
        ConfigError: on an empty prompt, a prompt id outside ``[0, vocab_size)``, or a sequence longer than the
            model's position embeddings.
    """
    sampling = sampling or SamplingConfig(greedy=True)
    sampling.check()
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ConfigError("the prompt is empty: give --prompt text or --prompt-ids")
    outside = [t for t in prompt if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if outside:  # the embedding would raise a bare IndexError, or read a padding row the tokenizer never made
        raise ConfigError(f"--prompt-ids: id {outside[0]} is outside the vocabulary "
                          f"[0, {vocab_size if vocab_size is not None else 'inf'})")
    if max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    limit = _num_positions(model)
    if limit is not None and len(prompt) + max_new_tokens > limit:
        raise ConfigError(f"prompt ({len(prompt)} tokens) + --max-new-tokens {max_new_tokens} exceeds the "
                          f"model's {limit} positions")
    was_training = model.training
    model.eval()
    device = _model_device(model)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    tokens = torch.tensor([prompt], dtype=torch.long, device=device)
    cache = model.new_kv_cache() if use_cache else None
    step_input, start = tokens, 0
    new: List[int] = []
    try:
        for _ in range(max_new_tokens):
            positions = torch.arange(start, start + step_input.size(1), device=device).unsqueeze(0)
            logits = _full_vocab_logits(model, model(step_input, position_ids=positions, kv_cache=cache))
            if vocab_size is not None:
                logits = logits[:, :vocab_size]
            token = _broadcast_from_tp_src(sample_next_token(logits, sampling, generator), model.tp)
            new.append(int(token.item()))
            if eod is not None and new[-1] == eod:
                break
            tokens = torch.cat([tokens, token.view(1, 1)], dim=1)
            if use_cache:
                step_input, start = token.view(1, 1), tokens.size(1) - 1
            else:
                step_input = tokens
    finally:
        model.train(was_training)
    return new


def generate(
    model: torch.nn.Module,
    tokenizer,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: Optional[SamplingConfig] = None,
    seed: int = 0,
    use_cache: bool = True,
    stop_at_eod: bool = True,
) -> Generation:
    """Generates a continuation of ``prompt_ids`` and decodes it with ``tokenizer``.

    See :func:`generate_ids` for the arguments; ``stop_at_eod`` stops at the tokenizer's
    end-of-document token.
    """
    eod = tokenizer.eod if stop_at_eod else None
    ids = generate_ids(model, prompt_ids, max_new_tokens, sampling=sampling, seed=seed, eod=eod,
                       vocab_size=tokenizer.vocab_size, use_cache=use_cache)
    stopped = eod is not None and bool(ids) and ids[-1] == eod
    text = tokenizer.decode(ids[:-1] if stopped else ids)
    return Generation(token_ids=ids, text=text, prompt_ids=list(prompt_ids), stopped_at_eod=stopped)


def generate_samples(
    model_or_load: Union[torch.nn.Module, str, os.PathLike, "Checkpoint"],
    prompts: Sequence[str],
    max_new_tokens: int,
    tokenizer=None,
    sampling: Optional[SamplingConfig] = None,
    seed: int = 0,
) -> List[Dict[str, str]]:
    """Continuations of text prompts, as ``{"prompt", "completion"}`` dicts (for the report).

    Args:
        model_or_load: a ``GPTModel`` (then ``tokenizer`` is required), or a checkpoint path or an opened
            ``Checkpoint``, loaded on this process alone (TP=1) with its own tokenizer.
        prompts: prompt texts; an empty prompt starts from the end-of-document token.
        max_new_tokens: tokens per continuation (fewer if the model ends the document, or if the
            model's positions run out).
        tokenizer: the tokenizer, when ``model_or_load`` is a model.
        sampling: how tokens are chosen (default: greedy).
        seed: sampling seed of the first prompt (the i-th prompt uses ``seed + i``).
    """
    if isinstance(model_or_load, torch.nn.Module):
        model = model_or_load
        if tokenizer is None:
            raise ConfigError("generate_samples needs the tokenizer along with a model")
    else:
        from domino.checkpoint.model_loading import build_model_from_checkpoint

        model, _, checkpoint_tokenizer = build_model_from_checkpoint(model_or_load)
        tokenizer = tokenizer or checkpoint_tokenizer
    limit = _num_positions(model)
    samples = []
    for index, prompt in enumerate(prompts):
        ids = tokenizer.encode(prompt) or [tokenizer.eod]
        if limit is not None:
            ids = ids[-(limit - 1):]
        budget = max_new_tokens if limit is None else max(0, min(max_new_tokens, limit - len(ids)))
        result = generate(model, tokenizer, ids, budget, sampling or SamplingConfig(greedy=True), seed=seed + index)
        samples.append({"prompt": prompt, "completion": result.text})
    return samples
