"""Every environment variable the worker reads, typed and validated in one place.

Names follow RunPod's vLLM worker where one exists. Plain pydantic rather than pydantic-settings: it
imports in a third of the time, and cold start is what serverless pays for. Empty strings count as
unset, because RunPod templates often carry variables with blank values.

`RUNPOD_API_KEY`, when set, is the key the local endpoint (`handler.py --serve`) requires as
`Authorization: Bearer <key>` on every route except /health (and /metrics with METRICS_PUBLIC); clients
configured for the hosted endpoint (api_key=RUNPOD_API_KEY) then work unchanged against the local one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MANIFEST = "manifest.json"


class SettingsError(ValueError):
    """A bad environment variable: the message is one line naming it and what it accepts."""


class SpeculativeSettings(BaseModel):
    """SPECULATIVE_CONFIG: vLLM's speculative_config JSON, the keys this engine runs (others are refused)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["ngram", "draft_model", "eagle3", "mtp"]
    num_speculative_tokens: int = Field(4, ge=1, le=16)
    # Neither set: 4 and 2; one set: the other takes its value, as in vLLM.
    prompt_lookup_max: int | None = Field(None, ge=1)
    prompt_lookup_min: int | None = Field(None, ge=1)
    model: str | None = None  # draft_model / eagle3: the draft's or head's folder (relative: under BASE_PATH)
    # (mtp reads the head that the model's own checkpoint ships: it takes no `model`)
    # No speculation in a step with more decoding sequences than this (measured: bench/RESULTS.md).
    disable_by_batch_size: int = Field(4, ge=0)

    @property
    def lookup(self) -> tuple[int, int]:
        """(prompt_lookup_min, prompt_lookup_max) with the defaults filled in."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None:
            return (2, 4) if high is None else (high, high)
        return low, low if high is None else high

    @model_validator(mode="after")
    def _check(self) -> SpeculativeSettings:
        if self.lookup[0] > self.lookup[1]:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) is above prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.method in ("draft_model", "eagle3") and not self.model:
            what = "draft model" if self.method == "draft_model" else "EAGLE-3 head"
            raise ValueError(f'method "{self.method}" needs the {what}\'s folder as "model"')
        if self.method == "mtp" and self.model:
            raise ValueError(
                'method "mtp" reads the model\'s own MTP head (mtp.* or a next-n layer): leave "model" unset'
            )
        return self


class Settings(BaseModel):
    """The worker's configuration; field aliases are the environment variable names."""

    model_config = ConfigDict(populate_by_name=True, frozen=True, extra="ignore")

    # Model and naming
    base_path: str = Field("/models", alias="BASE_PATH")
    model_path_env: str | None = Field(None, alias="MODEL_PATH")
    model_name: str | None = Field(None, alias="MODEL_NAME")
    # Without a bake of MODEL_NAME, its snapshot is read in place from a hub cache (worker/model_cache.py).
    model_revision: str | None = Field(None, alias="MODEL_REVISION")
    model_cache_path: str = Field("/runpod-volume/huggingface-cache/hub", alias="MODEL_CACHE_PATH")
    hf_home: str | None = Field(None, alias="HF_HOME")  # its hub/ is the second cache looked at
    hf_hub_cache: str | None = Field(None, alias="HF_HUB_CACHE")  # that cache, when not under HF_HOME
    served_model_name_override: str | None = Field(None, alias="OPENAI_SERVED_MODEL_NAME_OVERRIDE")
    response_role: str = Field("assistant", alias="OPENAI_RESPONSE_ROLE", min_length=1)
    raw_openai_output: bool = Field(True, alias="RAW_OPENAI_OUTPUT")
    custom_chat_template: str | None = Field(None, alias="CUSTOM_CHAT_TEMPLATE")

    # Tool calls and reasoning: the formats are read from the chat template unless these name one
    tool_call_parser: Literal[
        "auto",
        "hermes",
        "llama3_json",
        "mistral",
        "granite",
        "phi4_mini_json",
        "gemma4",
        "qwen3_coder",
        "seed_oss",
        "glm45",
        "glm47",
        "deepseek_v3",
        "deepseek_v31",
        "generic",
    ] = Field("auto", alias="TOOL_CALL_PARSER")
    reasoning_parser: Literal["auto", "qwen3", "deepseek_r1", "gemma4", "seed_oss", "none"] = Field(
        "auto", alias="REASONING_PARSER"
    )
    # An answer ends at its call past this many (a small model can call on until the context is full).
    max_tool_calls_per_answer: int = Field(16, alias="MAX_TOOL_CALLS_PER_ANSWER", ge=1)
    # JSON response formats may write any amount of whitespace between tokens (xgrammar's default) instead of at most
    # 16 characters in a row, with which a small model cannot pad its JSON with newlines until max_tokens
    structured_output_free_whitespace: bool = Field(False, alias="STRUCTURED_OUTPUT_FREE_WHITESPACE")

    # Engine
    max_model_len: int | None = Field(None, alias="MAX_MODEL_LEN", ge=1)
    max_num_seqs: int = Field(256, alias="MAX_NUM_SEQS", ge=1)
    max_num_batched_tokens: int = Field(2048, alias="MAX_NUM_BATCHED_TOKENS", ge=1)
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field("auto", alias="DTYPE")
    quantization: Literal["none", "int4"] = Field("none", alias="QUANTIZATION")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", alias="DEVICE")
    attention_backend: Literal["auto", "flashinfer", "torch"] = Field("auto", alias="ATTENTION_BACKEND")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = Field("auto", alias="KV_CACHE_DTYPE")
    enable_prefix_caching: bool = Field(True, alias="ENABLE_PREFIX_CACHING")
    block_size: int = Field(16, alias="BLOCK_SIZE", ge=1)
    gpu_memory_utilization: float = Field(0.90, alias="GPU_MEMORY_UTILIZATION", gt=0.0, le=1.0)
    num_gpu_blocks_override: int | None = Field(None, alias="NUM_GPU_BLOCKS_OVERRIDE", ge=1)
    enforce_eager: bool = Field(False, alias="ENFORCE_EAGER")
    seed: int = Field(0, alias="SEED")
    # JSON, as RunPod's vLLM worker takes it: {"method": "ngram", "num_speculative_tokens": 4, ...}
    # (kept as the text given; `speculative` is it parsed, checked here once)
    speculative_config: str | None = Field(None, alias="SPECULATIVE_CONFIG")
    # Ranks the model is split across on this machine (vLLM's name): a number, or auto (the visible GPUs; 1 on a CPU)
    tensor_parallel_size: str = Field("1", alias="TENSOR_PARALLEL_SIZE", pattern=r"^(auto|[1-9][0-9]*)$")
    # A rank that does not answer within this long ends the worker (every step must fit in it)
    tensor_parallel_timeout_s: float = Field(300.0, alias="TENSOR_PARALLEL_TIMEOUT_SECONDS", gt=0.0)

    # LoRA adapters: baked with the model (build arg LORA_MODULES), served by name in `model`
    enable_lora: bool = Field(True, alias="ENABLE_LORA")
    max_loras: int = Field(8, alias="MAX_LORAS", ge=1)
    max_lora_rank: int = Field(16, alias="MAX_LORA_RANK", ge=1)
    # At run time too: adapters not baked, read at start from a folder or a hub cache (worker/lora_adapters.py)
    lora_modules: str = Field("", alias="LORA_MODULES")
    # vLLM's switch for /v1/load_lora_adapter and /v1/unload_lora_adapter (off: those routes are 404s)
    allow_runtime_lora_updating: bool = Field(False, alias="VLLM_ALLOW_RUNTIME_LORA_UPDATING")

    # RunPod job handling
    # An upper bound: below it the worker takes as many jobs as its KV cache holds (worker/concurrency.py).
    # MAX_NUM_SEQS's default, so by default the engine's batch slots and pages decide.
    max_concurrency: int = Field(256, alias="MAX_CONCURRENCY", ge=1)
    default_batch_size: int = Field(50, alias="DEFAULT_BATCH_SIZE", ge=1)
    default_min_batch_size: int = Field(1, alias="DEFAULT_MIN_BATCH_SIZE", ge=1)
    default_batch_size_growth_factor: float = Field(3.0, alias="DEFAULT_BATCH_SIZE_GROWTH_FACTOR", ge=1.0)
    # After SIGTERM, running requests get this long to finish before they end with a 503 error. Below the
    # 10 s that Docker (and so a container platform's stop) waits before SIGKILL by default.
    shutdown_grace_s: float = Field(8.0, alias="SHUTDOWN_GRACE_SECONDS", ge=0.0)

    # vLLM's --scheduling-policy: fcfs, or priority (each request's `priority` field, lower first)
    scheduling_policy: Literal["fcfs", "priority"] = Field("fcfs", alias="SCHEDULING_POLICY")

    # Image input (vision models): http(s) image URLs are fetched under these limits; data: URLs always work
    max_images_per_request: int = Field(8, alias="MAX_IMAGES_PER_REQUEST", ge=1)
    image_fetch_max_mb: float = Field(20.0, alias="IMAGE_FETCH_MAX_MB", gt=0.0)
    image_fetch_timeout_s: float = Field(10.0, alias="IMAGE_FETCH_TIMEOUT_SECONDS", gt=0.0)
    # Fetch from loopback and private addresses too (off: an image URL cannot reach the worker's own network)
    image_fetch_allow_private: bool = Field(False, alias="IMAGE_FETCH_ALLOW_PRIVATE")

    # Responses API: the store behind `store` and `previous_response_id`, in memory or in Redis
    response_store_url: str = Field("", alias="RESPONSE_STORE_URL", pattern=r"^$|^(redis|rediss|unix)://")
    response_store_ttl_s: int = Field(30 * 24 * 3600, alias="RESPONSE_STORE_TTL_SECONDS", ge=1)
    response_store_max_entries: int = Field(1000, alias="RESPONSE_STORE_MAX_ENTRIES", ge=0)
    response_store_max_mb: float = Field(64.0, alias="RESPONSE_STORE_MAX_MB", ge=0.0)

    # Process
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = Field("INFO", alias="LOG_LEVEL")
    # torch's CPU threads: by default the CPUs this process may use, capped by its container's CPU quota
    omp_num_threads: int | None = Field(None, alias="OMP_NUM_THREADS", ge=1)
    # The start-up fitness check reads every weight file for its SHA-256 only when asked: that costs a full read
    # of the model on each cold start; by default it checks each file is there with the size the bake recorded.
    verify_model_sha256: bool = Field(False, alias="VERIFY_MODEL_SHA256")
    # Set by RunPod on its workers: `python handler.py` then runs the serverless loop, not a local test job
    runpod_webhook_get_job: str | None = Field(None, alias="RUNPOD_WEBHOOK_GET_JOB")
    # Which kind of RunPod endpoint runs the image (worker/load_balancer.py). auto: a queue-based one where RunPod
    # gives the worker its job URL (RUNPOD_WEBHOOK_GET_JOB), else a load-balancing one where PORT is set.
    endpoint_type: Literal["auto", "queue", "load_balancer"] = Field("auto", alias="ENDPOINT_TYPE")
    # A load-balancing worker's HTTP port, and the port of its /ping (default: PORT); RunPod sets both (80 unless the
    # endpoint says otherwise).
    port: int | None = Field(None, alias="PORT", ge=1, le=65535)
    port_health: int | None = Field(None, alias="PORT_HEALTH", ge=1, le=65535)

    # Local endpoint
    api_key: str | None = Field(None, alias="RUNPOD_API_KEY")
    # RunPod's own API refuses job payloads over 20 MB (/runsync; 10 MB for /run): the local one does the same.
    max_request_mb: float = Field(20.0, alias="MAX_REQUEST_MB", gt=0.0)
    # Prometheus scrapers often carry no key: /metrics may be open as /health is.
    metrics_public: bool = Field(False, alias="METRICS_PUBLIC")

    @field_validator("speculative_config")
    @classmethod
    def _check_speculative(cls, value: str | None) -> str | None:
        if value is not None:
            parse_speculative(value)
        return value

    @property
    def speculative(self) -> SpeculativeSettings | None:
        return None if self.speculative_config is None else parse_speculative(self.speculative_config)

    @property
    def model_path(self) -> str:
        return self.model_path_env or str(Path(self.base_path) / "model")

    @property
    def hub_cache(self) -> str:
        """HF_HOME's hub cache, as huggingface_hub finds it."""
        return self.hf_hub_cache or str(Path(self.hf_home or Path.home() / ".cache" / "huggingface") / "hub")

    @property
    def on_runpod(self) -> bool:
        return self.runpod_webhook_get_job is not None


