"""A built ``GPTModel`` cut into one pipeline stage, from outside the model.

The model is built whole (so every stage holds exactly the weights the unsplit model would, whatever the pipeline
size), then each rank keeps its stage: the transformer layers divided evenly in order, the embeddings on the first
stage, the final norm and the output layer (and so the loss) on the last. This is what Megatron-LM builds per
stage (``pre_process`` / ``post_process`` and ``get_num_layers_to_build`` in NVIDIA/Megatron-LM
``megatron/core/transformer/transformer_block.py``) and what torchtitan does to a whole model
(``pipeline_module_split`` in ``torchtitan/distributed/pipeline_parallel.py``: build, then delete what another stage
owns). Building whole costs the full model's host memory once at start-up; the stage's share stays.

Tied word embeddings (the default): the last stage needs the embedding matrix as its output layer. As in Megatron
(``LanguageModule.setup_embeddings_and_output_layer`` in ``megatron/core/models/common/language_module/
language_module.py``) it holds its own copy, marked ``shared`` (Megatron's attribute: the gradient norm leaves it
out, the first stage's copy counts), and the two copies' gradients are summed over the embedding group after every
backward (Megatron's ``_allreduce_word_embedding_grads`` in ``megatron/core/distributed/finalize_model_grads.py``;
here :func:`domino.pipeline.gradients.sync_tied_embeddings`), so both take the same step and stay equal. Megatron
zeroes the copy and all-reduces it from the first stage; here both stages built the same matrix, so it is equal
from the start.

The stage keeps the model's class and forward: the first stage reads token ids and returns hidden states, the
others read hidden states (``pre_process=False``), the last returns per-token losses. Its parameters keep their
names in the whole model (``layers.{i}`` with ``i`` the layer's index in the whole model, :class:`StageLayers`, as
torchtitan keeps its ``ModuleDict`` keys), so stages' state dicts, optimizer state by name and gradients never
collide and join into the whole model's.
"""

from __future__ import annotations

from typing import Iterable, List, Tuple, Union

from torch import nn

from domino.model.stack import SynchronousStack

#: Attribute set (True) on the last stage's copy of the tied word embeddings (Megatron's name).
SHARED_COPY = "shared"


class StageLayers(nn.ModuleList):
    """A stage's transformer layers, indexed from 0 like any list but registered under their index in the whole
    model (``offset + i``), which is what their parameter names carry.

    Args:
        layers: the stage's layers, in order.
        offset: the whole model's index of the first one.
    """

    def __init__(self, layers: Iterable[nn.Module], offset: int) -> None:
        nn.Module.__init__(self)
        self.offset = offset
        for i, layer in enumerate(layers):
            self.add_module(str(offset + i), layer)

    def _get_abs_string_index(self, idx) -> str:
        return str(int(super()._get_abs_string_index(idx)) + self.offset)

    def __getitem__(self, idx: Union[int, slice]) -> Union[nn.Module, List[nn.Module]]:
        if isinstance(idx, slice):  # the layer loops iterate over slices; a plain list keeps the modules' names
            return list(self._modules.values())[idx]
        return super().__getitem__(idx)


def stage_layers(num_layers: int, num_stages: int, stage: int) -> Tuple[int, int]:
    """The ``[start, end)`` transformer layers of ``stage``: ``num_layers / num_stages`` consecutive ones.

    Raises:
        ValueError: ``num_layers`` is not divisible by ``num_stages`` (checked earlier by the config validation).
    """
    if num_layers % num_stages:
        raise ValueError(f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {num_stages}")
    per_stage = num_layers // num_stages
    return stage * per_stage, (stage + 1) * per_stage


def split_model(model: nn.Module, stage: int, num_stages: int) -> nn.Module:
    """Cuts ``model`` (a whole ``GPTModel`` with the plain stack, before any overlap is applied) down to
    ``stage`` of ``num_stages``, in place; returns it. At one stage it is returned unchanged.

    Apply it right after building, before :mod:`domino.overlap` and :mod:`domino.model.recompute` (their stacks
    are built over the stage's layers).

    Raises:
        ValueError: the model is not whole or already has an overlapped stack, or the layers do not divide evenly.
    """
    if num_stages == 1:
        return model
    if not (model.pre_process and model.post_process) or not isinstance(model.stack, SynchronousStack):
        raise ValueError("split_model needs a whole GPTModel with its plain stack (split before applying overlap)")
    start, end = stage_layers(len(model.layers), num_stages, stage)
    first, last = stage == 0, stage == num_stages - 1
    model.layers = StageLayers(list(model.layers)[start:end], start)
    if not last:
        del model.final_layernorm
        if hasattr(model, "output_layer"):
            del model.output_layer
    elif not first and not hasattr(model, "output_layer"):  # tied: the last stage keeps a copy of the embeddings
        model.output_layer = model.embedding.word_embeddings
        setattr(model.output_layer.weight, SHARED_COPY, True)
    if not first:
        del model.embedding
    model.pre_process, model.post_process = first, last
    model.stack = SynchronousStack(model)
    return model


def is_shared_copy(param: nn.Parameter) -> bool:
    """Whether ``param`` is the last stage's copy of the tied word embeddings (counted once, on the first stage)."""
    return bool(getattr(param, SHARED_COPY, False))
