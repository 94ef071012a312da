"""Engine configuration: one dataclass, filled by the worker from its settings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoraConfig:
    """LoRA adapters loaded at start-up, served per request by name."""

    adapters: dict[str, str] = field(default_factory=dict)  # name -> PEFT folder
    max_loras: int = 8  # at most this many adapters (the stacked buffers' slots)
    max_lora_rank: int = 16


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's names): a proposer guesses up to num_speculative_tokens tokens, one forward
    of the model verifies them (engine/core/spec/)."""

    method: str  # "ngram" (prompt lookup) | "draft_model" (a smaller model with the same tokenizer)
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4  # ngram: the longest suffix looked up in the prompt and output so far
    prompt_lookup_min: int = 2  # ngram: the shortest
    model: str | None = None  # draft_model: the draft's folder
    # No speculation in a step with more decoding sequences than this: verifying k + 1 tokens per sequence costs
    # compute that a large batch no longer has spare (bench/RESULTS.md, "Speculative decoding (CPU)").
    disable_by_batch_size: int = 4
    draft_kv_pages: int | None = None  # draft_model: its own KV pool in pages (None: as many as the target's)


@dataclass
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
    cpu_threads: int | None = None  # CPU: torch's threads (None: the CPUs this process may use, capped by its quota)
    lora: LoraConfig | None = None  # None (or no adapters): the base model alone, at no LoRA cost
    speculative: SpeculativeConfig | None = None  # None: one token per sequence and step
    # Ranks the model is split across (engine/core/distributed/): a number, or "auto" (the visible CUDA devices, 1 on a
    # CPU). Rank 0 is this process; the others are model-runner processes it starts.
    tensor_parallel_size: int | str = 1
    # A rank that has not answered a collective within this many seconds ends the engine (a step must fit in it).
    tensor_parallel_timeout_s: float = 300.0
