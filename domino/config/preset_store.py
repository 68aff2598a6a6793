"""Named presets: model shapes and sensible defaults stored as YAML data files in ``presets/``."""

from __future__ import annotations

from importlib import resources
from typing import Any, Dict, List

import yaml

from domino.config.validate import ConfigError

_PACKAGE = "domino.config.presets"


def available() -> List[str]:
    """Names of the shipped presets, sorted."""
    return sorted(p.name[: -len(".yaml")] for p in resources.files(_PACKAGE).iterdir() if p.name.endswith(".yaml"))


def load(name: str) -> Dict[str, Any]:
    """Returns the flat ``{field: value}`` settings of preset ``name``.

    Raises:
        ConfigError: when no preset of that name exists, or its file is not a mapping.
    """
    if name not in available():
        raise ConfigError(f"--preset: unknown preset '{name}'; available: {', '.join(available())}")
    text = resources.files(_PACKAGE).joinpath(f"{name}.yaml").read_text()
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"preset file {name}.yaml must hold a mapping of settings, got {type(data).__name__}")
    return data
