"""Which implementation of an op runs on which device: the one place that decides.

Nine ops have more than one implementation of the same maths: one tuned for CPUs (measured in
``benchmarks/model_step.py``), one for CUDA GPUs, and the plain one to read first (``PLAIN_KERNELS``: the textbook
formula of every op, no buffer tricks, nothing compiled; ``DOMINO_KERNELS=plain`` runs it on every device). Each op
takes the table of the module that calls it (:func:`resolve`: its module's, else :func:`kernels_for` its input's
device) at its one call site and takes the branch it is told:

==========================  ===========================================  =============================================
op                          CPU (``CPU_KERNELS``)                        CUDA (``CUDA_KERNELS``)
==========================  ===========================================  =============================================
QKV projection              three GEMMs over a ``[3, h/tp, h]`` copy of  one GEMM over the weight as stored (rows
(``model/qkv_projection``)  the weight made every forward: dense q, k,   ``[head, (q, k, v), head_dim]``), q, k, v as
                            v; MKL runs three ``h/tp``-wide GEMMs faster views of its output, as Megatron-LM's
                            than one ``3 h/tp``-wide one                 ``SelfAttention.get_query_key_value_tensors``
                                                                         (``megatron/core/transformer/attention.py``):
                                                                         no weight copy kept for backward
logits buffer of the fused  kept from one step to the next: a fresh      a fresh buffer every step: the caching
loss (``cross_entropy``)    ``[tokens, V/tp]`` allocation is mapped and   allocator reuses freed blocks, and a kept
                            zero-filled by the OS every step             buffer would pin that memory all step long
GeLU + fc2                  one autograd node whose backward reuses the  ``F.gelu`` then the linear: allocations are
(``parallel/layers``)       activation's buffer (no ``[tokens, ffn/tp]``  free with the caching allocator, and the
                            page faults)                                 graph can be walked twice
bias + dropout + residual   eager: two or three elementwise passes       ``torch.compile``-d into one kernel, as
(+ the next norm), SwiGLU,                                               Megatron-LM's ``jit_fuser``
RoPE (``island``)
                                                                         (``megatron/core/jit.py``: torch.compile
                                                                         for torch >= 2.2); compiling costs more
                                                                         than it saves on CPU
loss at TP=1                ``-log(softmax[target])``: no pass over the  ``logsumexp - target logit`` from a row max
(``cross_entropy``)         logits besides the softmax; one host read    and the target logit read before the
                            per micro-batch decides whether any row      softmax (the TP>1 formula): one more pass,
                            needs its log-sum-exp fallback               no host read (a read drains the GPU queue)
output layer + loss         all tokens' logits in one kept buffer (the   row chunks of ~1 GiB of fp32 logits,
(``chunked_cross_entropy``) buffer becomes softmax, then gradient)       recomputed in backward: the ``[tokens, V]``
                                                                         logits never exist whole (9 GiB at 1.3B,
                                                                         micro-batch 16); one log-softmax pass per
                                                                         chunk forward, one ``exp`` backward
LayerNorm, RMSNorm, GeLU    torch's ops: ``native_layer_norm`` and      the same ops, each one kernel; RMSNorm through
(``parallel/norms``)        ``gelu`` one kernel each; RMSNorm            ``aten::_fused_rms_norm`` (torch 2.13 has it
                            torch's composite (no CPU kernel in torch    for CUDA only)
                            2.13): the textbook ops, in fp32
per-document attention      ``segmented``: each document's slice        ``varlen``: the samples packed as one THD
(``document_attention``)    through causal SDPA (its fused CPU kernel);  sequence through FlashAttention's varlen
                            memory linear in the sequence, no ``s x s``  kernel with ``cu_seqlens`` (as Megatron-LM's
                            mask (``benchmarks/document_masks.py``)      packed sequences); not yet run on a GPU
ring attention's blocks     SDPA's fused CPU kernel through its ATen op  FlashAttention's op (fp16/bf16, GQA keys
(``ring_blocks``,           (``..._flash_attention_for_cpu``), which     unexpanded), else memory-efficient attention's
``attention_blocks``)       returns the log-sum-exp the ring merges      (keys expanded), as torch's checks allow,
                            by; with attention dropout, which it         dropout included (each block's RNG state
                            lacks, the textbook softmax                  handed back to its backward); a dense mask
                                                                         or neither: the textbook softmax; not yet
                                                                         run on a GPU
==========================  ===========================================  =============================================

The plain choice takes the textbook form of every op: one QKV GEMM over the stored weight, the norms and GeLU
written out formula by formula, GeLU then fc2, bias + dropout + residual eagerly, the loss as ``logsumexp - target logit``, and the logits computed by a linear
before a separate vocab-parallel cross-entropy (no fused output layer + loss, no kept or chunked buffer), and
per-document attention (``--reset-attention-mask``) through the dense ``[b, 1, s, s]`` mask built from the documents'
starts, Megatron's mask, handed to SDPA (:mod:`domino.parallel.document_attention`), and the ring's blocks through
the textbook softmax.

Attention's backend is left to torch on both sides, on purpose: on CUDA, SDPA already prefers cuDNN attention on
Hopper and Blackwell where the bundled cuDNN is one its developers trust (``check_prefer_cudnn_attention`` in
pytorch's ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``: cuDNN > 9.15, sm90/sm100), else FlashAttention;
forcing cuDNN first (``sdpa_kernel(..., set_priority=True)``, torch >= 2.6) would override the guard pytorch added
after the 2.5 bugs (pytorch PR #138522, issue #139298; the same reasoning closed transformers PR #48163).
``benchmarks/gpu_check.py`` records the device's cuDNN version so the choice can be read off a real run. The GPT-3
presets keep attention dropout 0.1 (domino's default) as Megatron-LM's current GPT-3 examples do: they set no
dropout flag, so Megatron's defaults, ``--attention-dropout 0.1 --hidden-dropout 0.1``, apply
(``examples/gpt3/train_gpt3_175b_distributed.sh`` at 157006d and ``train_gpt3_857m_distributed.sh`` at d60f07c;
``megatron/training/arguments.py``, ``_add_regularization_args``); its LLaMA examples, like our LLaMA presets, set
both to 0 (``examples/llama/train_llama3_8b_h100_fp8.sh`` at 157006d).

Ring attention's blocks (context parallelism) need each block's log-sum-exp, which ``F.scaled_dot_product_attention``
does not return: they call the ATen ops under it (:mod:`domino.parallel.attention_blocks`), one kernel for all of
a call's blocks (:func:`ring_block_kernel`); on CUDA, whether FlashAttention or memory-efficient attention takes the
inputs is torch's own check (:func:`cuda_attention_fits`). The plain choice runs the textbook softmax, the
reference. The CUDA blocks are tested on CPU with stand-ins for the ops; ``benchmarks/gpu_check.py``'s ``cp_2``
stage is their first run on a GPU.

The choice is a value: the entry point reads ``DOMINO_KERNELS`` once (:func:`from_environment`),
:func:`for_device` turns it into the table of the model's device, and ``parallelize`` gives that table to every
module holding a ``kernels`` attribute (:func:`apply_kernels`), as it gives the FP8 recipe to the linears; each
op takes its module's table (:func:`resolve`), so two models with different choices live in one process. A module
given no table takes its device's own choice (:func:`kernels_for`).

Every choice computes the same values (``tests/model/test_model_kernels.py`` gives the CUDA and the plain choices
to models and ops on CPU tensors and compares outputs and gradients). Devices other than ``cuda`` take the CPU choices.

``DOMINO_KERNELS=compiled`` takes the device's choice and compiles each transformer block whole as well
(``compile_blocks``; :func:`run_compiled_block`, called from the synchronous stack's layer loop only where a block
holds no collective: TP=1, CP=1), and elsewhere (TP>1, CP>1, Domino) each layer's segments between collectives
(:func:`compiled_segment`, :mod:`domino.model.segments`). On CPU whole blocks measured 0.99-1.01x eager
(``benchmarks/block_compile.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from domino.config import ConfigError
from domino.parallel.random import tp_region_rng

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kernels:
    """The implementation each op uses on one kind of device."""

    split_qkv: bool
    """QKV as three GEMMs over a regrouped weight copy (else one GEMM over the stored weight)."""
    keep_logits_buffer: bool
    """The model keeps its fused loss's logits-sized buffer for the next step (``GPTModel.logits_buffer``; else the
    loss allocates it every step)."""
    fused_gelu_fc2: bool
    """GeLU and fc2 as one autograd node reusing the activation's buffer (else ``F.gelu`` then a linear)."""
    compile_backend: Optional[str]
    """``torch.compile`` backend fusing bias + dropout + residual into one kernel; None runs them eagerly."""
    loss_from_softmax: bool
    """At TP=1 the loss is ``-log(softmax[target])`` with a host-checked fallback for tiny probabilities (else the
    log-sum-exp of the logits, which needs no host read)."""
    loss_chunk_bytes: Optional[int] = None
    """The fused output layer + loss computes its fp32 logits in row chunks of about this many bytes, recomputing
    them in backward (:mod:`domino.parallel.chunked_cross_entropy`); None keeps all of them in one buffer."""
    fused_output_loss: bool = True
    """The output layer and the loss as one node sharing the logits' buffer (else a linear, then the loss)."""
    compile_blocks: Optional[str] = None
    """``torch.compile`` backend for each whole transformer block with ``fullgraph=True`` where the block holds no
    collective (:func:`run_compiled_block`), elsewhere for its segments between collectives (:func:`compiled_segment`);
    None runs the blocks eagerly (``DOMINO_KERNELS=compiled`` sets it)."""
    ring_blocks: str = "math"
    """How context parallelism's ring runs its attention blocks (:mod:`domino.parallel.attention_blocks`, chosen
    per call by :func:`ring_block_kernel`): ``cpu`` (SDPA's fused CPU kernel, which returns the log-sum-exp the ring
    merges by; the textbook softmax with dropout, which it lacks), ``cuda`` (FlashAttention where it takes the
    inputs, else memory-efficient attention, dropout included; else the textbook softmax) or ``math`` (the
    textbook softmax, the reference)."""
    fused_norms: bool = True
    """LayerNorm, RMSNorm and GeLU through torch's ops, one kernel each where the device has one
    (:mod:`domino.parallel.norms`); else their textbook formulas, op by op."""
    document_attention: str = "dense"
    """How attention follows the documents of ``--reset-attention-mask`` (:mod:`domino.parallel.document_attention`):
    ``dense`` (the ``[b, 1, s, s]`` mask, the reference), ``segmented`` (per-document SDPA, and per-document
    sub-blocks in the ring) or ``varlen`` (FlashAttention's varlen kernel over ``cu_seqlens``, CUDA)."""

    @property
    def ring_blocks_fused(self) -> bool:
        """Whether the ring's blocks run a fused kernel (without attention dropout)."""
        return self.ring_blocks != "math"

    @property
    def ring_blocks_fuse_dropout(self) -> bool:
        """Whether the ring's blocks run a fused kernel with attention dropout too (the CUDA kernels draw it)."""
        return self.ring_blocks == "cuda"


