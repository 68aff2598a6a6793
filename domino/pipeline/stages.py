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

One mechanism cuts every stage (:func:`cut_stage`): a model of the whole model's class, built empty, over the whole
model's own modules (nothing copied), registered in the whole model's order. The 1F1B stage is one such cut; the
interleaved schedule's ``v`` model chunks per rank (:class:`VirtualStages`) are ``v`` of the ``p v`` virtual stages,
and the rank's module registers their modules once by their whole-model names, so everything that reads a stage's
parameters reads a rank's chunks the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, List, Sequence, Tuple, Union

from torch import nn

from domino.model.stack import SynchronousStack

#: Attribute set (True) on the last stage's copy of the tied word embeddings (Megatron's name).
SHARED_COPY = "shared"


class StageLayers(nn.ModuleList):
    """A stage's (or model chunk's) transformer layers, indexed from 0 like any list but registered under their
    index in the whole model, which is what their parameter names carry.

    Args:
        layers: the layers, in order.
        indices: each one's index in the whole model (consecutive in a stage or chunk, not across the chunks of
            an interleaved stage).
    """

    def __init__(self, layers: Iterable[nn.Module], indices: Iterable[int]) -> None:
        nn.Module.__init__(self)
        self.indices = list(indices)
        layers = list(layers)
        if len(layers) != len(self.indices):
            raise ValueError(f"{len(layers)} layers for {len(self.indices)} indices")
        for index, layer in zip(self.indices, layers):
            self.add_module(str(index), layer)

    def _get_abs_string_index(self, idx) -> str:
        return str(self.indices[int(super()._get_abs_string_index(idx))])

    def __getitem__(self, idx: Union[int, slice]) -> Union[nn.Module, List[nn.Module]]:
        if isinstance(idx, slice):  # the layer loops iterate over slices; a plain list keeps the modules' names
            return list(self._modules.values())[idx]
        return super().__getitem__(idx)


def stage_layers(num_layers: int, num_stages: int, stage: int) -> Tuple[int, int]:
    """The ``[start, end)`` transformer layers of ``stage`` (a virtual stage, with the interleaved schedule's
    ``num_stages = p v``): ``num_layers / num_stages`` consecutive ones.

    Raises:
        ValueError: ``num_layers`` is not divisible by ``num_stages`` (checked earlier by the config validation).
    """
    if num_layers % num_stages:
        raise ValueError(f"--num-layers {num_layers} is not divisible by {num_stages} pipeline stages")
    per_stage = num_layers // num_stages
    return stage * per_stage, (stage + 1) * per_stage


def virtual_stage(stage: int, chunk: int, num_stages: int) -> int:
    """The virtual stage that ``chunk`` of pipeline rank ``stage`` is: ``chunk * p + stage``, so the virtual
    stages go round the ranks in order (Megatron's placement, ``get_transformer_layer_offset`` in
    ``megatron/core/transformer/transformer_layer.py``, and torch's ``generate_stage_to_rank_mapping(style="loop")``
    in ``torch/distributed/pipelining/_utils.py``, torch 2.13, that ``ScheduleInterleaved1F1B`` assumes)."""
    return chunk * num_stages + stage


def _tied_copy(model: nn.Module) -> nn.Module:
    """The last stage's copy of the tied word embeddings (the whole model's own module, marked shared)."""
    copy = model.embedding.word_embeddings
    setattr(copy.weight, SHARED_COPY, True)
    return copy


def split_model(model: nn.Module, stage: int, num_stages: int, virtual_stages: int = 1) -> nn.Module:
    """Cuts ``model`` (a whole ``GPTModel`` with the plain stack, before any overlap is applied) down to
    ``stage`` of ``num_stages``; returns it. At one stage it is returned unchanged. With ``virtual_stages`` v > 1
    it returns this rank's :class:`VirtualStages` (v model chunks over the whole model's modules) instead. Either
    way each stage or chunk is :func:`cut_stage`'s: a model of the same class over the whole model's modules.

    ``model`` is consumed (the stage holds its modules). Apply it right after building, before
    :mod:`domino.overlap` and :mod:`domino.model.recompute` (their stacks are built over the stage's layers; with
    chunks, over each chunk's: :func:`model_chunks`).

    Raises:
        ValueError: the model is not whole or already has an overlapped stack, or the layers do not divide evenly.
    """
    if num_stages == 1 and virtual_stages == 1:
        return model
    if not (model.pre_process and model.post_process) or not isinstance(model.stack, SynchronousStack):
        raise ValueError("split_model needs a whole GPTModel with its plain stack (split before applying overlap)")
    if virtual_stages > 1:
        if num_stages < 2:
            raise ValueError(f"{virtual_stages} virtual stages need at least 2 pipeline stages, got {num_stages}")
        cut: nn.Module = VirtualStages(model, stage, num_stages, virtual_stages)
    else:
        cut = cut_stage(model, stage, num_stages)
    # The whole model is spent: without the cycle through its stack (stack.model is the model), what no stage
    # kept (other stages' layers) is freed when the caller lets go of it, not at the next garbage collection.
    del model.stack
    return cut