def parse_speculative(text: str) -> SpeculativeSettings:
    """SPECULATIVE_CONFIG's JSON, checked; a ValueError naming the key that is wrong."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object")
    try:
        return SpeculativeSettings.model_validate(value)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = "".join(f"{part}: " for part in error["loc"])
        raise ValueError(where + error["msg"].removeprefix("Value error, ")) from None


_DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _env_names() -> dict[str, str]:
    return {field.alias: name for name, field in Settings.model_fields.items() if field.alias}


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Read the settings from `environ` (default os.environ); raise SettingsError with a one-line message."""
    environ = os.environ if environ is None else environ
    values = {alias: environ[alias] for alias in _env_names() if environ.get(alias, "").strip() != ""}
    if "DTYPE" in values:
        dtype = values["DTYPE"].strip().lower()
        values["DTYPE"] = _DTYPE_ALIASES.get(dtype, dtype)
    for key in (
        "DEVICE",
        "ATTENTION_BACKEND",
        "QUANTIZATION",
        "KV_CACHE_DTYPE",
        "TOOL_CALL_PARSER",
        "REASONING_PARSER",
        "TENSOR_PARALLEL_SIZE",
    ):
        if key in values:
            values[key] = values[key].strip().lower()
    if "LOG_LEVEL" in values:
        values["LOG_LEVEL"] = values["LOG_LEVEL"].strip().upper()
    try:
        return Settings.model_validate(values)
    except ValidationError as exc:
        error = exc.errors()[0]
        name = str(error["loc"][0]) if error["loc"] else "settings"
        got = environ.get(name, "")
        message = error["msg"].removeprefix("Value error, ")
        raise SettingsError(f"environment variable {name}={got!r} is invalid: {message}") from None


