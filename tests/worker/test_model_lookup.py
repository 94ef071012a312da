"""Where the worker finds its model without MODEL_PATH (worker/model_cache.py), on folders made here: a bake of
MODEL_NAME wins, then RunPod's model cache, HF_HOME's hub cache and BASE_PATH in that order; a snapshot only the
bake could fix is refused in one line, and the bake's own checks give the bake's own words."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hub_cache import COMMIT, NAME, make_cache

from builder.bake import check_folder
from builder.errors import BakeError
from engine.errors import StartupError
from worker.model_cache import locate_model
from worker.settings import accepted_model_names, load_settings, served_model_name

FOLDER = "models--HuggingFaceTB--SmolLM2-135M-Instruct"


def settings_for(tmp_path: Path, **env: str):
    roots = {"runpod": tmp_path / "runpod", "hf": tmp_path / "hf-home" / "hub", "base": tmp_path / "base"}
    for root in roots.values():
        root.mkdir(parents=True, exist_ok=True)
    settings = load_settings(
        {
            "MODEL_NAME": NAME,
            "MODEL_CACHE_PATH": str(roots["runpod"]),
            "BASE_PATH": str(roots["base"]),
            "HF_HOME": str(tmp_path / "hf-home"),
            **env,
        }
    )
    return settings, roots


def snapshot_folder(tmp_path: Path, config: dict, files: tuple[str, ...]) -> Path:
    """A one-repo cache under tmp_path/runpod whose snapshot holds `config` and empty `files`."""
    snapshot = tmp_path / "runpod" / FOLDER / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(COMMIT)
    (snapshot / "config.json").write_text(json.dumps(config))
    for name in files:
        (snapshot / name).write_bytes(b"")
    return snapshot


def test_a_bake_of_model_name_wins_over_every_cache(baked_model_path, tmp_path) -> None:
    settings, roots = settings_for(tmp_path, MODEL_NAME=NAME.lower())
    shutil.copytree(baked_model_path, roots["base"] / "model", ignore=shutil.ignore_patterns("*.safetensors"))
    make_cache(roots["runpod"], baked_model_path, FOLDER)
    assert locate_model(settings) == settings
    assert served_model_name(settings) == NAME  # the manifest's spelling


def test_the_caches_are_read_in_order_and_the_served_name_is_model_name(baked_model_path, tmp_path) -> None:
    settings, roots = settings_for(tmp_path)
    shutil.copytree(baked_model_path, roots["base"] / "model", ignore=shutil.ignore_patterns("*.safetensors"))
    manifest = roots["base"] / "model" / "manifest.json"  # a bake of another model does not stand in for it
    manifest.write_text(json.dumps({"served_model_name": "other/Model", "source": {"kind": "hub", "ref": "o/M"}}))
    found = {}
    for key in ("base", "hf", "runpod"):  # each root added takes over from the ones after it in the order
        found[key] = make_cache(roots[key], baked_model_path, FOLDER.lower() if key == "hf" else FOLDER)
        located = locate_model(settings)
        assert located.model_path == str(found[key]), key
        assert served_model_name(located) == NAME and accepted_model_names(located) == [NAME]


def test_a_missing_revision_names_the_repo_folder_it_found(baked_model_path, tmp_path) -> None:
    settings, roots = settings_for(tmp_path, MODEL_REVISION="v2.0")
    make_cache(roots["runpod"], baked_model_path, FOLDER)
    with pytest.raises(StartupError) as info:
        locate_model(settings)
    assert f"{roots['runpod'] / FOLDER} (no snapshots/v2.0, nor refs/v2.0 naming one)" in info.value.message
    assert f"{roots['base'] / 'model'} (no bake)" in info.value.message and "\n" not in info.value.message


def test_a_name_that_is_no_hub_id_leaves_the_bake_to_the_engine(tmp_path) -> None:
    settings, _ = settings_for(tmp_path, MODEL_NAME="my-alias")
    assert locate_model(settings) == settings


@pytest.mark.parametrize(
    "files, says",
    [
        (
            ("pytorch_model.bin", "tokenizer.json", "tokenizer_config.json"),
            "has only PyTorch .bin weights, and the worker reads safetensors in place: "
            "bake it (python -m builder converts them)",
        ),
        (
            ("model.safetensors", "tokenizer.model", "tokenizer_config.json"),
            "has no tokenizer.json (a sentencepiece tokenizer.model is converted only by the bake): "
            "bake it with python -m builder",
        ),
    ],
)
def test_what_only_the_bake_converts_is_refused_in_one_line(tmp_path, files, says) -> None:
    settings, _ = settings_for(tmp_path)
    snapshot = snapshot_folder(tmp_path, {"architectures": ["LlamaForCausalLM"]}, files)
    with pytest.raises(StartupError) as info:
        locate_model(settings)
    assert info.value.message == f"MODEL_NAME={NAME} ({snapshot}) {says}"


@pytest.mark.parametrize(
    "config, files",
    [
        ({"architectures": ["FalconForCausalLM"]}, ("model.safetensors", "tokenizer.json", "tokenizer_config.json")),
        ({"architectures": ["LlamaForCausalLM"]}, ("model.safetensors", "tokenizer.json")),
    ],
)
def test_the_bakes_checks_run_at_start_up_in_the_bakes_words(tmp_path, config, files) -> None:
    settings, _ = settings_for(tmp_path)
    snapshot = snapshot_folder(tmp_path, config, files)
    with pytest.raises(BakeError) as baked:
        check_folder(snapshot)
    with pytest.raises(StartupError) as started:
        locate_model(settings)
    assert started.value.message == f"MODEL_NAME={NAME} ({snapshot}): {baked.value}"
    assert "\n" not in started.value.message
