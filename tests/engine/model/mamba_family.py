"""What the Mamba2 hybrids' parity and bake tests (Nemotron-H, Falcon-H1, Granite 4.0-H) check alike, each on its
family's tiny checkpoint (mamba_checkpoints.py): the state slots' shapes, a bake that serves transformers' tokens,
and a refusal in one line. (Forked choices and a prefix hit from a state snapshot: family_parity.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from builder.bake import bake
from builder.sources import resolve
from engine.errors import UnsupportedModel
from engine.model.loader import check_checkpoint
from tests.engine.conftest import TOKENIZER_FILES
from tests.engine.model.family_parity import greedy, hf_greedy, load_family, tiny_engine
from tests.engine.model.mamba_checkpoints import build_mamba_checkpoint


def load_mamba_family(model_type: str, tmp_path_factory, baked_model_path: Path) -> SimpleNamespace:
    """A module fixture's family: transformers' model, the engine's float32 model and spec, and the folder."""
    path = tmp_path_factory.mktemp(model_type)
    hf = build_mamba_checkpoint(model_type, path)
    model, spec = load_family(path, baked_model_path)
    return SimpleNamespace(hf=hf, model=model, spec=spec, path=path)


def check_state_slots(spec, layers: tuple[int, ...]) -> None:
    """The Mamba2 layers' cache indices and their slots' shapes: the tiny configs' 2 groups of 4 heads of 8, a state
    of 16 and a conv window of 4."""
    assert spec.recurrent.layers == layers
    assert spec.recurrent.state_shape == (8, 8, 16)  # heads, head_dim, d_state
    assert spec.recurrent.conv_shape == (64 + 2 * 2 * 16, 3)


def copy_tokenizer(folder: Path, baked_model_path: Path) -> None:
    for name in TOKENIZER_FILES:
        if (baked_model_path / name).exists():
            shutil.copy(baked_model_path / name, folder / name)


def check_bake_serves(src: Path, out: Path, hf, *, baked_model_path: Path, architecture: str) -> None:
    """The checkpoint at `src` (with the baked model's tokenizer) bakes into `out` as `architecture`, and the baked
    folder serves transformers' greedy tokens."""
    copy_tokenizer(src, baked_model_path)
    manifest = bake(resolve(str(src), None), out)
    assert manifest["architecture"] == architecture
    prompt = torch.randint(3, 128, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    assert greedy(tiny_engine(out), {"p": prompt}, 6)["p"] == hf_greedy(hf, prompt, 6)


def check_refused_in_one_line(path: Path, change: dict, match: str) -> None:
    """The checkpoint at `path`, its config changed by `change`, fails the bake's check in one line matching
    `match`."""
    config = json.loads((path / "config.json").read_text())
    config.update(change)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match=match) as err:
        check_checkpoint(str(path))
    assert "\n" not in str(err.value)
