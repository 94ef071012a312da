"""The FlashInfer modules the Docker build precompiles, read from a model's KV groups by engine.core.kernel_plan: the
names the runtime wrappers JIT, on an image-text bake whose shape sits under text_config (the old Dockerfile step
read config.json's top-level hidden_size and failed with KeyError there), and over every registered family.

flashinfer must import (the image-torch venv installs it); nothing here compiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.cuda.kernels import flashinfer_import_error

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(
    flashinfer_import_error() is not None, reason=f"flashinfer does not import here: {flashinfer_import_error()!r}"
)
BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn


def uri(kind: str, head_dim: int, *, window: bool, soft_cap: bool = False, kv_dtype: torch.dtype = BF16) -> str:
    """The module name flashinfer 0.5.3's wrappers build, with their own positional argument order (prefill: plan's
    get_module_args; decode: BatchDecodeWithPagedKVCacheWrapper.plan; sink: the prefill wrapper's jit_args)."""
    from flashinfer.jit.attention import modules

    if kind == "prefill":
        return modules.get_batch_prefill_uri(
            "fa2", BF16, kv_dtype, BF16, torch.int32, head_dim, head_dim, 0, window, soft_cap, False
        )
    if kind == "decode":
        return modules.get_batch_decode_uri(BF16, kv_dtype, BF16, torch.int32, head_dim, head_dim, 0, window, soft_cap)
    return modules.get_batch_prefill_attention_sink_uri(
        "fa2", BF16, kv_dtype, BF16, torch.int32, head_dim, head_dim, 0, window
    )


def gemma3_image_text_bake(path: Path) -> Path:
    """A random tiny Gemma3ForConditionalGeneration saved as the hub has it: head_dim, hidden_size and the window
    under text_config only; 4 q heads on 2 KV heads (the CUDA-core decode), a window group and a full group."""
    import transformers as tf

    text = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=8,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=112,
        patch_size=14,
        vision_use_head=False,
    )
    config = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(0)
    tf.Gemma3ForConditionalGeneration(config).save_pretrained(path)
    assert "hidden_size" not in json.loads((path / "config.json").read_text())
    return path


