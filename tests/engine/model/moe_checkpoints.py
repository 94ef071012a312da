"""Tiny random-weight mixture-of-experts checkpoints of each family we serve, in the hub's per-expert layout
(what save_pretrained writes) or transformers 5's fused one (experts.gate_up_proj [E, 2I, H], down_proj [E, H, I])."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from tests.engine.conftest import TINY

MOE = dict(num_experts_per_tok=2)
CONFIGS = {
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=32, norm_topk_prob=True, num_hidden_layers=3,
                      mlp_only_layers=[1]),
    "qwen2_moe": dict(num_experts=6, moe_intermediate_size=32, shared_expert_intermediate_size=64),
    "mixtral": dict(num_local_experts=4, intermediate_size=64, sliding_window=12),
    "olmoe": dict(num_experts=8, intermediate_size=32, clip_qkv=1.5),
}


def build_moe_checkpoint(kind: str, layout: str, path):
    """Saves a random-weight `kind` to path in `layout` and returns the transformers model (float32, eager)."""
    import transformers as tf

    config = tf.AutoConfig.for_model(kind, **{**TINY, **MOE, **CONFIGS[kind]}, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # bigger than the default init, so that parity (and routing) means something
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.15)
    config.architectures = [type(model).__name__]
    model.save_pretrained(path)
    if layout == "fused":  # transformers 5's own parameter names: one [E, 2I, H] and one [E, H, I] per layer
        for f in path.glob("*.safetensors"):
            f.unlink()
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return model
