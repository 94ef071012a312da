"""Partial rotary as GLM-4.5 applies it (transformers' Glm4Moe: the first partial_rotary_factor of each head rotates,
rotate_half within it, at frequencies over that width) from the shared rotary: the torch path (apply_rotary_ on the
RotaryEmbedding's tables) and the fused path's torch fallback (the cos|sin table FlashInfer's kernel reads, whose
width is the rotary width) both equal transformers' on the same q and k; a rotary not built partial still refuses the
factor."""

from __future__ import annotations

import pytest
import torch

from engine.cuda import kernels
from engine.errors import UnsupportedModel
from engine.model.layers.rotary import RotaryEmbedding, apply_rotary_

HEAD_DIM, POSITIONS = 16, torch.tensor([0, 1, 5, 40, 127])


def transformers_rotary(q: torch.Tensor, k: torch.Tensor, rope: dict) -> tuple[torch.Tensor, torch.Tensor]:
    import transformers as tf
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding, apply_rotary_pos_emb

    config = tf.Glm4MoeConfig(
        hidden_size=64, num_attention_heads=4, head_dim=HEAD_DIM, max_position_embeddings=128, rope_parameters=rope
    )
    cos, sin = Glm4MoeRotaryEmbedding(config)(q, POSITIONS[None])
    # transformers' layout: [batch, heads, tokens, head_dim]
    q_out, k_out = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return q_out[0].transpose(0, 1), k_out[0].transpose(0, 1)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.25},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0, "partial_rotary_factor": 0.5},
    ],
)
def test_the_torch_path_and_the_kernel_fallback_equal_transformers(rope):
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, HEAD_DIM, generator=gen), torch.randn(5, 2, HEAD_DIM, generator=gen)
    want_q, want_k = transformers_rotary(q, k, rope)
    rotary_dim = int(HEAD_DIM * rope["partial_rotary_factor"])
    assert not torch.equal(want_q[..., :rotary_dim], q[..., :rotary_dim])
    assert torch.equal(want_q[..., rotary_dim:], q[..., rotary_dim:])  # the rest of each head passes through

    table = RotaryEmbedding(
        head_dim=HEAD_DIM,
        rope=rope,
        max_position_embeddings=128,
        max_positions=128,
        dtype=torch.float32,
        device=torch.device("cpu"),
        partial=True,
    )
    assert table.rotary_dim == rotary_dim
    cos, sin = table.lookup(POSITIONS)
    got_q, got_k = apply_rotary_(q.clone(), cos, sin), apply_rotary_(k.clone(), cos, sin)
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)

    fused = RotaryEmbedding(
        head_dim=HEAD_DIM,
        rope=rope,
        max_position_embeddings=128,
        max_positions=128,
        dtype=torch.float32,
        device=torch.device("cpu"),
        fused=True,
        partial=True,
    )
    assert fused.cos_sin_cache.shape == (128, rotary_dim)  # FlashInfer's kernel takes its rotary width from it
    got_q, got_k = q.clone(), k.clone()
    kernels.apply_rope_with_cos_sin_cache_inplace(POSITIONS, got_q, got_k, HEAD_DIM, fused.cos_sin_cache)
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)


def test_a_rotary_not_built_partial_refuses_the_factor():
    """Llama's and the other references rotate the whole head: the factor is refused there, not half-applied."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    with pytest.raises(UnsupportedModel, match="partial_rotary_factor != 1 is not supported"):
        RotaryEmbedding(
            head_dim=HEAD_DIM,
            rope=rope,
            max_position_embeddings=128,
            max_positions=128,
            dtype=torch.float32,
            device=torch.device("cpu"),
        )
