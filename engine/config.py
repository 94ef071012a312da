"""Engine configuration: one dataclass, filled by the worker from its settings."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from engine.errors import StartupError

# Whitespace characters in a row that JSON held to a grammar may write between its tokens: enough to indent deep
# pretty-printed JSON, not enough for a small model to loop on newlines until max_tokens and end invalid (a known
# failure of free whitespace under a grammar; llama.cpp's JSON grammars bound it the same way).
JSON_MAX_WHITESPACE = 16
# An adapter's name goes in `model` (also as "<base>:<name>") and in a folder name: no colon, no spaces.
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")


@dataclass
class LoraConfig:
    """LoRA adapters loaded at start-up, served per request by name; with `runtime`, more loaded and unloaded while
    serving, into slots allocated up front for every projection (max_loras of them, each of max_lora_rank)."""

    adapters: dict[str, str] = field(default_factory=dict)  # name -> PEFT folder
    max_loras: int = 8  # at most this many adapters (the stacked buffers' slots)
    max_lora_rank: int = 16
    runtime: bool = False


@dataclass
class AdapterSpec:
    """One adapter LORA_MODULES names: the name clients put in `model`, where it comes from (a hub repo id or a
    folder), and the base model it was trained on when the spec says."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(value: str | None) -> list[AdapterSpec]:
    """vLLM's forms of LORA_MODULES: a JSON list of {"name", "path", "base_model_name"?} (or one such object), or
    name=path pairs separated by spaces or commas. StartupError (one line) on anything else."""
    value = (value or "").strip()
    if not value:
        return []
    if value[0] in "[{":
        try:
            items = json.loads(value)
        except ValueError as exc:
            raise StartupError(f"LORA_MODULES is not valid JSON: {exc}", param="LORA_MODULES") from None
        specs = [_spec_from_json(item) for item in (items if isinstance(items, list) else [items])]
    else:
        specs = []
        for pair in re.split(r"[\s,]+", value):
            name, sep, path = pair.partition("=")
            if not sep or not name or not path:
                raise StartupError(f"LORA_MODULES entry {pair!r} is not name=path", param="LORA_MODULES")
            specs.append(AdapterSpec(name, path))
    names = [s.name for s in specs]
    for spec in specs:
        check_adapter_name(spec.name, "LORA_MODULES")
        if names.count(spec.name) > 1:
            raise StartupError(f"adapter name {spec.name!r} is given twice in LORA_MODULES", param="LORA_MODULES")
    return specs


def check_adapter_name(name: str, param: str) -> None:
    if not ADAPTER_NAME.match(name):
        raise StartupError(f"adapter name {name!r} must be letters, digits and . _ / - (no ':' or spaces)", param=param)


def _spec_from_json(item: object) -> AdapterSpec:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not isinstance(item.get("path"), str):
        raise StartupError(
            f'each LORA_MODULES entry needs "name" and "path" strings, got {json.dumps(item)}', param="LORA_MODULES"
        )
    extra = set(item) - {"name", "path", "base_model_name"}
    if extra:
        raise StartupError(
            f"LORA_MODULES entry {item['name']!r} has unknown keys: {', '.join(sorted(extra))}", param="LORA_MODULES"
        )
    return AdapterSpec(item["name"], item["path"], item.get("base_model_name") or None)


@dataclass(kw_only=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's names): a proposer guesses up to num_speculative_tokens tokens, one forward
    of the model verifies them (engine/core/spec/)."""

    # "ngram" (prompt lookup) | "draft_model" (a smaller model with the same tokenizer) | "eagle3" (a head reading the
    # target's hidden states) | "mtp" (the multi-token-prediction head a Qwen3.5 / Qwen3-Next checkpoint ships, or the
    # next-n layer of a DeepSeek-V3 / GLM-4.5 one)
    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4  # ngram: the longest suffix looked up in the prompt and output so far
    prompt_lookup_min: int = 2  # ngram: the shortest
    model: str | None = None  # draft_model / eagle3: the draft's or head's folder (mtp: none, the model's own)
    # No speculation in a step with more decoding sequences than this: verifying k + 1 tokens per sequence costs
    # compute that a large batch no longer has spare (bench/RESULTS.md, "Speculative decoding (CPU)").
    disable_by_batch_size: int = 4
    draft_kv_pages: int | None = None  # draft_model: its own KV pool in pages (None: as many as the target's)


@dataclass(kw_only=True)
class EngineConfig:
    model_path: str
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: bf16 on CUDA, fp32 on CPU)
    quantization: str | None = None  # None | "int4": 4-bit weights in the decoder layers (CPU only)
    device: str = "auto"  # auto | cpu | cuda
    attention_backend: str = "auto"  # auto | flashinfer | torch
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # token budget per step (chunked prefill splits longer prompts)
    page_size: int = 16
    kv_cache_bytes: int | None = None  # pool size in bytes; or
    num_kv_pages: int | None = None  # pool size in pages (wins over bytes); neither: a device default
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8 | fp8_e4m3: pages in float8_e4m3fn
    gpu_memory_utilization: float = 0.90
    enable_prefix_caching: bool = True
    # fcfs: the waiting queue in arrival order; priority: by each request's `priority` (lower first), then arrival,
    # and under memory pressure the lowest priority running request preempted first (vLLM's two policies)
    scheduling_policy: str = "fcfs"
    # priority: a waiting request's priority improves by one for every this many steps it waits, so none waits forever
    priority_aging_steps: int = 1000
    enforce_eager: bool = False  # CUDA: no graphs
    seed: int = 0
    # Whitespace characters in a row that JSON held to a response format may write (None: any amount; xgrammar's
    # default, where a small model can pad with newlines until max_tokens and end invalid)
    structured_max_whitespace: int | None = JSON_MAX_WHITESPACE
    cpu_threads: int | None = None  # CPU: torch's threads (None: the CPUs this process may use, capped by its quota)
    lora: LoraConfig | None = None  # None (or no adapters): the base model alone, at no LoRA cost
    speculative: SpeculativeConfig | None = None  # None: one token per sequence and step
    # Ranks the model is split across (engine/core/distributed/): a number, or "auto" (the visible CUDA devices, 1 on a
    # CPU). Rank 0 is this process; the others are model-runner processes it starts.
    tensor_parallel_size: int | str = 1
    # A rank that has not answered a collective within this many seconds ends the engine (a step must fit in it).
    tensor_parallel_timeout_s: float = 300.0
