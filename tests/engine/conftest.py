"""Engine test helpers: tiny random-weight checkpoints and a small paged-KV harness that builds step metadata."""

from __future__ import annotations

import importlib
import importlib.util
import random
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from engine.attention.base import AttentionMetadata
from tests.engine.core.engine_run import TINY_VOCAB
from tests.paging import PageTable

# transformers' hybrid families bind fla's Triton kernels when they are imported whenever fla imports, a CPU tensor
# included, and those need a GPU driver. make test's image-torch venv has fla (its signatures are bound there,
# tests/engine/cuda/test_library_calls.py), so on a machine without CUDA their modules are imported first with fla
# hidden: the reference they hold the engine to is transformers' torch path, as in the main venv.
FLA_MODELS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def _transformers_reference_without_fla() -> None:
    if torch.cuda.is_available() or importlib.util.find_spec("fla") is None:
        return
    loaded = {name: sys.modules.pop(name) for name in list(sys.modules) if name.split(".")[0] == "fla"}
    sys.modules["fla"] = None  # an import of fla raises ImportError while this is here
    try:
        for name in FLA_MODELS:
            importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    finally:
        del sys.modules["fla"]
        sys.modules.update(loaded)


_transformers_reference_without_fla()

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)

WINDOW = 8  # the tiny windowed models' sliding window: two pages of 4 tokens

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def tiny_config(kind: str):
    """A transformers config for one of the families we serve, shrunk to a few kilobytes of weights."""
    import transformers as tf

    if kind == "llama":
        return tf.LlamaConfig(**TINY, tie_word_embeddings=False)
    if kind == "llama_tied":
        return tf.LlamaConfig(**TINY, tie_word_embeddings=True)
    if kind == "llama3_rope":
        return tf.LlamaConfig(**TINY, tie_word_embeddings=False, rope_parameters=dict(LLAMA3_ROPE))
    if kind == "llama_linear_rope":
        rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
        return tf.LlamaConfig(**TINY, tie_word_embeddings=True, rope_parameters=rope)
    if kind == "mistral":
        return tf.MistralConfig(**TINY, tie_word_embeddings=False, sliding_window=None)
    if kind == "qwen2":
        return tf.Qwen2Config(**TINY, tie_word_embeddings=True)
    if kind == "qwen3":
        return tf.Qwen3Config(**TINY, tie_word_embeddings=False)
    if kind == "qwen2_window":  # layer 0 full attention, layers 1-2 a sliding window of 8 tokens
        return tf.Qwen2Config(
            **{**TINY, "num_hidden_layers": 3},
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
        )
    if kind == "mistral_window":  # every layer a sliding window of 12 tokens
        return tf.MistralConfig(**TINY, tie_word_embeddings=False, sliding_window=12)
    raise ValueError(kind)


def build_tiny_checkpoint(kind: str, path: Path, max_shard_size: str | None = None):
    """Saves a random-weight model of `kind` to path (safetensors) and returns the transformers model (fp32)."""
    import transformers as tf

    config = tiny_config(kind)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    config.architectures = [type(model).__name__]
    # Default init (std 0.02, norms at 1) gives near-zero logits; bigger weights make parity meaningful.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return model


@pytest.fixture(scope="session")
def tiny_checkpoint():
    """build_tiny_checkpoint(kind, path, max_shard_size=None) -> the transformers reference model."""
    return build_tiny_checkpoint


@dataclass
class PagedHarness:
    """A page pool with shuffled free pages; step() allocates pages and builds one step's metadata."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int = 4
    num_pages: int = 64
    dtype: torch.dtype = torch.float32
    seed: int = 0
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = field(init=False)
    table: PageTable = field(init=False)

    def __post_init__(self) -> None:
        shape = (self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)
        # NaN-filled so that reading a slot that was never written shows up in the output.
        self.kv_caches = [
            (torch.full(shape, float("nan"), dtype=self.dtype), torch.full(shape, float("nan"), dtype=self.dtype))
            for _ in range(self.num_layers)
        ]
        free = list(range(self.num_pages))
        random.Random(self.seed).shuffle(free)
        self.table = PageTable(self.page_size, free)

    def step(self, batch: list[tuple[str, list[int]]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """batch: (request id, new token ids) per request, in order. Returns input_ids, positions, meta."""
        positions, meta = self.table.step([(rid, len(tokens)) for rid, tokens in batch])
        return torch.tensor([t for _, tokens in batch for t in tokens]), positions, meta


@pytest.fixture(scope="session")
def paged_harness() -> type[PagedHarness]:
    """The PagedHarness class: PagedHarness(num_layers, num_kv_heads, head_dim, page_size=4, ...)."""
    return PagedHarness


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def _save_tiny_engine_model(config, path: Path, baked_model_path: Path) -> Path:
    """Random weights large enough for peaked logits, saved with SmolLM2's tokenizer files."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "scalar" in name:  # Gemma 4's layer_scalar too
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.5 if "embed" in name else 0.15)
    config.architectures = [type(model).__name__]
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (baked_model_path / name).exists() and name != "generation_config.json":
            shutil.copy(baked_model_path / name, path / name)
    return path


ENGINE_TINY = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    rms_norm_eps=1e-6,
)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory, baked_model_path):
    """A 2-layer Llama on SmolLM2's tokenizer (its first 1024 ids), random weights large enough for peaked logits."""
    import transformers as tf

    config = tf.LlamaConfig(**ENGINE_TINY, num_hidden_layers=2)
    return _save_tiny_engine_model(config, tmp_path_factory.mktemp("tiny-smol"), baked_model_path)


@pytest.fixture(scope="session")
def tiny_window_model_path(tmp_path_factory, baked_model_path):
    """tiny_model_path's shape as a 3-layer Qwen2 with two KV layer groups: layer 0 full attention, layers 1-2 a
    sliding window of WINDOW tokens."""
    import transformers as tf

    config = tf.Qwen2Config(
        **ENGINE_TINY, num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    )
    return _save_tiny_engine_model(config, tmp_path_factory.mktemp("tiny-window"), baked_model_path)
