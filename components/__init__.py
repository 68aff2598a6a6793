"""Kubeflow Pipelines components that wrap domino's data, launch and eval libraries.

One folder per component. ``component.py`` holds the kfp wrapper: a lightweight component whose body
only imports and calls the plain-Python ``step.py`` beside it, so the logic is testable without kfp and
runs the same under ``kfp.local`` and in a cluster (where the image has this package installed).
Components run in the domino image: :func:`default_image` reads ``DOMINO_IMAGE``.
"""

from __future__ import annotations

import os

#: The image every component runs in unless ``DOMINO_IMAGE`` names another one.
DEFAULT_IMAGE = "ghcr.io/domino-ml/domino:0.1.0"

#: Environment variable that overrides :data:`DEFAULT_IMAGE` when components are built.
IMAGE_ENV = "DOMINO_IMAGE"


def default_image() -> str:
    """The image for components: ``$DOMINO_IMAGE`` if set and non-empty, else :data:`DEFAULT_IMAGE`."""
    return os.environ.get(IMAGE_ENV) or DEFAULT_IMAGE