def keep_hub_offline() -> None:
    """Set HF_HUB_OFFLINE for this process: a model served from a hub cache has its tokenizer loaded through
    transformers, which must never download."""
    os.environ["HF_HUB_OFFLINE"] = "1"


def hub_is_offline() -> bool:
    """Whether HF_HUB_OFFLINE is set now (by the user, or by keep_hub_offline for a model served from a cache)."""
    return bool(os.environ.get("HF_HUB_OFFLINE"))


def point_tiktoken_at(folder: str) -> None:
    """Set TIKTOKEN_ENCODINGS_BASE for this process: openai-harmony reads its vocabulary file from there (the bake
    puts it in the model folder) instead of downloading it."""
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = folder


def served_model_name(settings: Settings) -> str:
    """The name the model is served under: the override, else the baker's manifest, else MODEL_NAME, else the
    folder name. A snapshot read from a hub cache is named by MODEL_NAME, never by its folder (a commit hash)."""
    if settings.served_model_name_override:
        return settings.served_model_name_override
    return _manifest_name(settings.model_path) or settings.model_name or Path(settings.model_path).resolve().name


def baked_model_name(model_path: str) -> str:
    """`served_model_name` from the folder's manifest.json, or the folder's own name when there is none."""
    return _manifest_name(model_path) or Path(model_path).resolve().name


def _manifest_name(model_path: str) -> str | None:
    name = _manifest(model_path).get("served_model_name")
    return name if isinstance(name, str) and name else None


def baked_adapters(settings: Settings) -> dict[str, str]:
    """The LoRA adapters baked beside the model (name -> folder), as its manifest lists them; none when
    ENABLE_LORA is off."""
    if not settings.enable_lora:
        return {}
    entries = _manifest(settings.model_path).get("adapters") or []
    return {a["name"]: str(Path(settings.model_path) / a["path"]) for a in entries}


def _manifest(model_path: str) -> dict:
    try:
        manifest = json.loads((Path(model_path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def accepted_model_names(settings: Settings) -> list[str]:
    """Every name a request's `model` may carry, the served (primary) one first."""
    names = [
        served_model_name(settings),
        _manifest_name(settings.model_path) or settings.model_name or baked_model_name(settings.model_path),
    ]
    if settings.model_name:
        names.append(settings.model_name)
    return list(dict.fromkeys(names))
