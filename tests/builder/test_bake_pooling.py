"""The bake keeps a model's sentence-transformers pooling files (the Pooling module's folder too), and fails with one
line on a module or pooling mode the engine cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from builder.bake import bake
from builder.errors import BakeError
from builder.sources import resolve
from engine.model.loader import read_config
from engine.model.pooling import read_pooling
from tests.builder.test_bake import tiny_folder

MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]


def embedding_folder(folder: Path, baked_model_path: Path, modules: list[dict], mode: str) -> Path:
    tiny_folder(LlamaConfig, LlamaForCausalLM, folder, baked_model_path, seed=0)
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {}}))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, mode: True}))
    return folder


def test_the_pooling_files_are_baked_and_read(tmp_path: Path, baked_model_path: Path) -> None:
    source = embedding_folder(tmp_path / "src", baked_model_path, MODULES, "pooling_mode_mean_tokens")
    bake(resolve(str(source), None), tmp_path / "out")
    out = tmp_path / "out"
    for name in ("modules.json", "config_sentence_transformers.json", "1_Pooling/config.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    pooling = read_pooling(str(out), read_config(str(out)))
    assert (pooling.method, pooling.normalize, pooling.source) == ("mean", True, "sentence-transformers")


@pytest.mark.parametrize(
    ("modules", "mode", "message"),
    [
        (
            MODULES + [{"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}],
            "pooling_mode_mean_tokens",
            "sentence-transformers module 'sentence_transformers.models.Dense' (3_Dense)",
        ),
        (MODULES, "pooling_mode_max_tokens", "pooling mode pooling_mode_max_tokens is not supported"),
    ],
)
def test_a_pooling_the_engine_cannot_run_fails_the_bake(
    tmp_path: Path, baked_model_path: Path, modules, mode, message
) -> None:
    source = embedding_folder(tmp_path / "src", baked_model_path, modules, mode)
    with pytest.raises(BakeError) as err:
        bake(resolve(str(source), None), tmp_path / "out")
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()
