"""Mixture-of-experts families against transformers on tiny random configs in float32: Qwen3-MoE (a dense layer
among sparse ones), Qwen2-MoE (shared expert), Mixtral (a sliding window shorter than the prompts) and OLMoE
(q/k norm over the whole projection, clip_qkv), each from the per-expert hub layout that save_pretrained writes,
Qwen3-MoE and Mixtral also from transformers 5's fused layout (experts.gate_up_proj [E, 2I, H])."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from engine.model.loader import load_model
from engine.sample.params import SamplingParams
from tests.engine.model.family_parity import (
    Pages,
    check_engine_greedy,
    check_prefill_and_decode,
    load_family,
    tiny_engine,
)
from tests.engine.model.moe_checkpoints import build_moe_checkpoint

CASES = ["qwen3_moe/hub", "qwen3_moe/fused", "qwen2_moe/hub", "mixtral/hub", "mixtral/fused", "olmoe/hub"]


@pytest.fixture(scope="module", params=CASES)
def moe(request, tmp_path_factory, baked_model_path):
    kind, layout = request.param.split("/")
    path = tmp_path_factory.mktemp(kind + "-" + layout)
    hf = build_moe_checkpoint(kind, layout, path)
    model, spec = load_family(path, baked_model_path)
    return SimpleNamespace(kind=kind, layout=layout, hf=hf, model=model, spec=spec, path=path)


def test_sparse_layers_follow_the_config(moe):
    from engine.model.layers.moe import SparseMoE

    sparse = [isinstance(layer.mlp, SparseMoE) for layer in moe.model.model.layers]
    assert sparse == ([True, False, True] if moe.kind == "qwen3_moe" else [True] * moe.spec.num_layers)
    assert [g.window for g in moe.spec.kv_groups] == ([12] if moe.kind == "mixtral" else [None])


def test_prefill_lengths_and_decode_match_transformers(moe):
    # every request crosses a page; the 30-token one decodes past Mixtral's window
    check_prefill_and_decode(moe.model, moe.spec, moe.hf, lengths=(1, 7, 30), decode_steps=6)


def test_engine_greedy_equals_transformers_batched_and_solo(moe):
    """Through the engine: a batch of mixed prompts (chunked prefill under a 16-token budget, a shared prefix
    served from the cache the second time) gives each prompt the tokens it gets alone and from transformers."""
    check_engine_greedy(moe.path, moe.hf)


def test_only_routed_experts_compute(moe):
    """Experts no token is routed to are never read: poisoning them with NaN leaves the output finite."""
    layer = next(m for m in moe.model.model.layers if hasattr(m.mlp, "experts")).mlp
    x = torch.randn(1, moe.spec.hidden_size, generator=torch.Generator().manual_seed(3))  # k of E experts
    with torch.inference_mode():
        ids, weights = layer.route(x)
        expected = layer.experts(x, ids, weights)
        unused = sorted(set(range(layer.routing.num_experts)) - set(ids.flatten().tolist()))
        assert unused, "the test needs an expert no token chose"
        saved = layer.experts.gate_up_proj[unused].clone()
        layer.experts.gate_up_proj[unused] = float("nan")
        try:
            torch.testing.assert_close(layer.experts(x, ids, weights), expected, atol=0, rtol=0)
        finally:
            layer.experts.gate_up_proj[unused] = saved


def test_int4_quantizes_each_expert_in_place(moe):
    """QUANTIZATION=int4 reaches the experts: each expert's gate|up and down become an Int4Linear whose weights
    are that expert's own within half a quantization step; the router stays in float."""
    from engine.model.layers.linear import INT4_GROUP, Int4Linear

    model, spec = load_model(str(moe.path), torch.float32, torch.device("cpu"), quantization="int4")
    pairs = [
        (ours.mlp, theirs.mlp)
        for ours, theirs in zip(model.model.layers, moe.model.model.layers, strict=True)
        if hasattr(theirs.mlp, "experts")
    ]
    for quantized, full in pairs:
        assert not hasattr(quantized.experts, "gate_up_proj") and quantized.gate.weight.dtype == torch.float32
        for e, (gate_up, down) in enumerate(quantized.experts.linears):
            for layer, w in ((gate_up, full.experts.gate_up_proj[e]), (down, full.experts.down_proj[e])):
                assert isinstance(layer, Int4Linear)
                got = layer(torch.eye(w.shape[1])).t()
                groups = w.reshape(w.shape[0], -1, INT4_GROUP)
                step = (groups.amax(-1) - groups.amin(-1)).repeat_interleave(INT4_GROUP, 1) / 15
                assert bool(((got - w).abs() <= step / 2 + 1e-5).all()), e
    tokens = list(range(5, 25))
    logits = Pages(spec.kv_groups).run(model, [("x", tokens)])
    assert logits.shape == (len(tokens), 128) and bool(logits.isfinite().all())


