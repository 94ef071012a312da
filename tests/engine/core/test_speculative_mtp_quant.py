"""The MTP head of a quantized Qwen3.5 checkpoint: its decoder layer's projections stored in the release's format
(Qwen's block FP8, AutoAWQ's layout, compressed-tensors W4A16), its fc in float, as the hub's quantized releases
ship it (hybrid_quant_checkpoints.py). The head serves its projections in that format, its guesses equal the
plain-torch reference on the dequantised weights, and greedy output with it is the output without speculation."""

from __future__ import annotations

import pytest
import torch

from engine.model.layers.linear import Int4Linear
from tests.engine.core.hybrid_spec import hybrid_requests, random_mtp_weights, run_checked, tokens
from tests.engine.core.test_speculative_mtp import MTP, first_guesses, head_reference
from tests.engine.model.family_parity import load_family, tiny_engine
from tests.engine.model.hybrid_quant_checkpoints import write_hybrid_quantized


@pytest.fixture(scope="module", params=["fp8_block", "awq", "ct_int4"])
def quantized(request, tmp_path_factory, baked_model_path):
    path = tmp_path_factory.mktemp(f"{request.param}-mtp")
    head: dict[str, torch.Tensor] = {}

    def mtp(hf) -> dict[str, torch.Tensor]:
        head.update(random_mtp_weights(hf))
        return head

    hf = write_hybrid_quantized(request.param, "qwen3_5_text", path, mtp=mtp)
    load_family(path, baked_model_path)
    return request.param, path, hf, head


def test_the_heads_projections_serve_in_the_checkpoints_format_and_guess_as_the_dequantised_reference(quantized):
    kind, path, hf, mtp = quantized
    engine = tiny_engine(path, speculative=MTP, max_num_batched_tokens=64)
    layer = engine.speculator.proposer.head.layers[0]
    if kind == "fp8_block":  # dequantised to the serving dtype: the weight is exactly the checkpoint's
        want = torch.cat([mtp[f"mtp.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(layer.self_attn.qkv_proj.weight, want)
    else:  # served by the int4 kernel, as the target's projections are
        assert isinstance(layer.self_attn.qkv_proj, Int4Linear) and isinstance(layer.mlp.down_proj, Int4Linear)
    prompts, seqs, guesses = first_guesses(engine, (7, 21))
    for i, (prompt, seq) in enumerate(zip(prompts, seqs, strict=True)):
        with torch.no_grad():
            hidden = hf.model(torch.tensor([prompt])).last_hidden_state[0]
        expected = head_reference(mtp, hf, prompt + [seq.token_ids[len(prompt)]], hidden, steps=3)
        assert guesses[i] == expected, kind


def test_greedy_with_the_quantized_head_equals_greedy_without_speculation(quantized):
    _, path, _, _ = quantized
    requests = {r: hybrid_requests()[r] for r in ("p0", "p1", "loop")}
    want = tokens(run_checked(tiny_engine(path), requests))
    spec = tiny_engine(path, speculative=MTP)
    assert tokens(run_checked(spec, requests)) == want
    assert spec.stats()["spec_verify_steps"] > 0  # a random head: its guesses are rarely right
