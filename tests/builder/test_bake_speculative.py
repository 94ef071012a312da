"""SPECULATIVE_CONFIG at bake time: an EAGLE-3 head or a draft model named by hub id is baked into
BASE_PATH/speculative beside the kept model (from a hub cache here, offline), checked against the model (a head for
another hidden size, a draft with another tokenizer: one line, nothing baked), kept by --if-missing, and found by
a worker started with the same SPECULATIVE_CONFIG; method mtp fetches nothing and needs the model's own head."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_bake import run_baker, tiny_folder
from transformers import LlamaConfig, LlamaForCausalLM

from tests.engine.core.eagle3_heads import write_head

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def base_with_model(root: Path, baked: Path) -> Path:
    """A BASE_PATH whose model is the baked default (its files linked, its manifest copied): --if-missing keeps it."""
    model = root / "model"
    model.mkdir(parents=True)
    for path in baked.iterdir():
        if path.is_file() and path.name != "manifest.json":
            (model / path.name).symlink_to(path.resolve())
    shutil.copy(baked / "manifest.json", model / "manifest.json")
    return root


def in_hub_cache(cache: Path, repo: str, folder: Path) -> None:
    """`folder`'s files as the snapshot of `repo` at COMMIT, with refs/main naming it."""
    entry = cache / ("models--" + repo.replace("/", "--"))
    shutil.copytree(folder, entry / "snapshots" / COMMIT)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(COMMIT)


