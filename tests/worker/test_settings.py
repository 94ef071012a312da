"""Settings: defaults, RunPod's variable names, one-line errors, served-name resolution."""

from __future__ import annotations

import json

import pytest

from worker.settings import SettingsError, accepted_model_names, load_settings, served_model_name


def test_defaults_match_runpods_vllm_worker() -> None:
    s = load_settings({})
    assert s.raw_openai_output is True
    assert s.response_role == "assistant"
    assert s.served_model_name_override is None
    assert (s.max_concurrency, s.default_batch_size, s.default_min_batch_size) == (256, 50, 1)
    assert s.default_batch_size_growth_factor == 3
    assert s.model_path == "/models/model"
    assert s.enable_prefix_caching is True and s.dtype == "auto" and s.api_key is None


def test_values_are_parsed_and_empty_strings_are_unset() -> None:
    s = load_settings(
        {
            "RAW_OPENAI_OUTPUT": "0",
            "BASE_PATH": "/baked",
            "MAX_MODEL_LEN": "4096",
            "MAX_NUM_SEQS": "8",
            "ENABLE_PREFIX_CACHING": "false",
            "DTYPE": "half",
            "MAX_CONCURRENCY": "7",
            "OPENAI_RESPONSE_ROLE": "bot",
            "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "",
            "CUSTOM_CHAT_TEMPLATE": "{{ messages }}",
        }
    )
    assert s.raw_openai_output is False and s.model_path == "/baked/model"
    assert (s.max_model_len, s.max_num_seqs, s.max_concurrency) == (4096, 8, 7)
    assert s.enable_prefix_caching is False and s.dtype == "float16" and s.response_role == "bot"
    assert s.served_model_name_override is None and s.custom_chat_template == "{{ messages }}"
    assert load_settings({"MODEL_PATH": "/elsewhere", "BASE_PATH": "/baked"}).model_path == "/elsewhere"
    assert load_settings({"QUANTIZATION": " INT4 "}).quantization == "int4"
    assert load_settings({"QUANTIZATION": ""}).quantization == "none"
    assert load_settings({"KV_CACHE_DTYPE": " FP8 "}).kv_cache_dtype == "fp8"
    assert load_settings({}).kv_cache_dtype == "auto"
    process = load_settings({"LOG_LEVEL": "debug", "OMP_NUM_THREADS": "3", "RUNPOD_WEBHOOK_GET_JOB": "https://x"})
    assert (process.log_level, process.omp_num_threads, process.on_runpod) == ("DEBUG", 3, True)
    assert load_settings({}).on_runpod is False and load_settings({}).omp_num_threads is None


@pytest.mark.parametrize(
    "name, value",
    [
        ("MAX_CONCURRENCY", "lots"),
        ("MAX_CONCURRENCY", "0"),
        ("RAW_OPENAI_OUTPUT", "maybe"),
        ("DTYPE", "int3"),
        ("DEFAULT_BATCH_SIZE_GROWTH_FACTOR", "0.5"),
        ("GPU_MEMORY_UTILIZATION", "1.5"),
        ("MAX_MODEL_LEN", "-1"),
        ("DEVICE", "tpu"),
        ("QUANTIZATION", "int8"),
        ("LOG_LEVEL", "verbose"),
        ("OMP_NUM_THREADS", "0"),
        ("OMP_NUM_THREADS", "all"),
        ("KV_CACHE_DTYPE", "int8"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_variable(name: str, value: str) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings({name: value})
    message = str(info.value)
    assert name in message and repr(value) in message and "\n" not in message


def test_served_name_comes_from_the_manifest_then_the_folder(tmp_path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    settings = load_settings({"MODEL_PATH": str(folder)})
    assert served_model_name(settings) == "my-model"
    (folder / "manifest.json").write_text(json.dumps({"served_model_name": "org/Model-1B"}))
    assert served_model_name(settings) == "org/Model-1B"
    override = load_settings({"MODEL_PATH": str(folder), "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "mine"})
    assert served_model_name(override) == "mine"
    with_alias = load_settings(
        {"MODEL_PATH": str(folder), "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "mine", "MODEL_NAME": "hub/name"}
    )
    assert accepted_model_names(with_alias) == ["mine", "org/Model-1B", "hub/name"]


def test_speculative_config_is_json_as_vllms_and_a_bad_one_is_one_line() -> None:
    from worker.runtime import speculative_config

    assert load_settings({}).speculative is None and speculative_config(load_settings({})) is None
    s = load_settings(
        {
            "SPECULATIVE_CONFIG": json.dumps(
                {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, "prompt_lookup_min": 2}
            )
        }
    )
    config = speculative_config(s)
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (
        "ngram",
        3,
        2,
        5,
    )
    assert speculative_config(load_settings({"SPECULATIVE_CONFIG": '{"method": "ngram"}'})).prompt_lookup_max == 4
    # One of the two lookup sizes set: the other takes its value, as vLLM.
    assert load_settings({"SPECULATIVE_CONFIG": '{"method": "ngram", "prompt_lookup_max": 3}'}).speculative.lookup == (
        3,
        3,
    )
    draft = load_settings({"BASE_PATH": "/baked", "SPECULATIVE_CONFIG": '{"method": "draft_model", "model": "draft"}'})
    assert speculative_config(draft).model == "/baked/draft"
    mtp = speculative_config(load_settings({"SPECULATIVE_CONFIG": '{"method": "mtp", "num_speculative_tokens": 2}'}))
    assert (mtp.method, mtp.num_speculative_tokens, mtp.model) == ("mtp", 2, None)
    bad = {
        '{"method": "eagle"}': "method: Input should be 'ngram', 'draft_model', 'eagle3' or 'mtp'",
        "ngram": "not JSON",
        '["ngram"]': "must be a JSON object",
        '{"method": "ngram", "num_speculative_tokens": 0}': "num_speculative_tokens: Input should be greater",
        '{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}': "prompt_lookup_min (5) is above",
        '{"method": "draft_model"}': 'needs the draft model\'s folder as "model"',
        '{"method": "mtp", "model": "head"}': (
            'reads the model\'s own MTP head (mtp.* or a next-n layer): leave "model" unset'
        ),
        '{"method": "ngram", "num_speculative_token": 4}': "num_speculative_token: Extra inputs are not permitted",
    }
    for value, message in bad.items():
        with pytest.raises(SettingsError) as info:
            load_settings({"SPECULATIVE_CONFIG": value})
        assert str(info.value).startswith("environment variable SPECULATIVE_CONFIG=")
        assert message in str(info.value) and "\n" not in str(info.value)
