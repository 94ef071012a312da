"""Stage a model in a temporary folder, check the engine can run it, write the manifest, rename into place."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from builder.adapters import ADAPTERS_DIR, AdapterSpec, adapter_identity, bake_adapters
from builder.digest import sha256
from builder.errors import BakeError
from builder.harmony_vocab import write_harmony_vocab
from builder.overrides import apply_hf_overrides
from builder.sources import Source, fetch, identity
from engine.text.tokenizer import BAKE_MARK, saved_by_bake

MANIFEST = "manifest.json"


def bake(
    source: Source,
    out: Path,
    token: str | None = None,
    served_name: str | None = None,
    adapters: list[AdapterSpec] | None = None,
) -> dict:
    """Bake `source` and its LoRA `adapters` into `out` (replacing what is there); nothing is left behind on
    failure."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        fetched = fetch(source, staging, token)
        sums = check_sums(staging, fetched.digests)
        apply_hf_overrides(staging, source.hf_overrides)
        _convert_bin_weights(staging)
        architecture = check_folder(staging)
        saved_by = _save_tokenizer(staging)
        if json.loads((staging / "config.json").read_text()).get("model_type") == "gpt_oss":
            write_harmony_vocab(staging)  # openai-harmony's tokenizer, which it would otherwise download
        manifest = _manifest(source, staging, fetched.revision, architecture, served_name or source.served_name, sums)
        manifest[BAKE_MARK] = saved_by
        manifest["adapters"] = bake_adapters(adapters or [], staging, manifest["served_model_name"], token)
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        _replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def is_current_bake(folder: Path) -> bool:
    """Whether `folder` holds a complete bake in this builder's format (older bakes lack the saved tokenizer)."""
    return saved_by_bake(folder)


def source_change(out: Path, source: Source) -> str | None:
    """Why the bake in `out` is not of `source` (one line), or None when it is."""
    baked = json.loads((out / MANIFEST).read_text()).get("source") or {}
    wanted = identity(source)
    if baked == wanted:
        return None
    held = f"{baked.get('ref', '?')} ({baked.get('kind', '?')})"
    if baked.get("hf_overrides", {}) != wanted.get("hf_overrides", {}):
        return (
            f"it was baked with HF_OVERRIDES {json.dumps(baked.get('hf_overrides', {}))}, not "
            f"{json.dumps(wanted.get('hf_overrides', {}))}"
        )
    if (baked.get("kind"), baked.get("ref")) != (wanted["kind"], wanted["ref"]):
        return f"it holds {held}, not {wanted['ref']} ({wanted['kind']})"
    if "fingerprint" in wanted:
        what = "folder" if source.kind == "local" else "file"
        return f"{what} {wanted['ref']} is not the one baked (another of that name, or its files changed)"
    return f"it holds {held} at revision {baked.get('revision', 'default')}, not {wanted.get('revision', 'default')}"


def update_adapters(out: Path, adapters: list[AdapterSpec], token: str | None = None) -> dict | None:
    """Re-bakes only the adapters of the bake in `out` when they differ from `adapters`; returns the new manifest,
    or None when they were already those. The model's files are left as they are."""
    manifest = json.loads((out / MANIFEST).read_text())
    if [(a["name"], a["source"]) for a in manifest.get("adapters", [])] == [
        (s.name, adapter_identity(s)) for s in adapters
    ]:
        return None
    staging = Path(tempfile.mkdtemp(prefix=".adapters.", dir=out))
    try:
        # NOTE: staged in a folder of its own, whose adapters/ moves into place once all of them passed.
        (staging / "config.json").symlink_to(out / "config.json")
        manifest["adapters"] = bake_adapters(adapters, staging, manifest["served_model_name"], token)
        if adapters:
            _replace(staging / ADAPTERS_DIR, out / ADAPTERS_DIR)
        else:
            shutil.rmtree(out / ADAPTERS_DIR, ignore_errors=True)
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        (staging / MANIFEST).replace(out / MANIFEST)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def check_folder(folder: Path) -> str:
    """Fail with one line unless the folder holds config, safetensors weights and a tokenizer we can run."""
    from engine.errors import UnsupportedModel
    from engine.model.folder_check import check_model_folder

    try:
        return check_model_folder(folder)
    except UnsupportedModel as exc:
        raise BakeError(str(exc)) from None