def bake(base: Path, cache: Path, method: str, repo: str):
    config = json.dumps({"method": method, "model": repo, "num_speculative_tokens": 3})
    return run_baker(
        "--if-missing",
        "--out",
        str(base / "model"),
        env={"SPECULATIVE_CONFIG": config, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"},
    )


@pytest.fixture(scope="module")
def cache(tmp_path_factory, baked_model_path: Path) -> Path:
    root = tmp_path_factory.mktemp("spec-cache")
    target = json.loads((baked_model_path / "config.json").read_text())
    write_head(root / "src" / "head", target)
    write_head(root / "src" / "narrow", {**target, "hidden_size": 512})
    in_hub_cache(root / "hub", "org/smol-eagle3", root / "src" / "head")
    in_hub_cache(root / "hub", "org/narrow-eagle3", root / "src" / "narrow")
    draft = tiny_folder(LlamaConfig, LlamaForCausalLM, root / "src" / "draft", baked_model_path, seed=1)
    in_hub_cache(root / "hub", "org/tiny-draft", draft)
    other = tiny_folder(LlamaConfig, LlamaForCausalLM, root / "src" / "other", baked_model_path, seed=2)
    vocab = json.loads((other / "tokenizer.json").read_text())
    ids = vocab["model"]["vocab"]
    a, b = (next(t for t, i in ids.items() if i == n) for n in (1000, 1001))
    ids[a], ids[b] = 1001, 1000  # the same tokens under other ids: another tokenizer
    (other / "tokenizer.json").write_text(json.dumps(vocab))
    in_hub_cache(root / "hub", "org/other-draft", other)
    return root / "hub"


def test_an_eagle3_head_is_baked_beside_the_model_and_kept(tmp_path, baked_model_path, cache) -> None:
    base = base_with_model(tmp_path, baked_model_path)
    result = bake(base, cache, "eagle3", "org/smol-eagle3")
    assert result.returncode == 0, result.stderr
    assert "baked eagle3 org/smol-eagle3" in result.stdout
    manifest = json.loads((base / "speculative" / "manifest.json").read_text())
    assert manifest["speculative_method"] == "eagle3" and manifest["source"] == {
        "kind": "hub",
        "ref": "org/smol-eagle3",
    }
    assert set(manifest["files"]) == {"config.json", "model.safetensors"}
    again = bake(base, cache, "eagle3", "org/smol-eagle3")
    assert again.returncode == 0 and "already baked" in again.stdout


def test_a_draft_model_with_the_models_tokenizer_is_baked(tmp_path, baked_model_path, cache) -> None:
    base = base_with_model(tmp_path, baked_model_path)
    result = bake(base, cache, "draft_model", "org/tiny-draft")
    assert result.returncode == 0, result.stderr
    manifest = json.loads((base / "speculative" / "manifest.json").read_text())
    assert manifest["speculative_method"] == "draft_model" and (base / "speculative" / "tokenizer.json").is_file()


@pytest.mark.parametrize(
    "method, repo, words",
    [
        (
            "eagle3",
            "org/narrow-eagle3",
            "the EAGLE-3 head at org/narrow-eagle3 reads hidden states of size 512; the model's are 576",
        ),
        ("draft_model", "org/other-draft", "the draft model org/other-draft has another tokenizer than the model's"),
        ("eagle3", "org/not-cached", "cannot reach the Hugging Face hub to download org/not-cached"),
    ],
)
def test_a_speculative_model_that_does_not_fit_fails_the_bake_in_one_line(
    tmp_path, baked_model_path, cache, method, repo, words
) -> None:
    base = base_with_model(tmp_path, baked_model_path)
    result = bake(base, cache, method, repo)
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and words in result.stderr, result.stderr
    assert not (base / "speculative").exists()


def test_a_worker_with_the_same_config_serves_the_baked_head(tmp_path, baked_model_path, cache) -> None:
    from tests.worker.local_worker import start_worker, stop_worker

    base = base_with_model(tmp_path, baked_model_path)
    assert bake(base, cache, "eagle3", "org/smol-eagle3").returncode == 0
    config = json.dumps({"method": "eagle3", "model": "org/smol-eagle3", "num_speculative_tokens": 3})
    worker = start_worker(
        base / "model",
        tmp_path / "worker.log",
        BASE_PATH=str(base),
        SPECULATIVE_CONFIG=config,
        HF_HUB_OFFLINE="1",
        MODEL_CACHE_PATH=str(tmp_path / "no-cache"),
    )
    try:
        reply = worker.client().chat.completions.create(
            model=json.loads((base / "model" / "manifest.json").read_text())["served_model_name"],
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=8,
            temperature=0,
        )
        assert reply.choices[0].message.content
        assert f"EAGLE-3 head {base / 'speculative'}" in worker.log.read_text()
    finally:
        stop_worker(worker)


def test_mtp_fetches_nothing_and_needs_the_models_own_head(tmp_path, baked_model_path) -> None:
    """Method mtp: a model that ships mtp.* tensors bakes with them kept; one without fails the bake in one line."""
    from safetensors import safe_open

    from tests.engine.core.hybrid_spec import hybrid_target

    config = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
    folder = hybrid_target("qwen3_5_text", tmp_path / "hybrid", baked_model_path, mtp=True)
    result = run_baker("--model", str(folder), "--out", str(tmp_path / "out"), env={"SPECULATIVE_CONFIG": config})
    assert result.returncode == 0, result.stderr
    assert "ships its head" in result.stdout and not (tmp_path / "speculative").exists()
    names = set()
    for path in (tmp_path / "out").glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    assert "mtp.fc.weight" in names and "mtp.layers.0.self_attn.q_proj.weight" in names
    base = base_with_model(tmp_path / "plain", baked_model_path)
    result = run_baker("--if-missing", "--out", str(base / "model"), env={"SPECULATIVE_CONFIG": config})
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and "has none" in result.stderr, result.stderr


def test_mtp_takes_the_next_n_layer_deepseek_and_glm_checkpoints_ship(tmp_path, baked_model_path) -> None:
    """Method mtp on GLM-4.5 / DeepSeek-V3: a checkpoint with its next-n prediction layer (model.layers.{n}.*) bakes
    with the layer kept; a DeepSeek-V3 one without it fails the bake in one line."""
    from safetensors import safe_open

    from tests.engine.core.next_n_spec import add_random_next_n, build_target

    config = json.dumps({"method": "mtp", "num_speculative_tokens": 1})
    hf = build_target("glm4_moe", tmp_path / "glm", baked_model_path)
    add_random_next_n(tmp_path / "glm", hf, own=False)
    result = run_baker(
        "--model", str(tmp_path / "glm"), "--out", str(tmp_path / "out"), env={"SPECULATIVE_CONFIG": config}
    )
    assert result.returncode == 0, result.stderr
    assert "ships its next-n prediction layer" in result.stdout
    names = set()
    for path in (tmp_path / "out").glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    n = hf.config.num_hidden_layers
    assert f"model.layers.{n}.eh_proj.weight" in names and f"model.layers.{n}.self_attn.q_proj.weight" in names
    build_target("deepseek_v3", tmp_path / "plain", baked_model_path)
    result = run_baker(
        "--model", str(tmp_path / "plain"), "--out", str(tmp_path / "out2"), env={"SPECULATIVE_CONFIG": config}
    )
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and "has none" in result.stderr, result.stderr
    assert f"model.layers.{n}.eh_proj" in result.stderr
