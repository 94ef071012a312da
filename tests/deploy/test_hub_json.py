"""`.runpod/hub.json` and `.runpod/tests.json`: RunPod Hub's shape, and exactly the variables the worker
reads (worker/settings.py), with its defaults, its accepted values, and values the Hub form sends."""

from __future__ import annotations

import json
import typing
from pathlib import Path
from types import ModuleType

import pytest

from worker.settings import Settings, SettingsError, load_settings

ROOT = Path(__file__).resolve().parents[2]
HUB = json.loads((ROOT / ".runpod" / "hub.json").read_text())
TESTS = json.loads((ROOT / ".runpod" / "tests.json").read_text())
ENV = HUB["config"]["env"]
FIELDS = {field.alias: field for field in Settings.model_fields.values()}
# RunPod's serverless GPU pools (its GPU types reference).
GPU_POOLS = {"AMPERE_16", "AMPERE_24", "ADA_24", "AMPERE_48", "ADA_48_PRO", "AMPERE_80", "ADA_80_PRO", "HOPPER_141"}
HUB_TYPES = {bool: "boolean", int: "number", float: "number", str: "string"}


def field_type(field: typing.Any) -> tuple[type, list[str] | None]:
    """(python type, Literal values or None) of a settings field, Optional unwrapped."""
    annotation = field.annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return str, list(typing.get_args(annotation))
    base = args[0] if args else annotation
    if typing.get_origin(base) is typing.Literal:
        return str, list(typing.get_args(base))
    return base, None


def as_env(value: typing.Any) -> str:
    """How the Hub puts a form value into the environment."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def test_hub_json_has_the_hub_shape() -> None:
    assert HUB["type"] == "serverless" and HUB["category"] == "language"
    assert HUB["title"] and HUB["description"]
    config = HUB["config"]
    assert config["runsOn"] == "GPU"
    assert isinstance(config["containerDiskInGb"], int) and config["containerDiskInGb"] >= 20
    assert config["gpuCount"] == 1
    pools = config["gpuIds"].split(",")
    assert pools and set(pools) <= GPU_POOLS, set(pools) - GPU_POOLS
    assert config["allowedCudaVersions"] and all(v.startswith("13.") for v in config["allowedCudaVersions"])
    for entry in ENV:
        assert set(entry) == {"key", "input"}, entry
        assert entry["input"]["name"] and entry["input"]["description"], entry["key"]
        assert entry["input"]["type"] in {"string", "number", "boolean"}, entry["key"]


def test_hub_json_lists_exactly_the_variables_the_worker_reads(gen: ModuleType) -> None:
    keys = [entry["key"] for entry in ENV]
    assert len(keys) == len(set(keys)), "a variable is listed twice"
    assert set(gen.LOCAL_ONLY) <= set(FIELDS), "LOCAL_ONLY names a variable the worker does not read"
    missing = set(FIELDS) - set(gen.LOCAL_ONLY) - set(keys)
    extra = set(keys) - set(FIELDS)
    assert not missing, f"worker/settings.py reads {sorted(missing)}, which hub.json does not list"
    assert not extra, f"hub.json lists {sorted(extra)}, which worker/settings.py does not read"


@pytest.mark.parametrize("entry", ENV, ids=[e["key"] for e in ENV])
def test_hub_entry_matches_the_setting(entry: dict) -> None:
    field, spec = FIELDS[entry["key"]], entry["input"]
    base, options = field_type(field)
    assert spec["type"] == HUB_TYPES[base], f"{entry['key']} is {base.__name__} in settings"
    if field.default is None:
        assert "default" not in spec, "the worker's default is unset"
    else:
        assert spec.get("default") == field.default
        assert isinstance(spec["default"], str) == (base is str), "a JSON string where the Hub wants a number"
    if options is not None:
        assert sorted(o["value"] for o in spec["options"]) == sorted(options)
        assert spec["default"] in options
    else:
        assert "options" not in spec


@pytest.mark.parametrize("entry", ENV, ids=[e["key"] for e in ENV])
def test_values_the_hub_form_sends_are_accepted(entry: dict) -> None:
    key, spec = entry["key"], entry["input"]
    field = FIELDS[key]
    name = field_name(key)
    if "default" in spec:
        assert getattr(load_settings({key: as_env(spec["default"])}), name) == field.default
    for option in spec.get("options", []):
        assert getattr(load_settings({key: option["value"]}), name) == option["value"]
    if spec["type"] == "boolean":
        assert getattr(load_settings({key: spec["trueValue"]}), name) is True
        assert getattr(load_settings({key: spec["falseValue"]}), name) is False
    for bound in ("min", "max"):
        if bound in spec:
            assert float(getattr(load_settings({key: as_env(spec[bound])}), name)) == float(spec[bound])
    if "min" in spec and spec["type"] == "number":
        with pytest.raises(SettingsError, match=key):
            load_settings({key: as_env(spec["min"] - 1)})


def field_name(alias: str) -> str:
    return next(name for name, field in Settings.model_fields.items() if field.alias == alias)


@pytest.mark.parametrize("preset", HUB["config"]["presets"], ids=[p["name"] for p in HUB["config"]["presets"]])
def test_presets_set_listed_variables_to_valid_values(preset: dict) -> None:
    keys = {entry["key"] for entry in ENV}
    assert preset["defaults"] and set(preset["defaults"]) <= keys
    settings = load_settings({k: as_env(v) for k, v in preset["defaults"].items()})
    for key, value in preset["defaults"].items():
        assert getattr(settings, field_name(key)) == value


def test_hub_defaults_agree_with_the_dockerfile(dockerfile: list, gen: ModuleType) -> None:
    """BASE_PATH is both a build argument and a run-time variable: one default for both."""
    args = {name: default for name, default, _ in gen.build_args(dockerfile)}
    base_path = next(e for e in ENV if e["key"] == "BASE_PATH")["input"]["default"]
    assert args["BASE_PATH"] == base_path == FIELDS["BASE_PATH"].default


def test_tests_json_covers_every_kind_of_job() -> None:
    config = TESTS["config"]
    assert config["gpuCount"] == 1 and config["gpuTypeId"].startswith("NVIDIA")
    assert config["allowedCudaVersions"] == HUB["config"]["allowedCudaVersions"]
    names = [t["name"] for t in TESTS["tests"]]
    assert len(names) == len(set(names))
    for test in TESTS["tests"]:
        assert isinstance(test["input"], dict) and 0 < test["timeout"] <= 300_000
    routes = [t["input"].get("openai_route") for t in TESTS["tests"]]
    assert None in routes, "no native job"
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(routes)
    streams = [t for t in TESTS["tests"] if t["input"].get("openai_input", {}).get("stream")]
    assert any(t["input"]["openai_route"] == "/v1/chat/completions" for t in streams), "no streaming chat job"
