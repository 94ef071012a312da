"""The bake's o200k_base.tiktoken for openai-harmony: written from tokenizer.json, refused unless it is o200k."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import pytest
from openai_harmony import HarmonyEncodingName, HarmonyError, load_harmony_encoding
from tokenizers import Tokenizer

from builder.errors import BakeError
from builder.harmony_vocab import O200K_FILE, O200K_RANKS, tiktoken_vocab, write_harmony_vocab


def test_each_line_spells_its_token_as_bytes(baked_model_path: Path) -> None:
    # SmolLM2's byte-level BPE: the tokens of a text, spelled through the file, give back the text's bytes.
    path = baked_model_path / "tokenizer.json"
    size = len(json.loads(path.read_text())["model"]["vocab"])
    lines = tiktoken_vocab(path, size).decode().splitlines()
    assert len(lines) == size
    spelled = {}
    for rank, line in enumerate(lines):
        token, number = line.split(" ")
        assert int(number) == rank
        spelled[rank] = base64.b64decode(token)
    assert len(set(spelled.values())) == size, "two ranks spell the same bytes"
    text = "Grüße, 東京! naïve café 🙂\n\tx = f(y) ** 2"
    ids = Tokenizer.from_file(str(path)).encode(text, add_special_tokens=False).ids
    assert b"".join(spelled[i] for i in ids) == text.encode()


def test_a_tokenizer_that_is_not_o200k_fails_in_one_line(tmp_path: Path, baked_model_path: Path) -> None:
    shutil.copy(baked_model_path / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(BakeError, match=f"below id {O200K_RANKS}; harmony's o200k has {O200K_RANKS}"):
        write_harmony_vocab(tmp_path)
    # As many tokens as o200k but other ones: the hash says so.
    byte_chars = [c for c in json.loads((tmp_path / "tokenizer.json").read_text())["model"]["vocab"] if len(c) == 1]
    vocab = {f"{byte_chars[i % len(byte_chars)]}{i}": i for i in range(O200K_RANKS)}
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab}}))
    with pytest.raises(BakeError, match="not o200k's .*so the harmony format cannot be served"):
        write_harmony_vocab(tmp_path)
    assert not (tmp_path / O200K_FILE).exists()


def test_harmony_loads_its_vocabulary_from_the_folder_it_is_told(tmp_path: Path, monkeypatch) -> None:
    # The offline route the bake prepares: TIKTOKEN_ENCODINGS_BASE is read, and the file is hash-checked there
    # (a wrong file is a hash mismatch, not a download attempt).
    (tmp_path / O200K_FILE).write_bytes(base64.b64encode(b"a") + b" 0\n")
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(tmp_path))
    with pytest.raises(HarmonyError, match="hash mismatch"):
        load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
