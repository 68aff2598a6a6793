"""Artifact manifests: the small JSON files that kfp artifacts hold in place of large files.

Datasets and checkpoints stay on the shared volume where training pods can reach them; the kfp
``Dataset``/``Model`` artifact is a manifest naming them, plus the same facts as artifact metadata.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict


def write_manifest(path: str, manifest: Dict[str, Any]) -> None:
    """Writes an artifact manifest (sorted JSON) at ``path``, creating its folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=2, sort_keys=True)
        handle.write("\n")


def read_manifest(path: str, kind: str) -> Dict[str, Any]:
    """Reads an artifact manifest written by :func:`write_manifest`; ``kind`` names it in errors."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{kind} artifact {path}: not a domino manifest ({error})") from error
