"""Fitness checks RunPod's SDK (1.12) runs before the worker takes its first job; one that fails marks the worker
unhealthy and ends it (exit code 1), so a broken worker is told apart before a user's request finds it.

- the model's files are there with the sizes the bake's manifest records (a hub cache snapshot's: its links to
  the blobs resolve); with VERIFY_MODEL_SHA256=true, also with the SHA-256 sums the manifest records (a
  snapshot's: the sums its blobs are named by, which the hub gives large files). The sums are opt-in because
  they read every weight byte on every cold start, which grows with the model; sizes cost one stat per file;
- one request of one token runs through the engine: the device is usable, the attention backend's kernels load
  and a forward pass gives a token;
- the KV cache holds one sequence of the served max_model_len.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

from engine.sample.params import SamplingParams
from worker.runtime import Runtime
from worker.settings import MANIFEST

FITNESS_REQUEST_ID = "fitness-check"
SHA256_NAME = re.compile(r"[0-9a-f]{64}")


def model_files_mismatch(model_path: str, sha256: bool = False) -> list[str]:
    """The files of the bake that are gone or not the size its manifest records (a manifest from before sizes were
    recorded: gone only), and with `sha256` those whose SHA-256 is not the manifest's. For a folder without a
    manifest, the files linked to a hub cache blob named by a SHA-256: gone, or with `sha256` not of that sum."""
    folder = Path(model_path)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        digests, sizes = manifest.get("files") or {}, manifest.get("sizes") or {}
    except (OSError, ValueError):
        digests, sizes = _cache_blob_digests(folder), {}
    return [
        name
        for name, digest in sorted(digests.items())
        if not _has_size(folder / name, sizes.get(name)) or (sha256 and _sha256(folder / name) != digest)
    ]


def _has_size(path: Path, size: int | None) -> bool:
    try:
        return path.is_file() and (size is None or path.stat().st_size == size)
    except OSError:
        return False


def _cache_blob_digests(folder: Path) -> dict[str, str]:
    """name -> SHA-256 of the snapshot's files whose blob is named by one (the hub's large files; small ones are
    named by their git hash, which is not checked)."""
    links = [p for p in sorted(folder.iterdir()) if p.is_symlink()] if folder.is_dir() else []
    blobs = {p.name: Path(os.readlink(p)).name for p in links}
    return {name: blob for name, blob in blobs.items() if SHA256_NAME.fullmatch(blob)}


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fitness_checks(runtime: Runtime) -> list[Callable]:
    """The checks, in the order they run, as functions the SDK registers (named for its log)."""
    sha256 = runtime.settings.verify_model_sha256

    def model_files_match_manifest() -> None:
        bad = model_files_mismatch(runtime.settings.model_path, sha256=sha256)
        if bad:
            what = "sizes or checksums" if sha256 else "sizes (SHA-256 sums not read: VERIFY_MODEL_SHA256=false)"
            raise RuntimeError(
                f"model files are missing or differ from their recorded {what} (the bake's "
                f"manifest, or the hub cache's blob names): {', '.join(bad)}"
            )

    async def one_token_forward_pass() -> None:
        prompt = runtime.tokenizer.encode("Hi") or [0]
        if runtime.engine.classifier is not None:  # a cross-encoder scores instead of generating
            scored = await runtime.engine.score(prompt, FITNESS_REQUEST_ID)
            if len(scored.embedding) != runtime.engine.classifier.num_labels:
                raise RuntimeError("the engine's forward pass gave no score")
            return
        if runtime.engine.encoder:  # an encoder embeds instead of generating
            embedded = await runtime.engine.embed(prompt, FITNESS_REQUEST_ID)
            if not embedded.embedding:
                raise RuntimeError("the engine's forward pass gave no embedding")
            return
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        outputs = [o async for o in runtime.engine.generate(prompt, params, FITNESS_REQUEST_ID)]
        if sum(len(o.outputs[0].token_ids) for o in outputs if o.outputs) != 1:
            raise RuntimeError("the engine's forward pass gave no token")

    def kv_cache_holds_one_max_len_sequence() -> None:
        info = runtime.engine.describe()
        if info["kv_pages"] * info["page_size"] < runtime.max_model_len:
            raise RuntimeError(
                f"the KV cache ({info['kv_pages']} pages of {info['page_size']} tokens) cannot "
                f"hold one sequence of MAX_MODEL_LEN={runtime.max_model_len}"
            )

    return [model_files_match_manifest, one_token_forward_pass, kv_cache_holds_one_max_len_sequence]


def register_fitness_checks(runtime: Runtime) -> None:
    """Register the checks with RunPod's SDK (they run in `runpod.serverless.start`, on RunPod only)."""
    import runpod

    for check in fitness_checks(runtime):
        runpod.serverless.register_fitness_check(check)
