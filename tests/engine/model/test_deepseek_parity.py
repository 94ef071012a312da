"""DeepSeek-V2 / V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM) against transformers on tiny random configs in
float32: multi-head latent attention over latent pages with the absorbed weights, dense first layers, shared
experts; V2-Lite's shape (q_proj, greedy softmax routing), a V2 with q_lora_rank, group_limited_greedy routing and
YaRN with DeepSeek's mscale, V3s (sigmoid noaux_tc with a correction bias; rotary pairs or halves) and GLM-4.7-Flash
(V3's decoder, mlp_layer_types). Logits on several prompt lengths
and decode steps; through the engine: batched equals solo, chunked prefill, a prefix-cache hit, preemption. The
bake's check and the tensor-parallel sizes it lists, and the memory plan's latent bytes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.attention.mla import TorchMLABackend
from engine.model.folder_check import check_model_folder
from engine.model.layers.mla import mla_softmax_scale
from engine.model.layers.moe import SparseMoE
from engine.model.models.llama import LlamaMLP
from tests.engine.model.family_parity import (
    check_engine_greedy,
    check_preemption,
    check_prefill_and_decode,
    load_family,
    tiny_engine,
)
from tests.engine.model.mla_checkpoints import CONFIGS, MLA, YARN, build_mla_checkpoint


@pytest.fixture(scope="module", params=list(CONFIGS))
def deepseek(request, tmp_path_factory, baked_model_path):
    path = tmp_path_factory.mktemp(request.param)
    hf = build_mla_checkpoint(request.param, path)
    model, spec = load_family(path, baked_model_path)
    return SimpleNamespace(kind=request.param, hf=hf, model=model, spec=spec, path=path)


def test_one_latent_group_and_dense_first_layers(deepseek):
    (group,) = deepseek.spec.kv_groups
    assert group.latent is not None and group.layers == (0, 1, 2)
    assert group.values_per_token == MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]
    assert group.scale == pytest.approx(deepseek.hf.model.layers[0].self_attn.scaling)
    layers = deepseek.model.model.layers
    assert isinstance(layers[0].mlp, LlamaMLP) and all(isinstance(layer.mlp, SparseMoE) for layer in layers[1:])


def test_prefill_lengths_and_decode_match_transformers(deepseek):
    check_prefill_and_decode(deepseek.model, deepseek.spec, deepseek.hf, lengths=(1, 7, 30), decode_steps=6)


def test_engine_greedy_equals_transformers_batched_and_solo(deepseek):
    """Through the engine: mixed prompts batched (chunked prefill, a shared prefix served from the cache the second
    time) give each prompt the tokens it gets alone and from transformers; the pages are latent ones."""
    check_engine_greedy(deepseek.path, deepseek.hf)
    engine = tiny_engine(deepseek.path)
    assert isinstance(engine.backends[0], TorchMLABackend)
    ckv, kpe = engine.pools[0].kv_caches[0]
    assert ckv.shape[-1] == MLA["kv_lora_rank"] and kpe.shape[-1] == MLA["qk_rope_head_dim"]


def test_preempted_requests_recompute_the_same_answers(deepseek):
    check_preemption(deepseek.path)


def test_the_bake_check_passes_and_lists_the_tensor_parallel_sizes_that_split_the_heads(deepseek):
    """Up to one head per rank (tests/engine/core/distributed/test_tensor_parallel_mla.py runs TP=2); more ranks than
    heads are refused in one line."""
    from engine.model.loader import shard_refusal, tensor_parallel_sizes

    assert check_model_folder(deepseek.path) == deepseek.hf.config.architectures[0]
    assert tensor_parallel_sizes(str(deepseek.path)) == [1, 2, 4]
    why = shard_refusal(str(deepseek.path), 8)
    assert why == "tensor_parallel_size=8 does not divide the model's 4 attention heads"


def test_the_memory_plan_counts_latent_bytes_per_token(deepseek):
    from engine.model.memory_plan import describe, plan_for_folder

    plan = plan_for_folder(str(deepseek.path), torch.bfloat16)
    (group,) = plan.groups
    width = MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]
    assert (group.latent_width, group.bytes_per_token) == (width, 3 * width * 2)
    assert f"multi-head latent: {width} values per token per layer" in describe(plan, 0.9)[1]


def test_fp8_latent_pages_hold_half_the_bytes_and_preempt_alike(deepseek):
    """KV_CACHE_DTYPE=fp8: the latent pages take one byte a value (FlashInfer's MLA refuses them: test_mla.py);
    preemption recomputes what it dropped into the same tokens (their fidelity: test_kv_fp8_fidelity.py)."""
    fp8, full = tiny_engine(deepseek.path, kv_cache_dtype="fp8"), tiny_engine(deepseek.path)
    assert fp8.pools[0].data.element_size() == 1 and full.pools[0].data.element_size() == 4
    check_preemption(deepseek.path, kv_cache_dtype="fp8")


def test_yarn_mscale_scales_the_softmax_as_transformers():
    """DeepSeek's rule: 1/sqrt(qk_nope + qk_rope) times mscale(factor, mscale_all_dim) squared under a scaled rope."""
    qk = MLA["qk_nope_head_dim"] + MLA["qk_rope_head_dim"]
    mscale = 0.1 * YARN["mscale_all_dim"] * torch.log(torch.tensor(YARN["factor"])).item() + 1.0
    assert mla_softmax_scale(qk, YARN) == pytest.approx(qk**-0.5 * mscale**2)
    assert mla_softmax_scale(qk, {"rope_type": "default"}) == qk**-0.5


def test_deepseek_v3s_own_shape_holds_576_values_per_token_per_layer():
    """transformers' DeepSeek-V3 defaults (the release's shape) on the meta device: 512 latent + 64 rotary values per
    token in each of 61 layers, 68.6 KiB per token in bf16, where full K and V heads would take 32,768 values."""
    from engine.core.kernel_plan import family_checkpoint
    from engine.model.memory_plan import describe, plan_from_config

    config, names = family_checkpoint("DeepseekV3ForCausalLM")
    plan = plan_from_config(config, names, torch.bfloat16)
    assert plan.groups[0].layers == 61 and plan.groups[0].latent_width == 576
    assert plan.groups[0].bytes_per_token == 61 * 576 * 2
    assert (
        "KV 68.6 KiB per token over 61 layers (full attention, multi-head latent: 576 values" in describe(plan, 0.9)[1]
    )


def v2_config(**change) -> dict:
    config = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "vocab_size": 128,
        **MLA,
        "num_hidden_layers": 5,
        "q_lora_rank": None,
        "n_shared_experts": 1,
        "topk_method": "greedy",
    }
    return {**config, **change}


def test_moe_layer_freq_picks_every_nth_layer_after_the_dense_ones():
    """DeepSeek's own rule (transformers' ignores the key): layer i is sparse when i >= first_k_dense_replace and
    i % moe_layer_freq == 0."""
    from engine.model.models.deepseek_v2 import DeepseekV2ForCausalLM

    args = DeepseekV2ForCausalLM.read_args(v2_config(moe_layer_freq=2, first_k_dense_replace=1), set())
    assert args.sparse_layers == (2, 4)
    assert DeepseekV2ForCausalLM.read_args(v2_config(), set()).sparse_layers == (1, 2, 3, 4)


@pytest.mark.parametrize(
    "change, named",
    [
        ({"topk_method": "noaux_tc"}, "topk_method='noaux_tc'"),
        ({"norm_topk_prob": True}, "norm_topk_prob=true"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_what_the_family_does_not_run_is_refused_in_one_line(change, named):
    from engine.errors import UnsupportedModel
    from engine.model.models.deepseek_v2 import DeepseekV2ForCausalLM

    with pytest.raises(UnsupportedModel, match=named):
        DeepseekV2ForCausalLM.read_args(v2_config(**change), set())
