"""Fixtures shared by every test package: where the baked default model lives."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def baked_model_dir() -> Path:
    base = Path(os.environ.get("BASE_PATH", ROOT / ".models"))
    return Path(os.environ.get("MODEL_PATH", base / "model"))


@pytest.fixture(scope="session")
def baked_model_path() -> Path:
    path = baked_model_dir()
    if not (path / "config.json").is_file():
        pytest.skip(f"no baked model at {path}: run `make test`, which bakes it first")
    return path
