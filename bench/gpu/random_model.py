"""Random-weight checkpoints built from transformers configs (no download), with a word-level tokenizer.

Used by the GPU benchmark (models of Qwen2.5-0.5B's and Llama-3-8B's shapes) and the GPU tests (tiny ones).
Weights are drawn on the GPU when there is one and written straight to safetensors, so an 8B checkpoint
takes seconds rather than the minutes of a CPU transformers init.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SHAPES: dict[str, dict] = {
    # Qwen/Qwen2.5-0.5B's config.json: GQA 14/2 (tensor-core decode), qkv bias, tied embeddings
    "qwen2.5-0.5b": dict(
        kind="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    # meta-llama/Meta-Llama-3-8B's config.json: GQA 32/8, head_dim 128
    "llama3-8b": dict(
        kind="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
}


def make_config(kind: str, **fields):
    """A transformers config of `kind` (llama | qwen2) with `fields`, architectures filled in."""
    import transformers as tf

    rope_theta = fields.pop("rope_theta", 10000.0)
    cls, arch = {"llama": (tf.LlamaConfig, "LlamaForCausalLM"), "qwen2": (tf.Qwen2Config, "Qwen2ForCausalLM")}[kind]
    config = cls(**fields, rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
    config.architectures = [arch]
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 1, 2, 0
    return config


def save_random_checkpoint(
    config, path: Path, dtype: torch.dtype = torch.bfloat16, seed: int = 0, logit_scale: float = 1.0
) -> Path:
    """Writes config.json, model.safetensors (random weights, std 1/sqrt(fan_in), norms ~1) and a tokenizer.

    logit_scale multiplies the output projection: larger margins between the top logits, so that bf16
    rounding rarely decides a greedy token in tests.
    """
    import transformers as tf
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in tf.AutoModelForCausalLM.from_config(config).named_parameters()}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        if "norm" in name:
            t = 1.0 + 0.2 * t
        elif name.endswith("bias"):
            t = 0.1 * t
        else:
            t = t / shape[-1] ** 0.5
        if name == "lm_head.weight" or (config.tie_word_embeddings and name == "model.embed_tokens.weight"):
            t = t * logit_scale
        tensors[name] = t.to(dtype).cpu()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    save_word_tokenizer(path, config.vocab_size)
    return path


def save_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer: token i is the word "w{i}" (0 unk/pad, 1 bos, 2 eos); loads with AutoTokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2", pad_token="w0")
    fast.save_pretrained(path)
