"""openai-harmony's o200k_harmony encoding, loaded from the o200k file the bake put next to the model.

openai-harmony reads o200k_base.tiktoken from the folder in TIKTOKEN_ENCODINGS_BASE (hash-checked) and otherwise
downloads it, which a worker without internet cannot do; so the folder is set first, and a missing file is a
start-up error in one line instead of a hang on the network.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from engine.errors import StartupError
from engine.text.o200k_file import O200K_FILE
from worker.settings import point_tiktoken_at

HARMONY_MODEL_TYPES = ("gpt_oss",)


@lru_cache(maxsize=4)
def harmony_encoding(folder: str) -> Any:
    """openai_harmony.HarmonyEncoding for the model in `folder` (its O200K_FILE read from there)."""
    if not (Path(folder) / O200K_FILE).is_file():
        raise StartupError(
            f"{O200K_FILE} is missing from the model folder; gpt-oss's harmony format needs it "
            f"(the bake writes it: re-bake the model)"
        )
    point_tiktoken_at(str(folder))
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as exc:  # openai-harmony's hash check or a corrupt file
        raise StartupError(f"openai-harmony could not load {O200K_FILE} from the model folder: {exc}") from None
