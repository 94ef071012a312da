"""Tiny random-weight mixture-of-experts checkpoints of each family we serve, in the hub's per-expert layout
(what save_pretrained writes) or transformers 5's fused one (experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]).
GLM-4.5's hub layout also carries its next-n prediction layer (model.layers.{num_hidden_layers}.*), as the hub's
checkpoints do."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from tests.engine.conftest import TINY

MOE = dict(num_experts_per_tok=2)
CONFIGS = {
    "qwen3_moe": dict(
        num_experts=8, moe_intermediate_size=32, norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1]
    ),
    "qwen2_moe": dict(num_experts=6, moe_intermediate_size=32, shared_expert_intermediate_size=64),
    "mixtral": dict(num_local_experts=4, intermediate_size=64, sliding_window=12),
    "olmoe": dict(num_experts=8, intermediate_size=32, clip_qkv=1.5),
    # GLM-4.5: one group, q/k norm, qkv bias, a dense first layer, partial rotary 0.5 (the config's default)
    "glm4_moe": dict(
        n_routed_experts=8,
        moe_intermediate_size=32,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        use_qk_norm=True,
        attention_bias=True,
    ),
    # grouped top-k: 4 groups of 2 experts, the best 2 groups kept, 3 experts of them per token; two shared experts
    "glm4_moe_grouped": dict(
        n_routed_experts=8,
        moe_intermediate_size=32,
        n_shared_experts=2,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        routed_scaling_factor=1.5,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        attention_bias=True,
    ),
}
# transformers' model_type of each kind (a kind is a config of it).
MODEL_TYPES = {"glm4_moe_grouped": "glm4_moe"}


def build_moe_checkpoint(kind: str, layout: str, path, **change):
    """Saves a random-weight `kind` (its config `change`d) to path in `layout` and returns the transformers model
    (float32, eager)."""
    import transformers as tf

    config = tf.AutoConfig.for_model(
        MODEL_TYPES.get(kind, kind), **{**TINY, **MOE, **CONFIGS[kind], **change}, tie_word_embeddings=False
    )
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # bigger than the default init, so that parity (and routing) means something
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # large enough to change some tokens' choice
                b.normal_(0.0, 0.1)
    config.architectures = [type(model).__name__]
    model.save_pretrained(path)
    if layout == "hub" and config.model_type == "glm4_moe":
        add_next_n_layer(path, config)
    if layout == "fused":  # transformers 5's own parameter names: one [E, 2I, H] and one [E, H, I] per layer
        for f in path.glob("*.safetensors"):
            f.unlink()
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return model


def add_next_n_layer(path, config) -> None:
    """Adds the tensors of GLM-4.5's next-n prediction layer, as the hub's checkpoints store it after the decoder's
    layers (model.layers.{num_hidden_layers}: its own embedding and head, eh_proj, enorm, hnorm, a decoder layer)."""
    from safetensors.torch import load_file

    (weights,) = path.glob("*.safetensors")
    state = load_file(str(weights))
    n, h, v = config.num_hidden_layers, config.hidden_size, config.vocab_size
    prefix = f"model.layers.{n}."
    extra = {
        "embed_tokens.weight": (v, h),
        "eh_proj.weight": (h, 2 * h),
        "enorm.weight": (h,),
        "hnorm.weight": (h,),
        "shared_head.norm.weight": (h,),
        "shared_head.head.weight": (v, h),
    }
    state.update({prefix + name: torch.randn(shape) for name, shape in extra.items()})
    state.update(
        {
            name.replace(f"model.layers.{n - 1}.", prefix): t.clone()
            for name, t in list(state.items())
            if name.startswith(f"model.layers.{n - 1}.")
        }
    )
    save_file(state, str(weights), metadata={"format": "pt"})
