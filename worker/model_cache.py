"""Which model folder the worker serves when none is named: the bake in BASE_PATH/model when it is of MODEL_NAME
(or MODEL_NAME is unset, or not a hub id), else MODEL_NAME's snapshot in a hub cache, read in place.

The caches are looked at in this order: RunPod's model cache (MODEL_CACHE_PATH), HF_HOME's hub cache, BASE_PATH
(a network volume). A snapshot is `models--ORG--NAME/snapshots/REVISION`, REVISION being MODEL_REVISION (a commit,
or a branch or tag through `refs/`) or `refs/main`; the folder name is matched case-insensitively, since caches
written by other tools lower-case it. The served name stays MODEL_NAME: a folder name is a path detail.

Nothing is copied, written or downloaded (HF_HUB_OFFLINE is set). The checks the bake makes run here instead
(engine/model/folder_check.py). Two things only the bake fixes are refused in one line saying so: PyTorch .bin
weights (the bake converts them to safetensors) and a tokenizer without tokenizer.json (the bake converts a
sentencepiece model); converting them at start-up would cost every cold start and need a writable copy.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from engine.errors import StartupError, UnsupportedModel
from worker.settings import MANIFEST, Settings, keep_hub_offline

log = logging.getLogger("worker")

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def locate_model(settings: Settings) -> Settings:
    """`settings` with MODEL_PATH pointing at the folder to serve; StartupError (one line naming every path looked
    at) when MODEL_NAME names a hub repo that is neither baked nor in a cache."""
    name = settings.model_name
    if settings.model_path_env or not name or not HUB_ID.match(name) or Path(name).exists():
        return settings  # MODEL_PATH, or the bake (the engine names what is missing when there is none)
    bake = Path(settings.model_path)
    held = _baked_names(bake)
    if name.lower() in held:
        return settings
    looked = [f"{bake} ({'a bake of ' + sorted(held)[0] if held else 'no bake'})"]
    for root in hub_cache_roots(settings):
        snapshot = find_snapshot(root, name, settings.model_revision, looked)
        if snapshot is not None:
            check_snapshot(snapshot, name)
            keep_hub_offline()
            log.info("serving MODEL_NAME=%s from the hub cache snapshot %s, in place", name, snapshot)
            return settings.model_copy(update={"model_path_env": str(snapshot)})
    raise StartupError(
        f"MODEL_NAME={name} is neither baked nor in a hub cache; looked at: {'; '.join(looked)}", param="MODEL_NAME"
    )


def hub_cache_roots(settings: Settings) -> list[Path]:
    """RunPod's model cache, then HF_HOME's hub cache (HF_HUB_CACHE when set), then BASE_PATH."""
    return list(dict.fromkeys(Path(p) for p in (settings.model_cache_path, settings.hub_cache, settings.base_path)))


def find_snapshot(root: Path, name: str, revision: str | None, looked: list[str]) -> Path | None:
    """The snapshot folder of repo `name` at `revision` (None: main) under the hub cache `root`; each place that
    held none is added to `looked`."""
    wanted = "models--" + name.replace("/", "--")
    repos = [p for p in _entries(root) if p.name.lower() == wanted.lower()]
    repos.sort(key=lambda p: p.name != wanted)  # the exact spelling first
    if not repos:
        looked.append(str(root / wanted))
    rev = revision or "main"
    for repo in repos:
        snapshot = repo / "snapshots" / rev
        if not snapshot.is_dir() and (repo / "refs" / rev).is_file():
            snapshot = repo / "snapshots" / (repo / "refs" / rev).read_text().strip()
        if snapshot.is_dir():
            return snapshot
        looked.append(f"{repo} (no snapshots/{rev}, nor refs/{rev} naming one)")
    return None


def check_snapshot(snapshot: Path, name: str) -> None:
    """The bake's checks on a snapshot served as it is, plus what only the bake converts; StartupError in one line."""
    from engine.model.folder_check import check_model_folder

    where = f"MODEL_NAME={name} ({snapshot})"
    if not list(snapshot.glob("*.safetensors")) and list(snapshot.glob("*.bin")):
        raise StartupError(
            f"{where} has only PyTorch .bin weights, and the worker reads safetensors in place: "
            "bake it (python -m builder converts them)",
            param="MODEL_NAME",
        )
    if (snapshot / "config.json").is_file() and not (snapshot / "tokenizer.json").is_file():
        raise StartupError(
            f"{where} has no tokenizer.json (a sentencepiece tokenizer.model is converted only by "
            "the bake): bake it with python -m builder",
            param="MODEL_NAME",
        )
    try:
        check_model_folder(snapshot)
    except UnsupportedModel as exc:
        raise StartupError(f"{where}: {exc.message}", param="MODEL_NAME") from None


def _baked_names(bake: Path) -> set[str]:
    """The names the bake in `bake` answers to (its served name and its hub id), lower-cased; none without one."""
    try:
        manifest = json.loads((bake / MANIFEST).read_text())
    except (OSError, ValueError):
        return set()
    source = manifest.get("source") or {}
    names = {manifest.get("served_model_name"), source.get("ref") if source.get("kind") == "hub" else None}
    return {n.lower() for n in names if isinstance(n, str) and n}


def _entries(root: Path) -> list[Path]:
    try:
        return sorted(root.iterdir())
    except OSError:
        return []
