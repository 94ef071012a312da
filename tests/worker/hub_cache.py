"""A Hugging Face hub cache made from the baked default model, as RunPod's model cache and HF_HOME hold one."""

from __future__ import annotations

import json
import os
from pathlib import Path

NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def make_cache(root: Path, bake: Path, folder: str, commit: str = COMMIT, main: str | None = COMMIT) -> Path:
    """A hub cache repo folder `root/folder` holding the bake's files (the manifest left out) at `commit`, with
    refs/main naming `main`; the blobs link to the bake's files, so no weights are copied."""
    repo = root / folder
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, digest in json.loads((bake / "manifest.json").read_text())["files"].items():
        blob = repo / "blobs" / digest
        if not blob.exists():
            blob.symlink_to((bake / name).resolve())
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    if main is not None:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(main)
    return snapshot