def cut_stage(model: nn.Module, index: int, num_virtual_stages: int) -> nn.Module:
    """(Virtual) stage ``index`` of ``num_virtual_stages`` of the whole ``model``: a model of its class over the
    whole model's own modules (the embedding on the first, the layers of :func:`stage_layers`, the final norm and
    output layer on the last), built without a layer of its own, so nothing is copied.

    Its modules are registered in the whole model's order (embedding, layers, final norm, output layer), so its
    parameters, and with them the optimizer's groups and state, come in the order the unsplit model has them.
    """
    start, end = stage_layers(len(model.layers), num_virtual_stages, index)
    first, last = index == 0, index == num_virtual_stages - 1
    chunk = type(model)(dataclasses.replace(model.config, num_layers=0), model.vocab_size, pre_process=False,
                        post_process=False, parallel_output=model.parallel_output, tp=model.tp,
                        cp=model.cp)
    del chunk.layers  # registered again below, after the embedding: the whole model's order
    chunk.config, chunk.pre_process, chunk.post_process = model.config, first, last
    if first:
        chunk.embedding = model.embedding
    chunk.layers = StageLayers(list(model.layers)[start:end], range(start, end))
    if last:
        chunk.final_layernorm = model.final_layernorm
        chunk.output_layer = model.output_layer if hasattr(model, "output_layer") else _tied_copy(model)
    chunk.stack = SynchronousStack(chunk)
    return chunk


class VirtualStages(nn.Module):
    """One pipeline rank's model chunks of the interleaved schedule, held under the whole model's names.

    Chunk ``c`` is virtual stage :func:`virtual_stage` ``(stage, c, p)`` of ``p v``; each is a ``GPTModel`` (the
    model's class and forward) over the whole model's own modules, and this module registers those modules once,
    by their names in the whole model (``embedding`` on rank 0, ``layers.{i}`` with the whole model's ``i``,
    ``final_layernorm`` and ``output_layer`` on the last rank), so the optimizer, DeepSpeed, gradient clipping,
    the tied-embedding sum and checkpoints see one stage's parameters under the whole model's names, as with
    1F1B. The chunks are not registered (their modules are these); :meth:`train` sets their mode too.

    Args:
        model: the whole model (its modules are kept, the others dropped with it).
        stage: this rank's pipeline stage.
        num_stages: p.
        virtual_stages: v, chunks per rank.
    """

    def __init__(self, model: nn.Module, stage: int, num_stages: int, virtual_stages: int) -> None:
        super().__init__()
        total = num_stages * virtual_stages
        chunks = tuple(cut_stage(model, virtual_stage(stage, c, num_stages), total) for c in range(virtual_stages))
        self.config, self.vocab_size = model.config, model.vocab_size
        self.pre_process, self.post_process = chunks[0].pre_process, chunks[-1].post_process
        if self.pre_process:
            self.embedding = chunks[0].embedding
        self.layers = StageLayers([layer for chunk in chunks for layer in chunk.layers],
                                  [index for chunk in chunks for index in chunk.layers.indices])
        if self.post_process:
            self.final_layernorm, self.output_layer = chunks[-1].final_layernorm, chunks[-1].output_layer
        self.chunks: Tuple[nn.Module, ...] = chunks  # a tuple: not registered a second time

    def train(self, mode: bool = True) -> "VirtualStages":
        super().train(mode)
        for chunk in self.chunks:
            chunk.train(mode)
        return self

    def forward(self, *args, **kwargs):
        raise RuntimeError("an interleaved pipeline stage runs chunk by chunk on its schedule "
                           "(domino.pipeline.schedule.StageSchedule), not as one forward")


def model_chunks(module: nn.Module) -> Sequence[nn.Module]:
    """The models a rank runs: the chunks of a :class:`VirtualStages`, else the module itself (one stage, or the
    whole model). Apply sequence parallelism, Domino and recompute to each."""
    return module.chunks if isinstance(module, VirtualStages) else (module,)


def is_shared_copy(param: nn.Parameter) -> bool:
    """Whether ``param`` is the last stage's copy of the tied word embeddings (counted once, on the first stage)."""
    return bool(getattr(param, SHARED_COPY, False))


#: The name the tied embeddings have in the whole model (and in checkpoints), whichever stage holds a copy.
TIED_EMBEDDING = "embedding.word_embeddings.weight"


def stored_name(name: str, param: nn.Parameter) -> str:
    """``name`` as checkpoints store it: the last stage's tied copy is stored (and read) as the first stage's
    embeddings, so a checkpoint holds the one matrix whatever the pipeline size."""
    return TIED_EMBEDDING if is_shared_copy(param) else name