def list_modules(*args: str, workspace: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "FLASHINFER_WORKSPACE_BASE": str(workspace)}
    env.pop("FLASHINFER_CUDA_ARCH_LIST", None)
    return subprocess.run(
        [sys.executable, "-m", "engine.core.kernel_plan", *args, "--list"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_listing_on_a_gemma3_image_text_bake_names_each_module_the_engine_builds(tmp_path: Path) -> None:
    bake = gemma3_image_text_bake(tmp_path / "gemma3")
    result = list_modules("--model", str(bake), workspace=tmp_path / "fi")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "KeyError" not in result.stderr
    listed = set(result.stdout.split())
    # window group: prefill and CUDA-core decode with the window; its image spans plan a custom mask on the prefill
    # module without the window; the full group: both without it. Plus RMSNorm, SiLU-and-mul and RoPE.
    assert listed == {
        uri("prefill", 64, window=True),
        uri("prefill", 64, window=False),
        uri("decode", 64, window=True),
        uri("decode", 64, window=False),
        "norm",
        "rope",
        "silu_and_mul",
    }
    fp8 = list_modules("--model", str(bake), "--kv-cache-dtype", "fp8", workspace=tmp_path / "fi")
    assert uri("prefill", 64, window=True, kv_dtype=FP8) in fp8.stdout.split(), fp8.stderr[-2000:]
    assert not list((tmp_path / "fi").rglob("*.so")), "a listing must build nothing"


def test_every_family_asks_for_its_extras_and_head_sizes_flashinfer_cannot_serve_are_skipped() -> None:
    from engine.core.kernel_plan import all_family_modules

    skipped: list[str] = []
    names = {m.name() for m in all_family_modules(skipped)}
    assert uri("prefill", 256, window=True, soft_cap=True) in names  # Gemma 2: window and soft-cap
    assert uri("decode", 256, window=True, soft_cap=True, kv_dtype=FP8) in names  # ... 2 q heads a KV head, FP8 pages
    assert uri("sink", 64, window=True) in names and uri("sink", 64, window=False, kv_dtype=FP8) in names  # gpt-oss
    assert uri("prefill", 128, window=True) in names  # Mistral's window
    assert uri("prefill", 256, window=False) in names  # Qwen3.5 / Qwen3-Next full attention
    assert not any("head_dim_qk_512" in n for n in names)
    assert any("Gemma4ForConditionalGeneration" in s and "512" in s and "torch backend" in s for s in skipped), skipped


def test_the_sink_module_is_the_one_the_attention_backend_plans() -> None:
    """precompile builds FlashInfer's AOT sink module; the backend's prefill wrapper takes kernels.sink_module_args'
    jit_args, whose first is the module's name: the two must agree on every parameter."""
    from engine.cuda.kernels import sink_module_args
    from engine.cuda.precompile import AttentionModule

    for window in (False, True):
        for kv in (BF16, FP8):
            jit_args, _ = sink_module_args(backend="fa2", q_dtype=BF16, kv_dtype=kv, head_dim=64, sliding_window=window)
            module = AttentionModule(
                kind="sink",
                head_dim=64,
                q_dtype="bfloat16",
                kv_dtype=str(kv).removeprefix("torch."),
                sliding_window=window,
            )
            assert module.name() == jit_args[0] == uri("sink", 64, window=window, kv_dtype=kv)


def test_decode_kind_follows_the_q_heads_per_kv_head_of_every_tensor_parallel_size() -> None:
    from engine.core.kernel_plan import decode_ratios, group_modules
    from engine.model.kv_spec import KVGroupSpec

    assert decode_ratios(32, 8) == {4}  # 4 q heads a KV head on every rank: tensor-core decode only
    assert decode_ratios(16, 4) == {4, 2}  # 8 ranks: 2 q heads on the one KV head each rank holds
    kinds = {
        m.kind
        for m in group_modules(
            KVGroupSpec(layers=(0,), num_kv_heads=8, head_dim=128),
            num_q_heads=32,
            dtype=BF16,
            kv_dtype=BF16,
            sinks=False,
            bidirectional=False,
        )
    }
    assert kinds == {"prefill"}
    kinds = {
        m.kind
        for m in group_modules(
            KVGroupSpec(layers=(0,), num_kv_heads=4, head_dim=128),
            num_q_heads=16,
            dtype=BF16,
            kv_dtype=BF16,
            sinks=True,
            bidirectional=False,
        )
    }
    assert kinds == {"prefill", "decode", "sink"}


def mla_uri(kv_lora_rank: int = 512, rope_dim: int = 64) -> str:
    """The module BatchMLAPagedAttentionWrapper.plan builds, in its own positional order (get_batch_mla_module's
    backend, q, kv, o dtypes, index dtype, head_dim_ckv, head_dim_kpe, use_profiler), on FA2."""
    from flashinfer.jit.attention import modules

    return modules.get_batch_mla_uri("fa2", BF16, BF16, BF16, torch.int32, kv_lora_rank, rope_dim, False)


def test_mla_families_ask_for_flashinfers_mla_module_with_pages_in_the_model_dtype_only() -> None:
    from engine.core.kernel_plan import all_family_modules
    from engine.cuda.precompile import AttentionModule

    skipped: list[str] = []
    modules = all_family_modules(skipped)
    mla = {m for m in modules if m.kind == "mla"}
    assert {m.name() for m in mla} == {mla_uri()}  # DeepSeek V2 / V3 and GLM-4.7-Flash: one module, 512 + 64
    assert mla == {
        AttentionModule(
            kind="mla", head_dim=512, rope_dim=64, q_dtype="bfloat16", kv_dtype="bfloat16", sliding_window=False
        )
    }
    for architecture in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM"):
        assert any(s.startswith(architecture) and "fp8" in s and "MLA" in s for s in skipped), skipped


def test_an_mla_latent_flashinfer_does_not_serve_adds_no_module() -> None:
    """A tiny DeepSeek-V2 (a latent of 32 + 16) runs on the torch reference: nothing to build, the reason said."""
    import transformers

    from engine.core.kernel_plan import model_modules

    config = transformers.AutoConfig.for_model(
        "deepseek_v2",
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
    )
    with torch.device("meta"):
        names = set(transformers.DeepseekV2ForCausalLM(config).state_dict())
    skipped: list[str] = []
    found = model_modules({**config.to_dict(), "architectures": ["DeepseekV2ForCausalLM"]}, names, skipped=skipped)
    assert not any(m.kind == "mla" for m in found)
    assert any("latent of 32 + rope 16" in s and "torch backend" in s for s in skipped), skipped
