"""Artifact manifests: the small JSON files that kfp artifacts hold in place of large files.

Datasets and checkpoints stay on the shared volume where training pods can reach them; the kfp
``Dataset``/``Model`` artifact is a manifest naming them, plus the same facts as artifact metadata.
"""

from __future__ import annotations

import json
from typing import Any, Dict

from domino.atomic_files import atomic_write_text


def write_manifest(path: str, manifest: Dict[str, Any]) -> None:
    """Writes an artifact manifest (sorted JSON) at ``path``, creating its folder, atomically: a reader (or
    the kfp launcher uploading the artifact) sees the old file or the whole new one."""
    atomic_write_text(path, json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def read_manifest(path: str, kind: str) -> Dict[str, Any]:
    """Reads an artifact manifest written by :func:`write_manifest`; ``kind`` names it in errors."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{kind} artifact {path}: not a domino manifest ({error})") from error
