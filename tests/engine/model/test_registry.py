"""The architecture registry imports a family's module only when a checkpoint names it: loading the default Llama
bake leaves the other families unimported (their modules are cold-start time a Llama worker never uses)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import UnsupportedModel
from engine.model.models import ARCHITECTURES, model_class

ROOT = Path(__file__).resolve().parents[3]
OTHER_FAMILIES = (
    "bert",
    "deepseek_v2",
    "falcon_h1",
    "ernie4_5_moe",
    "gemma_args",
    "gemma_base",
    "gemma_layers",
    "gemma2",
    "gemma3",
    "gemma4",
    "gemma4_moe",
    "glm4_moe",
    "gpt_oss",
    "granite",
    "granitemoehybrid",
    "mistral3",
    "mixtral",
    "modernbert",
    "nomic_bert",
    "olmo2",
    "phi3",
    "phimoe",
    "olmoe",
    "qwen2_5_vl",
    "qwen3_moe",
)


def test_loading_the_default_llama_imports_no_other_family(baked_model_path: Path) -> None:
    code = (
        "import json, sys; import engine.model.models; "
        "from engine.config import EngineConfig; from engine.core.engine import LLMEngine; "
        "LLMEngine(EngineConfig(model_path=sys.argv[1], num_kv_pages=16)); "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('engine.model.models.'))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(baked_model_path)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert "engine.model.models.llama" in loaded
    assert not [m for m in loaded if m.rsplit(".", 1)[1] in OTHER_FAMILIES], loaded


def test_every_registered_architecture_resolves_to_its_class() -> None:
    for architecture, (_, name) in ARCHITECTURES.items():
        cls = model_class(architecture)
        assert cls.__name__ == name and callable(cls.read_args), architecture
    assert model_class("MistralForCausalLM") is model_class("LlamaForCausalLM")


def test_an_unknown_architecture_names_the_supported_ones() -> None:
    with pytest.raises(UnsupportedModel, match="T5EncoderModel.*LlamaForCausalLM"):
        model_class("T5EncoderModel")


@pytest.mark.parametrize(
    "model_type, missing",
    [
        ("deepseek_v32", "DeepSeek sparse attention"),
        ("glm_moe_dsa", "DeepSeek sparse attention"),
        ("deepseek_v4", "compressed sparse attention"),
    ],
)
def test_a_family_not_built_yet_fails_the_folder_check_naming_what_is_missing(tmp_path, model_type, missing) -> None:
    """DeepSeek V3.2 / GLM-5 / V4 configs as transformers writes them: the bake's folder check fails in one line that
    says what the engine lacks, not with the list of supported architectures."""
    from transformers import AutoConfig

    from engine.model.folder_check import check_model_folder

    config = AutoConfig.for_model(model_type)
    config.architectures = [f"{type(config).__name__.removesuffix('Config')}ForCausalLM"]
    config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel) as refused:
        check_model_folder(tmp_path)
    assert missing in str(refused.value) and "supported:" not in str(refused.value)
    assert "\n" not in str(refused.value)