CPU_KERNELS = Kernels(split_qkv=True, keep_logits_buffer=True, fused_gelu_fc2=True, compile_backend=None,
                      loss_from_softmax=True, ring_blocks="cpu", document_attention="segmented")
CUDA_KERNELS = Kernels(split_qkv=False, keep_logits_buffer=False, fused_gelu_fc2=False, compile_backend="inductor",
                       loss_from_softmax=False, loss_chunk_bytes=2**30, ring_blocks="cuda",
                       document_attention="varlen")
#: CUDA on a machine without a C compiler (:func:`c_compiler`): the same, but the fusions run eagerly.
CUDA_KERNELS_WITHOUT_COMPILER = dataclasses.replace(CUDA_KERNELS, compile_backend=None)
#: The textbook form of every op: read it first; ``DOMINO_KERNELS=plain`` runs it everywhere.
PLAIN_KERNELS = Kernels(split_qkv=False, keep_logits_buffer=False, fused_gelu_fc2=False, compile_backend=None,
                        loss_from_softmax=False, fused_output_loss=False, fused_norms=False)

#: The backend ``DOMINO_KERNELS=compiled`` compiles whole blocks with (torchtitan's ``apply_compile`` default).
BLOCK_BACKEND = "inductor"

ENV_VAR = "DOMINO_KERNELS"
#: ``DOMINO_KERNELS=compiled``: the device's own choice, plus every block compiled whole.
COMPILED = "compiled"


