"""Tensor-parallel layers with Megatron-LM semantics.

* :class:`VocabParallelEmbedding` - each rank holds a contiguous block of vocabulary rows.
* :class:`ColumnParallelLinear` - ``Y = X A^T``, ``A`` split by output rows: each rank computes its slice of
  ``Y``; the input's gradient is all-reduced.
* :class:`RowParallelLinear` - ``A`` split by input columns: each rank computes a partial sum of ``Y``,
  which is all-reduced; the bias is added once, after the reduction, and is replicated.

Sharded parameters carry ``tensor_model_parallel=True``, ``partition_dim`` and ``partition_stride`` (what
DeepSpeed's gradient norm and our checkpoint code look at); replicated parameters carry none of them.

Initialisation is TP-invariant and drawn where the parameter lives, for the local shard only: a sharded
weight is cut along its partition dimension into blocks, each drawn from its own generator seeded from (one
key per parameter, block index). The key comes from the default CPU generator (identically seeded on all TP
ranks, one draw per parameter), so the weights at TP=2 or 4 are exactly the slices of the TP=1 weights for the
same seed and device, the default generator ends in the same state whatever the TP size, and no rank draws
(or holds) the full matrix.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from domino.parallel.collectives import (
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    scatter_to_tp_region,
)
from domino.parallel import fp8
from domino.parallel.kernels import Kernels, resolve
from domino.parallel.linear_ops import gelu_linear
from domino.parallel.norms import gelu
from domino.runtime.mesh import SINGLE, MeshGroup


#: A row-parallel linear's partial product as a function of the bias its GEMM adds (None: no bias).
Product = Callable[[Optional[torch.Tensor]], torch.Tensor]


def set_tensor_model_parallel_attributes(param: nn.Parameter, partition_dim: int, stride: int = 1) -> None:
    """Marks ``param`` as split across TP ranks along ``partition_dim``."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride


def is_tensor_model_parallel(param: torch.Tensor) -> bool:
    """Whether ``param`` is split across TP ranks (False for replicated parameters)."""
    return bool(getattr(param, "tensor_model_parallel", False))


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-model-parallel size ({denominator})")
    return numerator // denominator


#: A partitioned dimension of size n is drawn in gcd(n, INIT_BLOCKS_DIVISOR) blocks. Every TP size dividing both
#: (all powers of two up to 64, and 3, 5, 6, 7, 9, 10, 12, ...: 2^6 * 3^2 * 5 * 7) cuts only between blocks.
INIT_BLOCKS_DIVISOR = 20160
_GOLDEN = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads block indices over the seed space


def init_blocks(size: int, world: int) -> int:
    """Blocks a partitioned dimension of ``size`` is drawn in (one per row when ``world`` would cut a block)."""
    blocks = math.gcd(size, INIT_BLOCKS_DIVISOR)
    return blocks if blocks % world == 0 else size