def test_checkpoint_with_another_expert_count_is_refused(moe, tmp_path):
    """The bake's check reads shapes from the headers: a config that says more experts than the checkpoint
    holds fails with one line naming the missing expert weights."""
    from engine.errors import UnsupportedModel
    from engine.model.loader import check_checkpoint

    for f in moe.path.iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_local_experts"] = config.get("num_local_experts", config.get("num_experts")) + 2
    config.pop("num_experts", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel, match="lacks tensors for: .*experts|shape") as err:
        check_checkpoint(str(tmp_path))
    assert "\n" not in str(err.value)


def test_beam_search_returns_transformers_beams(moe):
    """n / best_of with beams (forked sequences sharing the prompt's pages) on the MoE model: the beams
    transformers' generate finds."""
    from tests.engine.core.engine_run import run

    prompt = torch.randint(3, 128, (7,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0, max_tokens=8, ignore_eos=True)
    got = run(tiny_engine(moe.path), {"b": (prompt, params)})["b"]
    with torch.no_grad():
        ref = moe.hf.generate(
            torch.tensor([prompt]),
            num_beams=3,
            num_return_sequences=2,
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
            early_stopping=False,
            length_penalty=1.0,
        )
    assert [got.choices[i].token_ids for i in range(2)] == ref[:, len(prompt) :].tolist()


def test_fp8_kv_scales_reach_every_attention(moe):
    """A checkpoint's k_scale / v_scale apply on every family's attention (OLMoE's has its own q/k norms): FP8
    pages written under scales 4 and 2 hold K / 4 and V / 2 of what unit scales store."""
    from engine.attention.kv_quant import FP8
    from engine.attention.torch_ref import TorchRefBackend
    from tests.paging import PageTable

    attn = moe.model.model.layers[0].self_attn
    shape = (8, 4, moe.spec.num_kv_heads, moe.spec.head_dim)
    x = torch.randn(6, moe.spec.hidden_size, generator=torch.Generator().manual_seed(5))
    stored = []
    for scales in ((1.0, 1.0), (4.0, 2.0)):
        positions, meta = PageTable(4, list(range(8))).step([("a", 6)])
        backend = TorchRefBackend("cpu")
        backend.plan(meta)
        caches = (torch.zeros(shape, dtype=FP8), torch.zeros(shape, dtype=FP8))
        cos, sin = moe.model.rotary.lookup(positions)
        attn.k_scale, attn.v_scale = scales
        try:
            with torch.inference_mode():
                attn(x, positions, cos, sin, *caches, backend)
        finally:
            attn.k_scale, attn.v_scale = 1.0, 1.0
        stored.append([c.float() for c in caches])
    (k1, v1), (k4, v2) = stored
    assert k1.abs().max() > 0 and not torch.equal(k1, k4)
    # e4m3: 3 mantissa bits (relative 1/8), and subnormal steps of 2**-9 near zero
    torch.testing.assert_close(k4 * 4, k1, rtol=0.13, atol=2**-7)
    torch.testing.assert_close(v2 * 2, v1, rtol=0.13, atol=2**-7)
