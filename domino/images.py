"""The domino container images: one repository, one tag scheme, the tag derived from the package version.

Every default image in the project comes from here: the pipeline's steps and its training job, the
launcher's ``--image``, the rendered templates and the TrainingRuntime in ``k8s/`` (tests/k8s checks
those files), and ``make image``, which builds both variants from the Dockerfile:

* ``<repository>:<version>-cuda``: the Dockerfile's default target (NVIDIA PyTorch base, DeepSpeed),
  for training pods with GPUs;
* ``<repository>:<version>-cpu``: its ``cpu`` target, for the pipeline's steps and CPU-only jobs.

The one override is the repository, ``$DOMINO_IMAGE_REPOSITORY`` (read here and by the Makefile), so a
platform that pushes ``make image`` to its own registry changes every default at once.
"""

from __future__ import annotations

import os
from typing import Optional

from domino import __version__

#: Environment variable naming the repository the images are pushed to (the one override).
REPOSITORY_ENV = "DOMINO_IMAGE_REPOSITORY"
#: The repository when ``$DOMINO_IMAGE_REPOSITORY`` is unset.
DEFAULT_REPOSITORY = "ghcr.io/domino-ml/domino"
#: The image variants, named like the Dockerfile's targets.
VARIANTS = ("cuda", "cpu")


def repository() -> str:
    """``$DOMINO_IMAGE_REPOSITORY`` if set and non-empty, else :data:`DEFAULT_REPOSITORY`."""
    return os.environ.get(REPOSITORY_ENV) or DEFAULT_REPOSITORY


def image(variant: str = "cuda", version: str = __version__, repo: Optional[str] = None) -> str:
    """The image reference ``<repository>:<version>-<variant>``.

    Raises:
        ValueError: ``variant`` is not one of :data:`VARIANTS`.
    """
    if variant not in VARIANTS:
        raise ValueError(f"image variant {variant!r} is not one of {', '.join(VARIANTS)}")
    return f"{repo or repository()}:{version}-{variant}"


def for_gpus(gpus: int) -> str:
    """The image a pod with ``gpus`` GPUs runs by default: the CUDA variant with GPUs, else the CPU one."""
    return image("cuda" if gpus > 0 else "cpu")