def _sharded_normal(shape: Tuple[int, int], std: float, dim: int, tp: MeshGroup) -> nn.Parameter:
    """This rank's slice (its place in ``tp``) along ``dim`` of an N(0, std^2) matrix of ``shape``, drawn on the
    default device.

    The same for every TP size dividing :data:`INIT_BLOCKS_DIVISOR` (see the module docstring); a
    ``with torch.device(...)`` block around model construction makes it draw on that device (on ``meta``
    nothing is drawn: a checkpoint fills the values).
    """
    rank, world = tp.rank, tp.size
    size = shape[dim]
    device = torch.empty(0).device
    local_shape = list(shape)
    local_shape[dim] = size // world
    if device.type == "meta":
        data = torch.empty(local_shape)
    else:
        blocks = init_blocks(size, world)
        key = int(torch.randint(0, 2**62, (), device="cpu"))  # a CPU read at construction, not in a training step
        block_shape = list(shape)
        block_shape[dim] = size // blocks
        parts = []
        for block in range(rank * blocks // world, (rank + 1) * blocks // world):
            generator = torch.Generator(device=device).manual_seed((key + block * _GOLDEN) % 2**63)
            parts.append(torch.randn(block_shape, generator=generator, device=device).mul_(std))
        data = torch.cat(parts, dim=dim)
    param = nn.Parameter(data)
    set_tensor_model_parallel_attributes(param, dim)
    return param


def _gelu_then_linear(pre_activation: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      rec: Optional[fp8.Recipe], kernels: Optional[Kernels]) -> torch.Tensor:
    """``F.linear(F.gelu(pre_activation), weight, bias)``: one buffer-reusing node on CPU, two ops on CUDA, GeLU
    then the linear, the textbook GeLU on the plain choice (``kernels``, else the device's:
    :mod:`domino.parallel.kernels`); the GEMMs in float8 per ``rec``."""
    kernels = resolve(kernels, pre_activation.device)
    if kernels.fused_gelu_fc2 and rec is None:
        return gelu_linear(pre_activation, weight, bias)
    return fp8.linear(gelu(pre_activation, kernels=kernels), weight, bias, rec)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary (rows) across TP ranks.

    Args:
        num_embeddings: the (padded) vocabulary size, divisible by the TP size.
        embedding_dim: the hidden size.
        init_std: standard deviation of the normal initialisation.
        tp: the tensor-parallel group the table is split over (one process by default).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, init_std: float = 0.02,
                 tp: MeshGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        rank, world = tp.rank, tp.size
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        per_rank = _divide(num_embeddings, world, "the padded vocabulary size")
        self.vocab_start = rank * per_rank
        self.vocab_end = self.vocab_start + per_rank
        self.weight = _sharded_normal((num_embeddings, embedding_dim), init_std, 0, tp)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Looks up ``tokens`` (any shape of int64) and returns ``[..., embedding_dim]``, full on every rank."""
        out = self.partial(tokens)
        return out if self.tp.size == 1 else reduce_from_tp_region(out, self.tp)

    def partial(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's part of the lookup: zeros for the tokens other ranks own; the TP sum is :meth:`forward`'s
        result (Domino launches that all-reduce itself, per batch chunk)."""
        if self.vocab_end - self.vocab_start == self.num_embeddings:
            return F.embedding(tokens, self.weight)
        # Tokens owned by other ranks look up row 0 and are zeroed; the all-reduce fills them in.
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local = (tokens - self.vocab_start).masked_fill(outside, 0)
        return F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)


class ColumnParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` and ``b`` split along the output dimension.

    Args:
        input_size: width of ``X`` (full on every rank).
        output_size: full width of ``Y``; each rank produces ``output_size / tp`` of it.
        bias: whether to add a (sharded) bias.
        gather_output: all-gather ``Y`` so every rank returns the full width.
        init_std: standard deviation of the weight's normal initialisation (biases start at zero).
        skip_bias_add: return ``(Y_without_bias, bias)`` so the caller can fuse the bias add.
        tp: the tensor-parallel group the weight is split over (one process by default).

    Attributes:
        fp8: the FP8 recipe of its GEMMs (:mod:`domino.parallel.fp8`), given by ``parallelize``; None: high precision.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = False,
                 init_std: float = 0.02, skip_bias_add: bool = False, tp: MeshGroup = SINGLE) -> None:
        super().__init__()
        self.tp, self.fp8 = tp, None
        world = tp.size
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_partition = _divide(output_size, world, "output size of a column-parallel linear")
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.weight = _sharded_normal((output_size, input_size), init_std, 0, tp)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition))
            set_tensor_model_parallel_attributes(self.bias, 0)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> Union[torch.Tensor, Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """Synchronous TP: the input gradient is all-reduced inside backward."""
        x = copy_to_tp_region(x, self.tp)
        bias = None if self.skip_bias_add else self.bias
        y = fp8.linear(x, self.weight, bias, self.fp8)
        if self.gather_output:
            y = gather_from_tp_region(y, self.tp)
        return (y, self.bias) if self.skip_bias_add else y


class RowParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` split along the input dimension; ``Y`` is all-reduced, ``b`` replicated.

    Args:
        input_size: full width of ``X``; each rank holds ``input_size / tp`` of it.
        output_size: width of ``Y``.
        bias: whether to add a (replicated) bias after the reduction.
        input_is_parallel: ``X`` is already this rank's slice (else it is split here).
        init_std: standard deviation of the weight's normal initialisation.
        skip_bias_add: return ``(Y_without_bias, bias)`` so the caller can fuse the bias add; with a single TP
            rank the bias is already in ``Y`` (added by the GEMM) and ``(Y, None)`` is returned.
        tp: the tensor-parallel group the weight is split over (one process by default).

    Attributes:
        fp8: the FP8 recipe of its GEMMs (:mod:`domino.parallel.fp8`), given by ``parallelize``; None: high precision.
        kernels: the kernel choice of GeLU + fc2 (:mod:`domino.parallel.kernels`), given by ``parallelize``; None:
            the device's.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, input_is_parallel: bool = True,
                 init_std: float = 0.02, skip_bias_add: bool = False, tp: MeshGroup = SINGLE) -> None:
        super().__init__()
        self.tp, self.fp8, self.kernels = tp, None, None
        world = tp.size
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_partition = _divide(input_size, world, "input size of a row-parallel linear")
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.weight = _sharded_normal((output_size, input_size), init_std, 1, tp)
        # Replicated: deliberately no tensor_model_parallel attribute (grad-norm must count it once).
        self.bias = nn.Parameter(torch.zeros(output_size)) if bias else None

    def product(self, x: torch.Tensor) -> Product:
        """``X_r A_r^T`` as a function of the bias the GEMM may add: this rank's partial sum, un-reduced, left to
        whoever reduces it (:meth:`reduce` here; Domino's stacks launch the reduction themselves, with no bias)."""
        return lambda bias: fp8.linear(x, self.weight, bias, self.fp8)

    def product_of_gelu(self, pre_activation: torch.Tensor) -> Product:
        """:meth:`product` of ``F.gelu(pre_activation)``, GeLU fused into the product's autograd node: on CPU the
        fused backward reuses the activation's buffer for its gradients
        (:func:`domino.parallel.linear_ops.gelu_linear`)."""
        return lambda bias: _gelu_then_linear(pre_activation, self.weight, bias, self.fp8, self.kernels)

    def forward(self, x: torch.Tensor) -> Union[torch.Tensor, Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """Synchronous TP: the partial sums are all-reduced before the bias is added."""
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp)
        return self.reduce(self.product(x))

    def forward_gelu(self, pre_activation: torch.Tensor
                     ) -> Union[torch.Tensor, Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """``forward(F.gelu(pre_activation))`` (input already parallel), GeLU fused as in :meth:`product_of_gelu`."""
        return self.reduce(self.product_of_gelu(pre_activation))

    def reduce(self, product: Product) -> Union[torch.Tensor, Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """The synchronous layer's output from a :meth:`product`: all-reduced, then the bias (or ``(y, bias)``
        with ``skip_bias_add``, the bias None when the GEMM added it)."""
        # With one TP rank the all-reduce is an identity, so the bias can ride in the GEMM (addmm): one
        # elementwise pass over the output fewer. Otherwise it is added once, after the reduction.
        bias_in_product = self.bias is not None and self.tp.size == 1
        y = reduce_from_tp_region(product(self.bias if bias_in_product else None), self.tp)
        bias = None if bias_in_product else self.bias
        if self.skip_bias_add:
            return y, bias
        return y if bias is None else y + bias


def apply_fp8(module: nn.Module, recipe: Optional[fp8.Recipe]) -> nn.Module:
    """Gives every tensor-parallel linear inside ``module`` the FP8 recipe of its GEMMs (None: high precision);
    returns ``module``. The output layer is no such linear (an embedding's weight), so it keeps high precision."""
    for linear in module.modules():
        if isinstance(linear, (ColumnParallelLinear, RowParallelLinear)):
            linear.fp8 = recipe
    return module
