"""Kubeflow Pipelines components that wrap domino's data, launch and eval libraries.

One folder per component. ``component.py`` holds the kfp wrapper: a lightweight component whose body
only imports and calls the plain-Python ``step.py`` beside it, so the logic is testable without kfp and
runs the same under ``kfp.local`` and in a cluster (where the image has this package installed).

Imports run one way: ``pipelines/`` builds each component with :func:`kfp_component` from its generated
function in :mod:`components.kfp_functions`, whose body imports the glue in ``component.py``, which calls
``step.py``. A ``component.py`` never imports the generated file (``tests/test_layering.py`` checks).
Components run in the domino image's CPU variant (:func:`default_image`, see :mod:`domino.images`).
"""

from __future__ import annotations

from domino import images

#: The image every component runs in unless ``$DOMINO_IMAGE_REPOSITORY`` names another repository.
DEFAULT_IMAGE = images.image("cpu", repo=images.DEFAULT_REPOSITORY)


def kfp_component(function, image=None):
    """``function`` (from :mod:`components.kfp_functions`) as a kfp component running in ``image`` (default:
    :func:`default_image`); the image carries domino and kfp, so kfp is not installed at start."""
    from kfp import dsl  # the kfp layer only: the package's settings modules import without kfp

    return dsl.component(function, base_image=image or default_image(), install_kfp_package=False)


def default_image() -> str:
    """The image for components: the CPU variant in ``$DOMINO_IMAGE_REPOSITORY`` (else the default repository)."""
    return images.image("cpu")
