"""The step time of a layout as ``domino estimate`` ranks it: compute at a stated MFU, the pipeline bubble, and the
communication the layout *exposes* (what its schedule does not hide under computation), on a two-level link model.

**Collectives.** A ring collective over ``n`` ranks sends ``2 (n-1)/n`` of the buffer from each rank for an
all-reduce and ``(n-1)/n`` for a reduce-scatter or an all-gather (NVIDIA nccl-tests ``doc/PERFORMANCE.md``, "bus
bandwidth"; the same factors as the emulated link, :mod:`domino.runtime.network_emulator`), over ``2 (n-1)`` and
``n-1`` ring steps. Its time is ``latency + wire bytes / bandwidth``, NCCL's own cost model (NVIDIA/nccl
``src/graph/tuning.cc``, ``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime``, commit 01afd20a): a base latency of
8.4 us for the ring's Simple protocol plus one hardware latency per ring step, those of the steps between nodes at
the network's (9.6 us) and the rest at NVLink's (3.4 us). Sequence parallelism turns each all-reduce into a
reduce-scatter and an all-gather of the same buffer: the same steps and bytes, so the same time.

**Which groups cross nodes.** Ranks are laid out in Megatron's order, TP fastest, then CP, DP, PP
(:mod:`domino.runtime.mesh`): a group of ``n`` ranks ``d`` apart spans the nodes of ranks ``0, d, .., (n-1) d``
(``gpus_per_node`` to a node), and a ring that leaves its node runs at the network's bandwidth.

**What each kind exposes** (per step, for the busiest pipeline stage):

* **tensor parallelism**: 4 all-reduces of ``[s/CP, b, h]`` per layer and micro-batch (2 forward, 2 backward;
  2 more with full recompute), plus the embedding's and the output layer's (``2 + 4 L`` for a one-stage model, as
  ``docs/model.md`` counts them). Synchronous TP hides none of it. Domino hides the share measured end to end on
  the emulated NVLink-ratio link (:data:`DOMINO_HIDDEN_FRACTION`, ``benchmarks/RESULTS.md``): an assumption carried
  from one model and link ratio to every layout, and never more than the step's computation.
* **context parallelism**: the bytes of :func:`~domino.config.memory_formulas.context_parallel_bytes_per_layer`;
  the ring (p2p) sends each key/value block while the previous block's attention computes, so it hides up to the
  attention core's compute time; the all-to-all hides nothing.
* **data parallelism**: the gradients over the DP x CP ranks. Where domino's DeepSpeed config reduces them in
  backward (``overlap_comm``, :func:`~domino.config.layout.zero_reduces_in_backward`), ZeRO hooks reduce-scatter
  each micro-batch's gradients while its backward goes on (each hidden up to that backward's time) and the step
  all-gathers the updated weights (exposed); otherwise the step all-reduces the accumulated gradients once,
  exposed (ZeRO 0, bf16 ZeRO 1's ``BF16_Optimizer``, a pipeline's flat all-reduce).
* **the pipeline bubble**: the ideal time x ``bubble / (1 - bubble)``
  (:func:`~domino.config.pipeline_schedule.bubble_fraction`). Stage-to-stage sends are not counted.

Not modelled: Domino's extra computation from smaller GEMMs (1.08-1.12x on the CPU of the benchmark, unmeasured
on GPUs), NCCL's tree algorithm and NVSwitch SHARP, contention between kinds sharing a link.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict

from domino.config.errors import ConfigError

#: NCCL's base latency of a ring collective, Simple protocol, in microseconds (``baseLat``, src/graph/tuning.cc).
NCCL_RING_BASE_LATENCY_US = 8.4

#: Share of TP's link time Domino hides, by chunks, without and with sequence parallelism: measured end to end
#: with ``benchmarks/overlap.py`` (TP 2, GPT 4 layers x 512, emulated link at 0.77 x the compute, the NVLink-4
#: ratio of GPT 6.7B at TP 8; ``benchmarks/RESULTS.md``, "At hidden 512" and "Sequence parallelism"). One chunk is
#: synchronous TP (hidden 0, measured -2%), except that with SP domino overlaps the backward reduce-scatters and
#: forward all-gathers of the column-parallel linears even then (24%). More chunks take the 4-chunk figure.
DOMINO_HIDDEN_FRACTION: Dict[bool, Dict[int, float]] = {False: {1: 0.0, 2: 0.70, 4: 0.87},
                                                        True: {1: 0.24, 2: 0.48, 4: 0.49}}

KINDS = ("tensor_parallel", "context_parallel", "data_parallel")


@dataclass
class LinkModel:
    """The links a layout's collectives run on: an NVLink domain per node, a network between nodes."""

    gpus_per_node: int = 8
    """GPUs per node, sharing its NVLink domain (an HGX/DGX H100 has 8); a group whose ranks span two nodes runs at
    the network's speed."""
    intra_node_gbps: float = 450.0
    """Bandwidth in GB/s each GPU sends at within a node: half of NVLink 4's 900 GB/s bidirectional per H100
    (NVIDIA's Hopper architecture page and its HGX H100 technical blog)."""
    intra_node_latency_us: float = 3.4
    """Latency per ring step within a node, microseconds (NCCL's NVLink ring Simple figure, src/graph/tuning.cc)."""
    inter_node_gbps: float = 50.0
    """Bandwidth in GB/s each GPU sends at between nodes: one 400 Gb/s InfiniBand NDR ConnectX-7 port per GPU
    (NVIDIA DGX H100 User Guide, network modules: eight ConnectX-7 ports, one per GPU)."""
    inter_node_latency_us: float = 9.6
    """Latency per ring step between nodes, microseconds (NCCL's network ring Simple figure, src/graph/tuning.cc)."""

    def check(self) -> None:
        """Raises :class:`ConfigError` naming the flag of a value that cannot describe a link."""
        if self.gpus_per_node < 1:
            raise ConfigError(f"--gpus-per-node must be >= 1, got {self.gpus_per_node}")
        for name in ("intra_node_gbps", "inter_node_gbps"):
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        for name in ("intra_node_latency_us", "inter_node_latency_us"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")

    def nodes(self, size: int, stride: int) -> int:
        """Nodes spanned by a group of ``size`` ranks ``stride`` apart (the first such group)."""
        return len({k * stride // self.gpus_per_node for k in range(size)})

    def ring_seconds(self, nbytes: float, size: int, stride: int, all_reduce: bool = True) -> float:
        """One ring all-reduce (or, ``all_reduce=False``, reduce-scatter or all-gather) of an ``nbytes`` buffer over
        ``size`` ranks ``stride`` apart (module doc)."""
        if size <= 1:
            return 0.0
        passes = 2 if all_reduce else 1
        nodes = self.nodes(size, stride)
        steps, network_steps = passes * (size - 1), passes * (nodes - 1)
        latency_us = (NCCL_RING_BASE_LATENCY_US + (steps - network_steps) * self.intra_node_latency_us
                      + network_steps * self.inter_node_latency_us)
        gbps = self.inter_node_gbps if nodes > 1 else self.intra_node_gbps
        return latency_us * 1e-6 + passes * (size - 1) / size * nbytes / (gbps * 1e9)

    def send_seconds(self, nbytes: float, steps: int, size: int, stride: int) -> float:
        """``nbytes`` sent by each rank in ``steps`` exchanges (ring or all-to-all) within the group."""
        if size <= 1:
            return 0.0
        crosses = self.nodes(size, stride) > 1
        step_us = self.inter_node_latency_us if crosses else self.intra_node_latency_us
        gbps = self.inter_node_gbps if crosses else self.intra_node_gbps
        return steps * (NCCL_RING_BASE_LATENCY_US + step_us) * 1e-6 + nbytes / (gbps * 1e9)


def domino_hidden_fraction(chunks: int, sequence_parallel: bool) -> float:
    """:data:`DOMINO_HIDDEN_FRACTION` at the largest measured chunk count <= ``chunks``."""
    table = DOMINO_HIDDEN_FRACTION[sequence_parallel]
    return table[max(c for c in table if c <= max(1, chunks))]


@dataclass
class StepTime:
    """One step of a layout, in seconds: compute, bubble, and each kind's link time and the part of it hidden."""

    compute_s: float
    """The step's computation at the stated MFU, without the bubble."""
    bubble_s: float = 0.0
    """The pipeline's idle time: compute x bubble / (1 - bubble)."""
    communication_s: Dict[str, float] = field(default_factory=dict)
    """Link time per kind (:data:`KINDS`) of one rank of the busiest stage."""
    hidden_s: Dict[str, float] = field(default_factory=dict)
    """The part of each kind's link time that runs under computation."""

    @property
    def exposed_s(self) -> Dict[str, float]:
        """Link time the step waits for, per kind."""
        return {k: self.communication_s.get(k, 0.0) - self.hidden_s.get(k, 0.0) for k in KINDS}

    @property
    def exposed_communication_s(self) -> float:
        """All the link time the step waits for."""
        return sum(self.exposed_s.values())

    @property
    def step_time_s(self) -> float:
        """Compute, bubble and exposed communication."""
        return self.compute_s + self.bubble_s + self.exposed_communication_s

    def to_json(self) -> Dict[str, object]:
        """The ``--json`` breakdown."""
        return {"compute_s": self.compute_s, "pipeline_bubble_s": self.bubble_s,
                "communication_s": {k: self.communication_s.get(k, 0.0) for k in KINDS},
                "exposed_s": self.exposed_s}


@dataclass
class StepTraffic:
    """What one rank of the busiest stage sends per step, and the computation that can hide it (seconds)."""

    tp_all_reduce_bytes: float = 0.0
    """One TP all-reduce's buffer (``[s/CP, b, h]``)."""
    tp_all_reduces: int = 0
    """TP all-reduces per step (every micro-batch's)."""
    tp_chunks: int = 1
    """Domino chunks: each all-reduce runs as that many, one per chunk (more latency, the same bytes)."""
    cp_bytes: float = 0.0
    """Bytes sent for context-parallel attention per step."""
    cp_exchanges: int = 0
    """Exchanges (ring steps or all-to-alls) behind ``cp_bytes``."""
    cp_hideable_s: float = 0.0
    """Attention compute the ring's transfers run under (0 for the all-to-all)."""
    gradient_bytes: float = 0.0
    """The stage's gradients on one rank, as reduced."""
    reductions_in_backward: int = 0
    """Micro-batches whose gradients ZeRO reduce-scatters during their backward (0: one all-reduce at the step)."""
    backward_s: float = 0.0
    """One micro-batch's backward, the time each in-backward reduction can hide under."""


def step_time(traffic: StepTraffic, compute_s: float, bubble_s: float, layout, link: LinkModel) -> StepTime:
    """Link time and hidden time per kind of ``layout`` (a :class:`~domino.config.memory_formulas.Layout`) on
    ``link``; hidden time never exceeds the computation left to hide under (taken by TP, CP, DP in turn)."""
    t, c, d = layout.tensor_model_parallel_size, layout.context_parallel_size, layout.data_parallel_size
    chunks = max(1, layout.domino_chunks)
    tp = traffic.tp_all_reduces * chunks * link.ring_seconds(traffic.tp_all_reduce_bytes / chunks, t, 1)
    cp = link.send_seconds(traffic.cp_bytes, traffic.cp_exchanges, c, t)
    if traffic.reductions_in_backward:  # reduce-scatters during backward, the weights all-gathered at the step
        scatter = link.ring_seconds(traffic.gradient_bytes, d * c, t, all_reduce=False)
        dp = traffic.reductions_in_backward * scatter + link.ring_seconds(traffic.gradient_bytes, d * c, t, False)
        dp_hideable = traffic.reductions_in_backward * min(scatter, traffic.backward_s)
    else:
        dp, dp_hideable = link.ring_seconds(traffic.gradient_bytes, d * c, t), 0.0
    wanted = {"tensor_parallel": tp * domino_hidden_fraction(chunks, layout.sequence_parallel) if t > 1 else 0.0,
              "context_parallel": min(cp, traffic.cp_hideable_s), "data_parallel": dp_hideable}
    left, hidden = compute_s, {}
    for kind in KINDS:
        hidden[kind] = min(wanted[kind], left)
        left -= hidden[kind]
    return StepTime(compute_s=compute_s, bubble_s=bubble_s, hidden_s=hidden,
                    communication_s={"tensor_parallel": tp, "context_parallel": cp, "data_parallel": dp})


def step_traffic(shape, layout, microbatches: int, act_bytes: int, stage_parameters: float, cp_bytes: float,
                 cp_comm_type: str, zero_in_backward: bool, compute_s: float, gpu_flop_s: float) -> StepTraffic:
    """What one rank of the busiest stage of ``layout`` sends per step (module doc).

    Args:
        shape: the model at this rank's ``s / CP`` tokens (a :class:`~domino.config.memory_formulas.ModelShape`).
        layout: the layout.
        microbatches: micro-batches per step.
        act_bytes: bytes of an activation and of a gradient (2 in bf16/fp16, 4 in fp32).
        stage_parameters: parameters the stage holds on one rank.
        cp_bytes: bytes sent for context-parallel attention per step.
        cp_comm_type: p2p (the ring, overlapped) or a2a.
        zero_in_backward: whether ZeRO reduces gradients during backward
            (:func:`~domino.config.layout.zero_reduces_in_backward`, and a ZeRO optimizer at all).
        compute_s: the step's computation at the stated MFU.
        gpu_flop_s: FLOP/s one GPU reaches at that MFU.
    """
    p, c = layout.pipeline_model_parallel_size, layout.context_parallel_size
    layers = shape.L // p
    per_layer = 4 + (2 if layout.recompute == "full" else 0)  # the recomputed forward all-reduces again
    ends = 2 if p == 1 else 1  # the embedding's all-reduce (first stage), the output layer's input gradient (last)
    tokens = shape.s * layout.micro_batch_size  # this rank's s / CP tokens of one micro-batch
    passes = 2 if layout.recompute == "full" else 1
    exchanges = (passes + 1) * (c - 1) if cp_comm_type == "p2p" else 2 * (passes + 1)
    # The attention core (QK^T and AV, 4 s h FLOPs per token of the whole sequence, Megatron's count) forward and
    # backward: what the ring's transfers hide under.
    attention_s = 3 * layers * microbatches * tokens * 4 * shape.s * c * shape.h / (
        layout.tensor_model_parallel_size * c * gpu_flop_s)
    return StepTraffic(
        tp_all_reduce_bytes=tokens * shape.h * act_bytes, tp_all_reduces=microbatches * (layers * per_layer + ends),
        tp_chunks=max(1, layout.domino_chunks), cp_bytes=cp_bytes, cp_exchanges=layers * microbatches * exchanges,
        cp_hideable_s=attention_s if cp_comm_type == "p2p" else 0.0, gradient_bytes=stage_parameters * act_bytes,
        reductions_in_backward=microbatches if zero_in_backward else 0,
        backward_s=2 / 3 * compute_s / microbatches)
