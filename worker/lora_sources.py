"""Where a LoRA adapter that is not baked comes from: LORA_MODULES at start-up and /v1/load_lora_adapter's
lora_path (worker/lora_routes.py).

An adapter's `path` is a folder, or a hub repo id looked up as the model is (worker/model_cache.py): RunPod's
model cache, HF_HOME's hub cache, BASE_PATH; and last downloaded from the hub unless HF_HUB_OFFLINE is set.
"""

from __future__ import annotations

from pathlib import Path

from engine.config import AdapterSpec, parse_lora_modules
from engine.errors import StartupError
from worker.model_cache import HUB_ID, find_snapshot, hub_cache_roots
from worker.openai.errors import AdapterNotFound
from worker.settings import Settings, hub_is_offline

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def startup_adapters(settings: Settings, baked: dict[str, str]) -> dict[str, str]:
    """The baked adapters plus those LORA_MODULES names that the bake lacks (name -> folder); StartupError in one
    line when one cannot be found."""
    if not settings.enable_lora:
        return {}
    adapters = dict(baked)
    for spec in parse_lora_modules(settings.lora_modules):
        if spec.name not in adapters:
            try:
                adapters[spec.name] = locate_adapter(spec, settings)
            except AdapterNotFound as exc:
                raise StartupError(f"LORA_MODULES: {exc.message}", param="LORA_MODULES") from None
    return adapters


def locate_adapter(spec: AdapterSpec, settings: Settings) -> str:
    """The folder holding the adapter's PEFT files; AdapterNotFound naming every place looked at."""
    local = Path(spec.path).expanduser()
    if local.is_dir():
        return str(local)
    looked = [str(local)]
    if HUB_ID.match(spec.path):
        for root in hub_cache_roots(settings):
            snapshot = find_snapshot(root, spec.path, None, looked)
            if snapshot is not None:
                return str(snapshot)
        if not hub_is_offline():
            return _download(spec.path, looked)
        looked.append("the hub (HF_HUB_OFFLINE is set)")
    raise AdapterNotFound(
        f"No adapter found for {spec.name!r} at {spec.path!r}; looked at: {'; '.join(looked)}", param="lora_path"
    )


def _download(repo: str, looked: list[str]) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return snapshot_download(repo, allow_patterns=list(ADAPTER_FILES))  # HF_TOKEN from the environment
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        looked.append(f"the hub ({type(exc).__name__})")
        raise AdapterNotFound(
            f"No adapter found for {repo!r}; looked at: {'; '.join(looked)}", param="lora_path"
        ) from None
