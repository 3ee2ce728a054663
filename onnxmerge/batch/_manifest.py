"""The manifest written last into a model's output folder: what makes the folder count as done.

It lists every file with its size and SHA-256, the options and a fingerprint of the source. A
folder is complete only when the manifest is there and every file still matches it; a rerun
converts again whatever fails that check.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
_CHUNK = 1 << 20


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write(folder: Path, *, key: dict[str, Any], result: dict[str, Any]) -> dict[str, int]:
    """Hash every file of ``folder`` and write the manifest; return the file sizes."""
    files: dict[str, dict[str, Any]] = {
        path.relative_to(folder).as_posix(): {"bytes": path.stat().st_size, "sha256": sha256(path)}
        for path in sorted(p for p in folder.rglob("*") if p.is_file())
        if path.name != MANIFEST_NAME
    }
    manifest = {"version": MANIFEST_VERSION, "key": key, "files": files, "result": result}
    target = folder / MANIFEST_NAME
    with open(target, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    return {name: entry["bytes"] for name, entry in files.items()}


def read_valid(folder: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest if ``folder`` is complete for ``key`` and every file matches; else None."""
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("version") != MANIFEST_VERSION:
        return None
    if manifest.get("key") != json.loads(json.dumps(key)):
        return None
    files = manifest.get("files") or {}
    for name, entry in files.items():
        path = folder / name
        try:
            if path.stat().st_size != entry["bytes"] or sha256(path) != entry["sha256"]:
                return None
        except (OSError, KeyError, TypeError):
            return None
    return manifest
