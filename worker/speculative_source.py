"""Where SPECULATIVE_CONFIG's `model` (a draft model or an EAGLE-3 head) is read from at start-up.

In order: an absolute folder; BASE_PATH/speculative when the builder baked that `model` there (its manifest's
source); a folder relative to BASE_PATH; a hub repo id's snapshot in a hub cache (worker/model_cache.py). Anything
else stops the start in one line naming where it looked.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.errors import StartupError
from worker.model_cache import HUB_ID, find_snapshot, hub_cache_roots
from worker.settings import Settings

SPECULATIVE_DIR = "speculative"  # builder/speculative.py bakes there


def locate_speculative(model: str, settings: Settings) -> str:
    if Path(model).is_absolute():
        return model
    base = Path(settings.base_path)
    baked = base / SPECULATIVE_DIR
    held = _baked_source(baked)
    if held == model:
        return str(baked)
    relative = base / model
    if relative.is_dir() or not HUB_ID.match(model):
        return str(relative)  # the engine names a missing folder itself
    looked = [str(relative), f"{baked} ({'a bake of ' + held if held else 'no bake'})"]
    for root in hub_cache_roots(settings):
        snapshot = find_snapshot(root, model, None, looked)
        if snapshot is not None:
            return str(snapshot)
    raise StartupError(
        f"SPECULATIVE_CONFIG's model {model} is neither baked nor in a hub cache; looked at: {'; '.join(looked)}",
        param="SPECULATIVE_CONFIG",
    )


def _baked_source(folder: Path) -> str | None:
    try:
        return (json.loads((folder / "manifest.json").read_text()).get("source") or {}).get("ref")
    except (OSError, ValueError, AttributeError):
        return None
