"""SPECULATIVE_CONFIG at bake time: the draft model or EAGLE-3 head its `model` names on the hub, baked into
BASE_PATH/speculative beside the model and checked against it, so that a worker without the hub starts with it;
for method mtp, a check that the baked model ships the head (mtp.* or a next-n layer; nothing to fetch).

A draft model is baked as the model is (builder/bake.py) and must share the model's tokenizer; an EAGLE-3 head
(config.json and its safetensors) must read hidden states of the model's size, from layers it has, over its
vocabulary. Either failing is one line and no bake. The worker finds the baked folder by the same `model` value
(worker/runtime.py). A local folder in `model` is read in place at start-up and not baked.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

from builder.bake import MANIFEST, bake
from builder.digest import sha256
from builder.errors import BakeError
from builder.sources import hub_snapshot, resolve

SPECULATIVE_DIR = "speculative"
MODEL_METHODS = ("draft_model", "eagle3")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _parse(value: str | None) -> dict | None:
    """SPECULATIVE_CONFIG as a JSON object, None when unset; BakeError in one line when it is not one."""
    if value is None or not value.strip():
        return None
    try:
        config = json.loads(value)
    except ValueError as exc:
        raise BakeError(f"SPECULATIVE_CONFIG is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise BakeError("SPECULATIVE_CONFIG must be a JSON object")
    return config


def speculative_repo(value: str | None) -> tuple[str, str] | None:
    """(method, hub repo) when SPECULATIVE_CONFIG names a draft model or EAGLE-3 head on the hub; else None."""
    config = _parse(value)
    if config is None:
        return None
    method, model = config.get("method"), config.get("model")
    if method not in MODEL_METHODS or not isinstance(model, str) or not _HUB_ID.match(model) or Path(model).exists():
        return None
    return method, model


def check_mtp(value: str | None, model: Path) -> str | None:
    """With SPECULATIVE_CONFIG's method "mtp" there is nothing to fetch: the baked model must ship the head, as
    Qwen3.5 / Qwen3-Next's mtp.* tensors or DeepSeek-V3 / GLM-4.5's next-n prediction layer (model.layers.{n}.*, n
    the decoder's num_hidden_layers). What it found, None for another method; BakeError in one line when the model
    has neither."""
    config = _parse(value)
    if config is None or config.get("method") != "mtp":
        return None
    from safetensors import safe_open

    text = json.loads((model / "config.json").read_text())
    next_n = f"model.layers.{(text.get('text_config') or text).get('num_hidden_layers')}."
    names: set[str] = set()
    for path in sorted(model.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names.update(name for name in f.keys() if name.startswith(("mtp.", next_n)))
    if "mtp.fc.weight" in names:
        return f"mtp: the model baked in {model} ships its head ({len(names)} mtp.* tensors)"
    if f"{next_n}eh_proj.weight" in names:
        return f"mtp: the model baked in {model} ships its next-n prediction layer ({len(names)} {next_n}* tensors)"
    raise BakeError(
        f"SPECULATIVE_CONFIG method mtp needs the multi-token-prediction weights that Qwen3.5 and Qwen3-Next (mtp.*) "
        f"or DeepSeek-V3 and GLM-4.5 ({next_n}eh_proj, a next-n prediction layer) checkpoints ship; the model baked "
        f"in {model} has none"
    )


def bake_speculative(
    method: str, repo: str, base: Path, model: Path, token: str | None, if_missing: bool = False
) -> str:
    """Bakes `repo` into base/speculative for `method`, checked against the model baked in `model`; what it did."""
    out = base / SPECULATIVE_DIR
    if if_missing and _baked(out) == (method, repo):
        return f"{method} {repo} already baked in {out}"
    if method == "draft_model":
        bake(resolve(repo, None), out, token=token)
        try:
            _check_draft(out, model, repo)
        except BakeError:
            shutil.rmtree(out, ignore_errors=True)
            raise
        _record(out, method)
    else:
        _bake_head(repo, out, model, token)
    return f"baked {method} {repo} into {out}"


def _baked(out: Path) -> tuple[str | None, str | None] | None:
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest.get("speculative_method"), (manifest.get("source") or {}).get("ref")


def _record(out: Path, method: str) -> None:
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["speculative_method"] = method
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _check_draft(draft: Path, model: Path, repo: str) -> None:
    from engine.text.tokenizer import load_tokenizer

    if load_tokenizer(str(draft)).get_vocab() != load_tokenizer(str(model)).get_vocab():
        raise BakeError(
            f"the draft model {repo} has another tokenizer than the model's: a draft must share its vocabulary"
        )


def _bake_head(repo: str, out: Path, model: Path, token: str | None) -> None:
    from engine.errors import StartupError
    from engine.model.models.eagle3 import check_eagle3_head

    snapshot = hub_snapshot(repo, None, token, lambda: ["config.json", "*.safetensors"], kind="an EAGLE-3 head")
    target = json.loads((model / "config.json").read_text())
    target = target.get("text_config") or target
    try:
        check_eagle3_head(str(snapshot), target["hidden_size"], target["vocab_size"], target["num_hidden_layers"])
    except StartupError as exc:
        raise BakeError(exc.message.replace(str(snapshot), repo)) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        files = [p for p in sorted(snapshot.iterdir()) if p.name == "config.json" or p.suffix == ".safetensors"]
        for path in files:
            shutil.copyfile(path, staging / path.name)
        manifest = {
            "speculative_method": "eagle3",
            "source": {"kind": "hub", "ref": repo},
            "files": {p.name: sha256(staging / p.name) for p in files},
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