#: What ``DOMINO_KERNELS`` chose: None (the device's choice), :data:`PLAIN_KERNELS`, or :data:`COMPILED`.
Choice = Union[None, str, Kernels]


def from_environment(environ=os.environ) -> Choice:
    """``DOMINO_KERNELS``: ``plain`` (every device), ``compiled`` (the device's choice with whole blocks
    compiled), or unset / ``auto`` (chosen by device type). Read by the entry points only, once.

    Raises:
        ConfigError: any other value, naming the variable.
    """
    value = environ.get(ENV_VAR, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value == "plain":
        return PLAIN_KERNELS
    if value == COMPILED:
        return COMPILED
    raise ConfigError(f"{ENV_VAR}={value!r}: expected plain, compiled or auto")



def for_device(choice: Choice, device: torch.device) -> Kernels:
    """The table ``choice`` (:func:`from_environment`) takes for tensors on ``device``."""
    if isinstance(choice, Kernels):
        return choice
    if device.type != "cuda":
        auto = CPU_KERNELS
    else:
        auto = CUDA_KERNELS if c_compiler() is not None else CUDA_KERNELS_WITHOUT_COMPILER
    return with_compiled_blocks(auto) if choice == COMPILED and c_compiler() is not None else auto


def apply_kernels(module: torch.nn.Module, kernels: Optional[Kernels]) -> torch.nn.Module:
    """Gives ``kernels`` to ``module`` and every submodule holding a choice (a ``kernels`` attribute: norms,
    linears, attention, the layers, the model's loss); None gives them back their device's choice."""
    for sub in module.modules():
        if hasattr(sub, "kernels"):
            sub.kernels = kernels
    return module


def resolve(kernels: Optional[Kernels], device: torch.device) -> Kernels:
    """``kernels`` (a module's table, given by ``parallelize``), else :func:`kernels_for` ``device``."""
    return kernels if kernels is not None else kernels_for(device)


#: The choice of the block or segment :func:`run_compiled` is running: what the ops of modules given no table read
#: while Dynamo traces them. A trace-time constant, not a setting: it is set only around the compiled call and
#: read only under ``torch.compiler.is_compiling()``. A module global because Dynamo reads one as a guarded
#: constant, where it cannot trace ``ContextVar.get``.
_block_kernels: Optional[Kernels] = None


def kernels_for(device: torch.device) -> Kernels:
    """The device's own kernels for tensors on ``device``, for modules and ops given no table."""
    if _block_kernels is not None and torch.compiler.is_compiling():
        return _block_kernels
    return for_device(None, device)


def ring_block_kernel(kernels: Kernels, q: torch.Tensor, k: torch.Tensor, dropout: float, masked: bool) -> str:
    """The kernel of one ring call's blocks (:class:`domino.parallel.attention_blocks.BlockKernels`): ``cpu_flash``,
    ``flash``, ``efficient`` or ``math``, from ``kernels.ring_blocks`` and the call's ``[b, H, s, d]`` queries,
    ``[b, G, s, d]`` keys, attention dropout and whether its blocks carry a dense mask. One kernel for all the
    call's blocks: the math blocks' dropout masks come from the generator the CUDA kernels draw from too, and
    backward replays them from the forward's state only if nothing else drew in between."""
    if kernels.ring_blocks == "cpu" and dropout == 0:
        return "cpu_flash"
    if kernels.ring_blocks == "cuda" and not masked:  # a dense mask: the textbook blocks (the reference path)
        for kind in ("flash", "efficient"):
            if cuda_attention_fits(kind, q, k, dropout):
                return kind
    return "math"


def cuda_attention_fits(kind: str, q: torch.Tensor, k: torch.Tensor, dropout: float) -> bool:
    """Whether torch's ``kind`` (``flash`` or ``efficient``) SDPA kernel takes a causal block of these inputs, by
    torch's own checks (``torch.backends.cuda.can_use_flash_attention`` / ``can_use_efficient_attention``: device
    capability, dtype, head size, GQA); shapes and properties only, no host sync. Head sizes that are not a
    multiple of 8 are left to the textbook blocks: SDPA pads those before calling the ops, the ring does not.
    False on a build without CUDA."""
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

    if q.device.type != "cuda" or q.shape[-1] % 8:
        return False
    if kind == "flash":  # FlashAttention takes fewer key heads than query heads
        return can_use_flash_attention(SDPAParams(q, k, k, None, dropout, True, k.shape[1] != q.shape[1]))
    return can_use_efficient_attention(SDPAParams(q, q, q, None, dropout, True, False))  # keys expanded to q's heads


@functools.lru_cache(maxsize=None)
def with_compiled_blocks(kernels: Kernels) -> Kernels:
    """``kernels`` with every block compiled whole by :data:`BLOCK_BACKEND` (built once per choice)."""
    return dataclasses.replace(kernels, compile_blocks=BLOCK_BACKEND)


@functools.lru_cache(maxsize=1)
def c_compiler() -> Optional[str]:
    """The C compiler inductor would call, or None: ``$CC``, else ``cc``, ``gcc`` or ``clang`` on the PATH.

    Inductor compiles the host-side wrapper of every graph with a C++ compiler, and Triton builds its CUDA
    launcher stubs with a C compiler (``triton/runtime/build.py``: ``$CC``, else ``cc``/``gcc``/``clang``); a
    machine without one (a slim runtime image) would fail on the first compiled call, so the CUDA choice
    falls back to eager there."""
    for name in ([os.environ["CC"]] if os.environ.get("CC") else []) + ["cc", "gcc", "clang"]:
        path = shutil.which(name)
        if path is not None:
            return path
    return None


def island(fn: Callable, device: torch.device, kernels: Optional[Kernels] = None) -> Callable:
    """``fn`` as ``kernels`` (else those of ``device``) run it: compiled into fused kernels where they have a
    compile backend (CUDA with a C compiler), else ``fn`` itself. For the elementwise islands between the GEMMs (bias + dropout +
    residual, SwiGLU, RoPE), as torchtitan compiles its blocks and Megatron-LM ``jit_fuser``-s its
    ``megatron/core/fusions/`` functions."""
    backend = resolve(kernels, device).compile_backend
    return compiled(fn, backend) if backend is not None else fn


@functools.lru_cache(maxsize=None)
def compiled(fn: Callable, backend: str) -> Callable:
    """``torch.compile(fn, backend=backend)``, built once per function and backend (compiling is lazy: the
    first call traces)."""
    return torch.compile(fn, backend=backend)


@functools.lru_cache(maxsize=None)
def compiled_segment(segment: Callable, backend: str) -> Callable:
    """``segment`` (a function of a module and tensors) compiled with ``fullgraph=True``, built once per function
    and backend: a layer's computation between two collectives (:mod:`domino.model.segments`), or a whole block
    (:func:`run_compiled_block`). The module is an argument, not bound into the compiled function, so every layer
    shares one graph (Dynamo lifts a module's parameters to graph inputs and guards on its structure, not on which
    layer it is), and nothing here keeps a model alive."""
    return torch.compile(segment, backend=backend, fullgraph=True)


_RECOMPILE_LIMIT_SAID: set = set()


def run_compiled(segment: Callable, kernels: Kernels, *args, tp_dropout: bool = False, **kwargs):
    """``segment(*args, **kwargs)`` compiled with ``kernels.compile_blocks`` (:func:`compiled_segment`), its ops
    reading ``kernels`` while Dynamo traces them; ``segment`` itself where Dynamo refuses another graph of it.

    ``tp_dropout``: the region draws attention dropout, which eager code draws from the TP stream
    (:func:`domino.parallel.random.tp_region_rng`); a graph cannot swap generators, so the fork is made here,
    around the call, and the graph seeds its random numbers from the TP stream's state.

    Each new combination of shapes, grad mode and training flag adds a graph of ``fn``; past
    ``torch._dynamo.config.recompile_limit`` a ``fullgraph`` function fails hard (``FailOnRecompileLimitHit``,
    "Hard failure due to fullgraph=True": torch 2.13 ``torch/_dynamo/convert_frame.py``) where another one would
    run eagerly; here it runs eagerly too, said once per function.
    """
    global _block_kernels
    outer, _block_kernels = _block_kernels, kernels  # a block run eagerly past the limit runs compiled segments
    try:
        with tp_region_rng(tp_dropout):
            try:
                return compiled_segment(segment, kernels.compile_blocks)(*args, **kwargs)
            except torch._dynamo.exc.FailOnRecompileLimitHit:
                if segment not in _RECOMPILE_LIMIT_SAID:
                    _RECOMPILE_LIMIT_SAID.add(segment)
                    logger.warning("%s: torch.compile's recompile limit reached; its new shapes and modes run "
                                   "eagerly (TORCH_LOGS=recompiles says why)", segment.__qualname__)
                return segment(*args, **kwargs)
    finally:
        _block_kernels = outer


def _run_block(block: torch.nn.Module, *args, **kwargs):
    return block(*args, **kwargs)


def run_compiled_block(block: torch.nn.Module, kernels: Kernels, *args, tp_dropout: bool = False, **kwargs):
    """``block(*args, **kwargs)`` compiled whole with ``kernels.compile_blocks``, as torchtitan's ``apply_compile``
    compiles each ``TransformerBlock`` with ``fullgraph=True`` (``torchtitan/models/llama3/infra/parallelize.py``):
    applied from outside, so parameter names and checkpoints stay those of the eager model; one graph for every
    block of the same structure (:func:`compiled_segment`)."""
    return run_compiled(_run_block, kernels, block, *args, tp_dropout=tp_dropout, **kwargs)
