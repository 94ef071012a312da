"""The bake refuses what the worker's start refuses once it builds the model from the config (its rotary tables, its
spec), in one line naming the config key, and leaves nothing behind; a rope the engine runs still bakes."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from builder.__main__ import main as builder_main
from engine.model.loader import load_model
from tests.builder.test_bake import leftovers, tiny_folder

PARTIAL_ROTARY = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4, "long_factor": [1.0] * 4}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, baked_model_path: Path) -> Path:
    return tiny_folder(LlamaConfig, LlamaForCausalLM, tmp_path_factory.mktemp("tiny-llama"), baked_model_path, seed=0)


def with_config(src: Path, dst: Path, **change: object) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **change}))
    return dst


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rope_parameters": PARTIAL_ROTARY}, "partial_rotary_factor != 1 is not supported"),
        # transformers 4's place for it (Phi-4-mini's config): transformers moves it into rope_parameters
        ({"partial_rotary_factor": 0.75}, "partial_rotary_factor != 1 is not supported"),
        # LongRoPE without its original context (a Phi-3 config carries it at the top level)
        ({"rope_parameters": LONGROPE}, "rope type 'longrope' needs original_max_position_embeddings"),
    ],
    ids=["partial-rotary", "top-level-partial-rotary", "longrope"],
)
def test_a_rope_start_up_refuses_fails_the_bake_in_one_line(
    tmp_path: Path, tiny_llama: Path, capsys, change, message
) -> None:
    source = with_config(tiny_llama, tmp_path / "src", **change)
    out = tmp_path / "models" / "model"
    assert builder_main(["--model", str(source), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"error: the engine cannot run this model: {message}"
    assert leftovers(out.parent) == []


def test_a_rope_the_engine_runs_still_bakes(tmp_path: Path, tiny_llama: Path) -> None:
    llama3 = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    }
    source = with_config(tiny_llama, tmp_path / "src", rope_parameters=llama3, partial_rotary_factor=1.0)
    assert builder_main(["--model", str(source), "--out", str(tmp_path / "model")]) == 0


def test_longrope_bakes_without_a_served_context_and_the_worker_names_its_own(
    tmp_path: Path, tiny_llama: Path, caplog
) -> None:
    longrope = {**LONGROPE, "original_max_position_embeddings": 64}
    source = with_config(tiny_llama, tmp_path / "src", rope_parameters=longrope)
    out = tmp_path / "model"
    with caplog.at_level(logging.INFO, logger="engine.model.layers.rotary"):
        assert builder_main(["--model", str(source), "--out", str(out)]) == 0
        # The bake's check builds the rotary for one position: the context the worker will serve is not its to say.
        assert not [r for r in caplog.records if "LongRoPE" in r.getMessage()]
        load_model(str(out), torch.float32, torch.device("cpu"), max_model_len=32)
    lines = [r.getMessage() for r in caplog.records if "LongRoPE" in r.getMessage()]
    assert lines == ["LongRoPE: the short factors for a served context of 32 (original 64)"]