def _save_tokenizer(folder: Path) -> str:
    """Load the tokenizer with transformers and save it back, so tokenizer.json holds the exact pipeline
    transformers runs (its tokenizer class for the config's model_type may replace the file's pre-tokenizer,
    add_bos_token rebuilds the post-processor, a sentencepiece model is converted): the worker runs that file
    with `tokenizers` alone (engine/text/tokenizer.py). Returns what saved it, for the manifest."""
    import transformers
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(folder).save_pretrained(folder)
    except (ValueError, OSError, KeyError) as exc:
        raise BakeError(f"transformers cannot load the tokenizer: {str(exc).splitlines()[0]}") from None
    if not (folder / "tokenizer.json").is_file():
        raise BakeError("the tokenizer cannot be saved as tokenizer.json (it has no `tokenizers` form)")
    return f"transformers {transformers.__version__}"


def _convert_bin_weights(folder: Path) -> None:
    """PyTorch .bin checkpoints become safetensors, so the engine reads one format only."""
    bins = sorted(folder.glob("*.bin"))
    if not bins or list(folder.glob("*.safetensors")):
        return
    import torch
    from safetensors.torch import save_file

    for path in tqdm(bins, desc="converting .bin to safetensors", unit="file"):
        state = torch.load(path, map_location="cpu", weights_only=True)
        # NOTE: safetensors refuses shared storage (tied weights); contiguous copies are independent.
        tensors = {k: v.contiguous().clone() for k, v in state.items()}
        save_file(tensors, folder / _safetensors_name(path.name), metadata={"format": "pt"})
        path.unlink()
    index = folder / "pytorch_model.bin.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {k: _safetensors_name(v) for k, v in data["weight_map"].items()}
        (folder / "model.safetensors.index.json").write_text(json.dumps(data, indent=2))
        index.unlink()


def _safetensors_name(bin_name: str) -> str:
    """pytorch_model-00001-of-00002.bin -> model-00001-of-00002.safetensors, as transformers names them."""
    return bin_name.replace("pytorch_model", "model").removesuffix(".bin") + ".safetensors"


def check_sums(folder: Path, digests: dict[str, str]) -> dict[str, tuple[int, int, str]]:
    """Fail with one line unless each staged file the source gives a SHA-256 for has it (a corrupted download or
    hub cache blob stops the bake). Returns name -> (size, mtime_ns, SHA-256) of the files read, so the manifest
    does not read them again."""
    sums = {}
    for name, want in sorted(digests.items()):
        path = folder / name
        if not path.is_file():  # a file of the snapshot the bake does not take
            continue
        stat = path.stat()
        got = sha256(path)
        if got != want:
            raise BakeError(
                f"{name} is not the file the hub gives (its SHA-256 is {got}, not {want}): a corrupted "
                f"download or hub cache; delete it from the cache and bake again"
            )
        sums[name] = (stat.st_size, stat.st_mtime_ns, got)
    return sums


def _manifest(
    source: Source,
    folder: Path,
    revision: str | None,
    architecture: str,
    served_name: str,
    sums: dict[str, tuple[int, int, str]],
) -> dict:
    """The bake's record. `files` holds each file's SHA-256 (the worker checks them when VERIFY_MODEL_SHA256 is
    set) and `sizes` its size in bytes (checked on every start: cheap, and catches a truncated or missing file);
    `tensor_parallel_sizes` the TENSOR_PARALLEL_SIZE values among 1, 2, 4 and 8 that split the checkpoint (its
    heads, KV heads, vocabulary, MLP and expert widths and quantization groups), by start-up's own check."""
    from engine.model.loader import tensor_parallel_sizes

    config = json.loads((folder / "config.json").read_text())
    files = [p for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST]
    return {
        "served_model_name": served_name,
        "source": identity(source),
        "revision": revision,
        "architecture": architecture,
        "dtype": str(config.get("dtype") or config.get("torch_dtype") or "float32"),
        "tensor_parallel_sizes": tensor_parallel_sizes(str(folder)),
        "files": {p.name: _known_sum(p, sums) for p in files},
        "sizes": {p.name: p.stat().st_size for p in files},
        "baked_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _known_sum(path: Path, sums: dict[str, tuple[int, int, str]]) -> str:
    """The file's SHA-256, from `sums` when it is unchanged since it was read (the tokenizer is saved anew)."""
    stat = path.stat()
    size, mtime_ns, digest = sums.get(path.name, (-1, -1, ""))
    return digest if (size, mtime_ns) == (stat.st_size, stat.st_mtime_ns) else sha256(path)


def _replace(staging: Path, out: Path) -> None:
    """Swap the staged folder into place; the old bake is only removed once the new one is there."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
    staging.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
