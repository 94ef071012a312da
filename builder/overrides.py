"""HF_OVERRIDES (vLLM's `--hf-overrides`): config.json keys the bake sets on the model it stages.

Qwen3-Reranker ships as a Qwen3ForCausalLM; vLLM serves it as a reranker when told so with
`{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
"is_original_qwen3_reranker": true}`, and so does this worker once the bake has written those keys. Top-level keys
replace the checkpoint's; the manifest records them, so a bake with other overrides is a bake of another model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from builder.errors import BakeError


def parse_hf_overrides(text: str | None) -> dict[str, Any]:
    """The overrides as a JSON object (empty text: none); BakeError in one line otherwise."""
    if not text or not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise BakeError(f"HF_OVERRIDES is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise BakeError(
            "HF_OVERRIDES must be a JSON object of config.json keys, e.g. "
            '{"architectures": ["Qwen3ForSequenceClassification"]}'
        )
    return value


def apply_hf_overrides(folder: Path, overrides: dict[str, Any]) -> None:
    """Write the overrides into the staged config.json."""
    if not overrides:
        return
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(overrides)
    path.write_text(json.dumps(config, indent=2) + "\n")
