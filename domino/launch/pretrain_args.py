"""A job's ``domino pretrain`` arguments resolved and checked once, on the launching machine, before any pod exists.

A typo in a flag or a parallel layout that does not divide the job's world size would otherwise
surface only after the pods were scheduled and the image pulled. :func:`resolve_pretrain` fixes the layout
(``--parallel-layout derive`` searched once), builds the argv every pod of the job runs (the arguments plus the
``--save``/``--load``/``--exit-signal-handler`` the renderer adds), parses it with the same config flags
``domino pretrain`` uses and validates it for training at the job's world size, once. Rendering, the local
backend, the cluster launcher and the pipeline's pretrain step then take that one value: a pod (and each of its
restarts) receives the argv that was checked, and parses it once itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from domino.config import ConfigError, DominoConfig, config_from_args
from domino.config.estimate import USABLE_FRACTION, describe, estimate_layout, fitting_layouts, layout_of
from domino.launch.parallel_layout import DerivedLayout, derive_layout, derived_flags
from domino.launch.pretrain_flags import parse_pretrain_args
from domino.launch.render import container_command
from domino.launch.spec import JobSpec, LaunchSpecError


@dataclass(frozen=True)
class ResolvedPretrain:
    """What a job's pods run, resolved once.

    Attributes:
        spec: The job with its layout fixed: under ``--parallel-layout derive`` the derived tensor-parallel size is
            appended to its pretrain arguments and the layout is ``given``, so every reader of the spec (the
            manifests, the local backend) sees the same argv without deriving again.
        config: The configuration that argv gives at the job's world size, validated for training; None for a
            ``command`` override (the user's own command, not checked).
        derived: The derived layout (its one-line reason); None unless the layout was derived.
    """

    spec: JobSpec
    config: Optional[DominoConfig]
    derived: Optional[DerivedLayout]


def resolve_pretrain(spec: JobSpec) -> ResolvedPretrain:
    """``spec``'s pretrain arguments with the layout fixed, parsed and checked once (module docstring).

    Raises:
        LaunchSpecError: when ``domino pretrain`` would fail at start-up on them (unknown flag, bad value, no data,
            a layout that does not fit the world size or, with ``gpu_memory_gb``, the GPUs' memory).
    """
    if spec.command is not None:
        return ResolvedPretrain(spec, None, None)
    derived = derive_layout(spec) if spec.parallel_layout == "derive" else None
    if derived is not None:  # argparse keeps the last --tensor-model-parallel-size: the derived one (and CP's)
        spec = dataclasses.replace(spec, parallel_layout="given", pretrain_args=[
            *spec.pretrain_args, *derived_flags(derived, spec.pretrain_args)])
    command = container_command(spec, spec.name)
    args = parse_pretrain_args(command[command.index("pretrain") + 1:])
    try:
        config = config_from_args(args, world_size=spec.world_size, for_training=True)
    except ConfigError as error:
        raise LaunchSpecError(f"domino pretrain arguments (world size {spec.world_size}): {error}") from None
    if spec.gpu_memory_gb is not None and spec.world_size is not None:
        check_memory_fits(config, spec.world_size, spec.gpu_memory_gb)
    return ResolvedPretrain(spec, config, derived)


def check_memory_fits(config: DominoConfig, world_size: int, gpu_memory_gb: float) -> None:
    """Raises :class:`LaunchSpecError` with the numbers when the memory estimate of ``config``'s layout on
    ``world_size`` GPUs exceeds the usable share of ``gpu_memory_gb``; names the best layout that fits."""
    estimate = estimate_layout(config, layout_of(config, world_size), gpu_memory_gb=gpu_memory_gb)
    if estimate.fits:
        return
    best = fitting_layouts(config, world_size, gpu_memory_gb)
    hint = f"; the best layout that fits: {describe(best[0])}" if best else "; no layout of these GPUs fits"
    raise LaunchSpecError(
        f"--gpu-memory-gb {gpu_memory_gb:g}: the estimate (domino estimate) is {estimate.total / 2**30:.1f} GiB per "
        f"GPU, over {USABLE_FRACTION:.0%} of {gpu_memory_gb:g} GiB: {describe(estimate)}{hint}")
