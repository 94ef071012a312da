"""LORA_MODULES: LoRA adapters (hub repos or local folders, PEFT layout) baked beside the model.

Each adapter is checked against the model it is baked with (architecture and shapes, and base_model_name
when the spec gives one) and stored in <model>/adapters/<name>/; the manifest lists their names, ranks,
target modules and checksums, and the worker serves exactly those.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from builder.digest import sha256
from builder.errors import BakeError
from builder.sources import fingerprint, hub_snapshot
from engine.config import AdapterSpec
from engine.config import parse_lora_modules as parse_specs
from engine.errors import StartupError

ADAPTERS_DIR = "adapters"


def parse_lora_modules(value: str | None) -> list[AdapterSpec]:
    """LORA_MODULES as vLLM writes it (engine.config.parse_lora_modules); BakeError in one line when it is bad."""
    try:
        return parse_specs(value)
    except StartupError as exc:
        raise BakeError(exc.message) from None


def bake_adapters(specs: list[AdapterSpec], model: Path, served_name: str, token: str | None) -> list[dict]:
    """Fetches and checks each adapter into model/adapters/<name>/; returns the manifest's entries."""
    from transformers import AutoConfig

    from engine.errors import UnsupportedModel
    from engine.model.adapters import ADAPTER_FILES, check_adapter, projection_shapes

    if not specs:
        return []
    config = AutoConfig.from_pretrained(model)
    try:
        shapes, num_layers = projection_shapes(config), config.num_hidden_layers
    except (AttributeError, RuntimeError) as exc:  # per-layer shapes (Gemma 4's config refuses one global value)
        raise BakeError(f"LoRA adapters are not supported on {config.model_type} models: {exc}") from None
    entries = []
    for spec in specs:
        if spec.name == served_name:
            raise BakeError(f"adapter name {spec.name!r} is the model's own name")
        if spec.base_model_name and spec.base_model_name != served_name:
            raise BakeError(
                f"adapter {spec.name!r} is for base model {spec.base_model_name!r}, but the baked model "
                f"is {served_name!r}"
            )
        folder = model / ADAPTERS_DIR / spec.name.replace("/", "--")
        folder.mkdir(parents=True)
        source = _fetch(spec, folder, token, ADAPTER_FILES)
        try:
            info = check_adapter(folder, shapes, num_layers)
        except UnsupportedModel as exc:
            raise BakeError(f"adapter {spec.name!r}: {exc.message}") from None
        if info.base_model and info.base_model not in (served_name, spec.base_model_name):
            print(f"note: adapter {spec.name!r} names base model {info.base_model!r}; its shapes fit {served_name}")
        entries.append(
            {
                "name": spec.name,
                "path": folder.relative_to(model).as_posix(),
                "source": source,
                "rank": info.rank,
                "lora_alpha": info.lora_alpha,
                "target_modules": info.target_modules,
                "files": {name: sha256(folder / name) for name in ADAPTER_FILES},
            }
        )
    return entries


def adapter_identity(spec: AdapterSpec) -> dict:
    """The adapter's source as the manifest records it and `--if-missing` compares it: a hub repo id, or a local
    folder's name and fingerprint (never this machine's layout)."""
    from engine.model.adapters import ADAPTER_FILES

    local = Path(spec.path).expanduser()
    if local.is_dir():
        files = [local / name for name in ADAPTER_FILES if (local / name).is_file()]
        return {"kind": "local", "ref": local.resolve().name, "fingerprint": fingerprint(local, files)}
    if spec.path.startswith((".", "/", "~")):
        raise BakeError(f"adapter {spec.name!r}: folder {spec.path!r} does not exist")
    return {"kind": "hub", "ref": spec.path}


def _fetch(spec: AdapterSpec, folder: Path, token: str | None, files: tuple[str, ...]) -> dict:
    """Copies the adapter's files into folder; returns its source for the manifest."""
    source = adapter_identity(spec)
    if source["kind"] == "local":
        origin = Path(spec.path).expanduser()
    else:
        origin = hub_snapshot(spec.path, None, token, lambda: list(files), kind="an adapter")
    for name in files:
        if (origin / name).is_file():
            shutil.copy2(origin / name, folder / name)
    return source
