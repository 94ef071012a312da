"""int4 weight-only quantization (CPU): Int4Linear's arithmetic, and the engine serving the baked model with it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.errors import UnsupportedModel
from engine.model.layers.linear import INT4_GROUP, Int4Linear
from engine.model.loader import load_model
from engine.sample.params import SamplingParams


def q4_1_weights(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """Weights as a Q4_1 dequantizer writes them: code * scale + min per group, fp16 scale and min, each group's
    smallest weight at code 0 and largest at code 15 (what Q4_1's quantizer assigns them)."""
    gen = torch.Generator().manual_seed(seed)
    groups = in_features // INT4_GROUP
    codes = torch.randint(0, 16, (out_features, groups, INT4_GROUP), generator=gen)
    codes[..., 0], codes[..., 1] = 0, 15
    scale = (torch.rand(out_features, groups, 1, generator=gen) * 0.02 + 1e-3).half().float()
    low = (torch.randn(out_features, groups, 1, generator=gen) * 0.1).half().float()
    return (codes * scale + low).view(out_features, in_features)


def effective_weight(layer: nn.Module, in_features: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [out, in] matrix the layer applies, read back through the kernel with the identity."""
    return layer(torch.eye(in_features, dtype=dtype)).t()


def test_weights_dequantized_from_q4_1_come_back_exactly() -> None:
    w = q4_1_weights(64, 128)
    linear = nn.Linear(128, 64, bias=False)
    linear.weight.data.copy_(w)
    got = effective_weight(Int4Linear.from_linear(linear, torch.float32), 128)
    # (code - 8) * scale + (min + 8 * scale) differs from code * scale + min by float rounding only.
    torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-7)


def test_any_weights_within_half_a_step_and_bias_added() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 48, bias=True)
    layer = Int4Linear.from_linear(linear, torch.float32)
    w = linear.weight.detach()
    groups = w.view(48, -1, INT4_GROUP)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    got = effective_weight(layer, 96) - linear.bias.detach()[:, None]
    error = (got - w).abs().view(48, -1, INT4_GROUP)
    assert bool((error <= step[..., None] / 2 + 1e-6).all())
    x = torch.randn(5, 96)
    torch.testing.assert_close(layer(x), x @ got.t() + linear.bias.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_is_computed_alone(dtype) -> None:
    # The kernel works in blocks of 4 rows: a row's result must not depend on the rows batched with it.
    torch.manual_seed(0)
    layer = Int4Linear.from_linear(nn.Linear(576, 960), dtype)
    x = torch.randn(9, 576).to(dtype)
    assert torch.equal(layer(x), torch.cat([layer(x[i : i + 1]) for i in range(9)]))


def test_a_constant_group_is_exact() -> None:
    linear = nn.Linear(64, 16, bias=False)
    linear.weight.data.fill_(0.25)
    layer = Int4Linear.from_linear(linear, torch.float32)
    torch.testing.assert_close(effective_weight(layer, 64), linear.weight.detach())


@pytest.mark.parametrize("shape", [(10, 64), (16, 40)])
def test_unsupported_shapes_are_a_clear_error(shape) -> None:
    out_features, in_features = shape
    with pytest.raises(UnsupportedModel, match="int4 needs"):
        Int4Linear.from_linear(nn.Linear(in_features, out_features), torch.float32)


def test_loader_refuses_unknown_quantization_and_int4_off_cpu(baked_model_path) -> None:
    with pytest.raises(UnsupportedModel, match="not supported"):
        load_model(str(baked_model_path), torch.float32, torch.device("cpu"), "int8")
    with pytest.raises(UnsupportedModel, match="CPU only"):
        load_model(str(baked_model_path), torch.bfloat16, torch.device("cuda"), "int4")


def greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            for delta in out.outputs:
                tokens[out.request_id] += delta.token_ids
    return [tokens[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def int4_bf16(baked_model_path) -> LLMEngine:
    # dtype auto: int4 on CPU runs bf16 activations (torch's int4 kernel is vectorised for bf16 only).
    engine = LLMEngine(EngineConfig(model_path=str(baked_model_path), quantization="int4", num_kv_pages=128))
    assert engine.describe()["dtype"] == "bfloat16" and engine.describe()["quantization"] == "int4"
    return engine


def test_int4_fp32_serves_the_default_model_as_published(baked_model_path) -> None:
    # The default model is a Q4_1 GGUF: its int4 codes come back exactly, so with fp32 activations greedy
    # decoding matches the unquantized fp32 checkpoint token for token.
    prompts = [[504, 3575, 282, 4649, 314]]  # "The capital of France is"
    runs = [
        greedy(
            LLMEngine(EngineConfig(model_path=str(baked_model_path), dtype="float32", quantization=q, num_kv_pages=32)),
            prompts,
            12,
        )
        for q in (None, "int4")
    ]
    assert runs[0] == runs[1]


def test_int4_answers(int4_bf16) -> None:
    tok = int4_bf16.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    text = tok.decode(greedy(int4_bf16, [tok.encode(prompt, add_special_tokens=False)], 20)[0])
    assert "Paris" in text
