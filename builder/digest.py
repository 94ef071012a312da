"""A file's SHA-256 (the bake's manifest and the adapters' records), by hashlib's own file reader."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
