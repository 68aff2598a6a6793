"""Checks a job's ``domino pretrain`` arguments on the launching machine, before any pod exists.

A typo in a flag or a parallel layout that does not divide the job's world size would otherwise
surface only after the pods were scheduled and the image pulled. The check parses the arguments with
the same config flags ``domino pretrain`` uses and validates them for training at the job's world size.
"""

from __future__ import annotations

from domino.config import ConfigError, DominoConfig, config_from_args
from domino.config.estimate import USABLE_FRACTION, describe, estimate_layout, fitting_layouts, layout_of
from domino.launch.pretrain_flags import parse_pretrain_args
from domino.launch.render import container_command
from domino.launch.spec import JobSpec, LaunchSpecError


def check_pretrain_args(spec: JobSpec) -> None:
    """Raises :class:`LaunchSpecError` when ``spec.pretrain_args`` would make ``domino pretrain`` fail
    at start-up (unknown flag, bad value, no data, a layout that does not fit the world size).

    A ``command`` override is the user's own command and is not checked.
    """
    if spec.command is not None:
        return
    # Check what the container will run: the arguments plus the --save/--load (and a derived layout's
    # --tensor-model-parallel-size) the renderer adds.
    command = container_command(spec, spec.name)
    args = parse_pretrain_args(command[command.index("pretrain") + 1:])
    try:
        config = config_from_args(args, world_size=spec.world_size, for_training=True)
    except ConfigError as error:
        raise LaunchSpecError(f"domino pretrain arguments (world size {spec.world_size}): {error}") from None
    if spec.gpu_memory_gb is not None and spec.world_size is not None:
        check_memory_fits(config, spec.world_size, spec.gpu_memory_gb)


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
