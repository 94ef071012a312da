"""Our loader + decoder + torch attention backend reproduce transformers' logits over a paged KV cache."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from engine.attention.torch_ref import TorchRefBackend
from engine.errors import UnsupportedModel
from engine.model.layers.rotary import rope_inv_freq, rope_parameters
from engine.model.loader import load_model

KINDS = ["llama", "llama_tied", "llama3_rope", "llama_linear_rope", "mistral", "qwen2", "qwen3"]
ATOL = 1e-4


def reference_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def run_step(model, harness, batch, rows: torch.Tensor | None = None) -> torch.Tensor:
    input_ids, positions, meta = harness.step(batch)
    backend = TorchRefBackend("cpu")
    backend.plan(meta)
    with torch.inference_mode():
        hidden = model(input_ids, positions, meta, harness.kv_caches, backend)
        return model.compute_logits(hidden if rows is None else hidden[rows])


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory, tiny_checkpoint, paged_harness):
    path = tmp_path_factory.mktemp(request.param)
    hf_model = tiny_checkpoint(request.param, path)
    model, spec = load_model(str(path), torch.float32, torch.device("cpu"))

    def harness(**kw):
        return paged_harness(num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, **kw)

    return SimpleNamespace(kind=request.param, hf=hf_model, model=model, spec=spec, path=path, harness=harness)


def test_spec_describes_checkpoint(tiny):
    cfg = tiny.hf.config
    assert tiny.spec.architecture == type(tiny.hf).__name__
    assert (tiny.spec.num_layers, tiny.spec.num_q_heads, tiny.spec.num_kv_heads) == (2, 4, 2)
    assert (tiny.spec.head_dim, tiny.spec.vocab_size, tiny.spec.hidden_size) == (16, 128, 64)
    assert tiny.spec.dtype == torch.float32
    if cfg.eos_token_id is not None:
        assert cfg.eos_token_id in tiny.spec.eos_token_ids
    tied = tiny.model.lm_head.weight.data_ptr() == tiny.model.model.embed_tokens.weight.data_ptr()
    assert tied == bool(cfg.tie_word_embeddings)


def test_batched_prefill_then_decode_matches_transformers(tiny):
    gen = torch.Generator().manual_seed(1)
    prompts = {r: torch.randint(0, 128, (n,), generator=gen).tolist() for r, n in (("a", 7), ("b", 1), ("c", 13))}
    harness = tiny.harness()
    logits = run_step(tiny.model, harness, list(prompts.items()))
    row = 0
    for tokens in prompts.values():
        ref = reference_logits(tiny.hf, tokens)
        torch.testing.assert_close(logits[row : row + len(tokens)], ref, atol=ATOL, rtol=1e-4)
        row += len(tokens)

    seqs = {r: list(t) for r, t in prompts.items()}
    for _ in range(6):  # crosses page boundaries for every request
        nxt = {r: int(torch.randint(0, 128, (1,), generator=gen)) for r in seqs}
        logits = run_step(tiny.model, harness, [(r, [t]) for r, t in nxt.items()])
        for i, (r, t) in enumerate(nxt.items()):
            seqs[r].append(t)
            torch.testing.assert_close(logits[i], reference_logits(tiny.hf, seqs[r])[-1], atol=ATOL, rtol=1e-4)


def test_mixed_step_with_chunked_prefill_matches_transformers(tiny):
    """Decode rows, a prefill chunk on top of cached KV (q_len < kv_len) and a fresh prompt in one step."""
    gen = torch.Generator().manual_seed(2)
    full = torch.randint(0, 128, (18,), generator=gen).tolist()
    dec = torch.randint(0, 128, (9,), generator=gen).tolist()
    fresh = torch.randint(0, 128, (5,), generator=gen).tolist()
    harness = tiny.harness()
    run_step(tiny.model, harness, [("chunk", full[:6]), ("dec", dec[:-1])])
    logits = run_step(tiny.model, harness, [("dec", dec[-1:]), ("chunk", full[6:18]), ("fresh", fresh)])
    torch.testing.assert_close(logits[0], reference_logits(tiny.hf, dec)[-1], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(logits[1:13], reference_logits(tiny.hf, full)[6:], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(logits[13:], reference_logits(tiny.hf, fresh), atol=ATOL, rtol=1e-4)


def test_compute_logits_on_selected_rows_is_float32(tiny):
    harness = tiny.harness()
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    logits = run_step(tiny.model, harness, [("x", tokens)], rows=torch.tensor([len(tokens) - 1]))
    assert logits.shape == (1, 128) and logits.dtype == torch.float32
    torch.testing.assert_close(logits[0], reference_logits(tiny.hf, tokens)[-1], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_load_tracks_float32(tmp_path, dtype, tiny_checkpoint, paged_harness):
    hf = tiny_checkpoint("qwen2", tmp_path)
    model, spec = load_model(str(tmp_path), dtype, torch.device("cpu"))
    assert spec.dtype == dtype and model.model.embed_tokens.weight.dtype == dtype
    harness = paged_harness(num_layers=2, num_kv_heads=2, head_dim=16, dtype=dtype)
    tokens = [5, 17, 99, 3, 64, 2, 7]
    logits = run_step(model, harness, [("x", tokens)])
    assert logits.dtype == torch.float32
    ref = reference_logits(hf, tokens)
    # Low precision: the same ranking of the top token on most rows and close values.
    assert (logits - ref).abs().max() < 0.25 * ref.abs().max()
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.7


def test_sharded_checkpoint_loads(tmp_path, tiny_checkpoint, paged_harness):
    hf = tiny_checkpoint("llama", tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    model, _ = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    harness = paged_harness(num_layers=2, num_kv_heads=2, head_dim=16)
    tokens = [9, 8, 7, 6, 5]
    logits = run_step(model, harness, [("x", tokens)])
    torch.testing.assert_close(logits, reference_logits(hf, tokens), atol=ATOL, rtol=1e-4)


def test_unknown_architecture_is_unsupported(tmp_path, tiny_checkpoint):
    tiny_checkpoint("llama", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModel, match="GPTNeoXForCausalLM"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"))


def test_unsupported_dtype_is_rejected(tmp_path):
    with pytest.raises(UnsupportedModel):
        load_model(str(tmp_path), torch.int8, torch.device("cpu"))


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 500000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32768},
        {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    ],
    ids=lambda r: r["rope_type"],
)
def test_rope_frequencies_match_transformers(rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=1024, num_attention_heads=8, max_position_embeddings=131072, rope_parameters=rope)
    ours, scale = rope_inv_freq(128, rope_parameters(config.to_dict()), config.max_position_embeddings)
    if rope["rope_type"] == "default":
        ref = 1.0 / (rope["rope_theta"] ** (torch.arange(0, 128, 2).float() / 128))
        ref_scale = 1.0
    else:
        ref, ref_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale)


def test_rope_parameters_from_legacy_fields():
    legacy = {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 5e5}
    assert rope_parameters(legacy) == {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}
    assert rope_parameters({"rope_theta": 1e4}) == {"rope_type": "default", "rope_theta": 1e4}


def test_baked_model_matches_transformers_fp32(baked_model_path, paged_harness):
    smollm_path = baked_model_path
    from transformers import AutoModelForCausalLM

    model, spec = load_model(str(smollm_path), torch.float32, torch.device("cpu"))
    assert spec.architecture == "LlamaForCausalLM" and 2 in spec.eos_token_ids
    hf = AutoModelForCausalLM.from_pretrained(smollm_path, dtype=torch.float32).eval()
    tokens = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 378, 3458, 282]
    harness = paged_harness(
        num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, page_size=8, num_pages=8
    )
    logits = run_step(model, harness, [("p", tokens[:-2])])
    ref = reference_logits(hf, tokens)
    torch.testing.assert_close(logits, ref[:-2], atol=2e-3, rtol=1e-4)
    for i in (len(tokens) - 2, len(tokens) - 1):
        step = run_step(model, harness, [("p", [tokens[i]])])
        torch.testing.assert_close(step[0], ref[i], atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rmsnorm_matches_transformers_bitwise(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from engine.model.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(3)
    ours, ref = RMSNorm(96, 1e-6), LlamaRMSNorm(96, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(96, generator=gen))
        ref.weight.copy_(ours.weight)
    ours, ref = ours.to(dtype), ref.to(dtype)
    x = (torch.randn(5, 96, generator=gen) * 7).to(dtype)
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))
        out, residual = ours.add_forward(x.clone(), x.clone())
        assert torch.equal(residual, x + x) and torch.equal(out, ref(x + x))


HUB_CONFIGS = {
    # Shapes of config.json files as the hub has them (written by transformers 4, defaults left out).
    "llama3_legacy_rope": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    },
    "qwen2_window_off": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
        "max_position_embeddings": 32768,
        "rope_theta": 1e6,
        "sliding_window": 4096,
        "use_sliding_window": False,
        "max_window_layers": 2,
    },
    "qwen2_window_on": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
        "max_position_embeddings": 32768,
        "rope_theta": 1e6,
        "sliding_window": 4096,
        "use_sliding_window": True,
        "max_window_layers": 2,
    },
    "qwen2_window_past_last_layer": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
        "use_sliding_window": True,
        "max_window_layers": 28,
    },
    "mistral_window": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
        "rope_theta": 1e4,
    },
}


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "llama3_rope", "mistral", "qwen2", "qwen3", *HUB_CONFIGS])
def test_config_json_reads_as_transformers_reads_it(tmp_path, kind):
    # The loader reads config.json without transformers (cold start); it must see what AutoConfig sees.
    from transformers import AutoConfig

    from engine.model.kv_spec import layer_windows
    from engine.model.loader import read_config
    from engine.model.models import model_class
    from tests.engine.conftest import tiny_config

    if kind in HUB_CONFIGS:
        (tmp_path / "config.json").write_text(json.dumps(HUB_CONFIGS[kind]))
    else:
        config = tiny_config(kind)
        config.architectures = [
            {
                "llama": "LlamaForCausalLM",
                "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM",
            }[kind.split("_")[0].rstrip("3") if kind != "qwen3" else kind]
        ]
        config.save_pretrained(tmp_path)
    raw = read_config(str(tmp_path))
    ref = AutoConfig.from_pretrained(tmp_path)
    args = model_class(raw["architectures"][0]).read_args(raw, set())
    heads = ref.num_attention_heads
    assert (
        args.hidden_size,
        args.intermediate_size,
        args.num_layers,
        args.num_q_heads,
        args.num_kv_heads,
        args.head_dim,
        args.vocab_size,
        args.max_position_embeddings,
    ) == (
        ref.hidden_size,
        ref.intermediate_size,
        ref.num_hidden_layers,
        heads,
        ref.num_key_value_heads,
        getattr(ref, "head_dim", None) or ref.hidden_size // heads,
        ref.vocab_size,
        ref.max_position_embeddings,
    )
    assert args.rms_norm_eps == pytest.approx(ref.rms_norm_eps)
    assert args.rope == {k: v for k, v in ref.rope_parameters.items() if v is not None}
    # Each layer's window as transformers runs it: layer_types when the config has them (Qwen2 derives them),
    # else every layer slides when sliding_window is set (Mistral).
    layer_types = getattr(ref, "layer_types", None)
    window = getattr(ref, "sliding_window", None)
    expected = (
        [window if t == "sliding_attention" else None for t in layer_types]
        if layer_types
        else [window] * ref.num_hidden_layers
    )
    assert layer_windows(raw, args.num_layers) == expected
    assert bool(raw.get("tie_word_embeddings")) == bool(ref.tie_word_embeddings)
