"""Tiny random-weight gpt-oss checkpoints in the hub layout: float experts as save_pretrained writes them
([E, H, 2I] gate|up interleaved, [E, I, H] down), or MXFP4 experts (`*_blocks` / `*_scales`) as the hub's
gpt-oss stores them. Both hold the same model: its experts are made from random MXFP4 codes and dequantised by
transformers' own convert_moe_packed_tensors, so the float and MXFP4 checkpoints are one set of weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

# Two sliding layers (window 8) around a full one; yarn with a short original context so that it changes the
# frequencies; I != H and 2I != H so that a transposition or a gate/up mix-up shows.
SMALL = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=128,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    tie_word_embeddings=False,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 32,
    },
)
MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def random_mxfp4(shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks over every FP4 code and e8m0 scales near 2**-5 for an [E, out, in] weight."""
    *lead, cols = shape
    blocks = torch.randint(0, 256, (*lead, cols // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 124, (*lead, cols // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


def build_gpt_oss(path: Path, layout: str, seed: int = 0, **overrides):
    """Saves a random gpt-oss to path, experts "float" or "mxfp4"; returns the transformers model (float32, eager)."""
    import transformers as tf
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    config = tf.AutoConfig.for_model("gpt_oss", **{**SMALL, **overrides})
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    gen = torch.Generator().manual_seed(seed)
    packed: dict[str, torch.Tensor] = {}
    with torch.no_grad():  # bigger than the default init (which zeroes the expert biases), so parity means something
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.15)
        for i, layer in enumerate(model.model.layers):
            for proj in ("gate_up_proj", "down_proj"):
                weight = getattr(layer.mlp.experts, proj)  # [E, in, out]
                blocks, scales = random_mxfp4((weight.shape[0], weight.shape[2], weight.shape[1]), gen)
                weight.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                packed[f"model.layers.{i}.mlp.experts.{proj}_blocks"] = blocks
                packed[f"model.layers.{i}.mlp.experts.{proj}_scales"] = scales
    config.architectures = [type(model).__name__]
    model.save_pretrained(path)
    if layout == "mxfp4":
        for f in path.glob("*.safetensors"):
            f.unlink()
        state = {
            k: v.contiguous()
            for k, v in model.state_dict().items()
            if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))
        }
        save_file({**state, **packed}, str(path / "model.safetensors"), metadata={"format": "pt"})
        cfg = json.loads((path / "config.json").read_text())
        cfg["quantization_config"] = MXFP4_CONFIG
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return model
