"""Every family's decode step held to CUDA graph capture's rules on the CPU (tests/engine/model/capture_guard.py):
no host sync, no shape that depends on tensor values. MoE (GLM-4.5's grouped sigmoid routing too), sliding windows,
sinks, shared KV, FP8 pages, LoRA and hybrid models' Gated DeltaNet and Mamba2 (on the step a CUDA graph captures,
each row's state slot a tensor only) included. A model whose step breaks the rules must say why
(engine.model.capture.capture_blocker), so that the engine runs it eagerly; every family here in float32 with stacked
experts must need no such reason."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.attention.kv_quant import FP8
from engine.config import LoraConfig
from engine.model.adapters import projection_shapes
from engine.model.capture import capture_blocker
from engine.model.layers.recurrent_step import RecurrentStep
from engine.model.loader import load_model
from tests.engine.conftest import TOKENIZER_FILES, build_tiny_checkpoint
from tests.engine.model.capture_guard import CaptureGuard, CaptureRefused
from tests.engine.model.family_parity import Pages
from tests.engine.model.gpt_oss_checkpoints import build_gpt_oss
from tests.engine.model.hybrid_checkpoints import build_hybrid_checkpoint
from tests.engine.model.mamba_checkpoints import (
    build_falcon_h1_checkpoint,
    build_granite_hybrid_checkpoint,
    build_nemotron_h_checkpoint,
)
from tests.engine.model.moe_checkpoints import build_moe_checkpoint
from tests.engine.model.test_gemma4_moe_parity import CONFIG as GEMMA4_MOE
from tests.engine.model.test_gemma4_moe_parity import randomize
from tests.engine.model.test_gemma4_parity import save_tiny_gemma4
from tests.engine.model.test_gemma_parity import build as build_gemma
from tests.lora_adapters import ALL_TARGETS, write_adapter

CPU = torch.device("cpu")


def save_gemma4_moe(path) -> None:
    import transformers as tf

    torch.manual_seed(0)
    hf = tf.AutoModelForCausalLM.from_config(tf.Gemma4TextConfig(**GEMMA4_MOE), attn_implementation="eager")
    randomize(hf.float().eval())
    hf.config.architectures = [type(hf).__name__]
    hf.save_pretrained(path)


BUILDERS = {
    "llama": lambda p: build_tiny_checkpoint("llama", p),
    "qwen3": lambda p: build_tiny_checkpoint("qwen3", p),
    "qwen2_window": lambda p: build_tiny_checkpoint("qwen2_window", p),
    **{
        kind: (lambda p, k=kind: build_moe_checkpoint(k, "hub", p))
        for kind in ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "glm4_moe_grouped")
    },
    "gemma2": lambda p: build_gemma("gemma2", p),
    "gemma3": lambda p: build_gemma("gemma3", p),
    "gemma4": save_tiny_gemma4,
    "gemma4_moe": save_gemma4_moe,
    "gpt_oss": lambda p: build_gpt_oss(p, "float"),
    "gpt_oss_mxfp4": lambda p: build_gpt_oss(p, "mxfp4"),
    **{kind: (lambda p, k=kind: build_hybrid_checkpoint(k, p)) for kind in ("qwen3_5_text", "qwen3_next")},
    "nemotron_h": build_nemotron_h_checkpoint,
    "falcon_h1": build_falcon_h1_checkpoint,
    "granitemoehybrid": build_granite_hybrid_checkpoint,
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, baked_model_path):
    paths = {}

    def get(family: str):
        if family not in paths:
            path = tmp_path_factory.mktemp(family)
            BUILDERS[family](path)
            for f in TOKENIZER_FILES:
                if (baked_model_path / f).exists() and f != "generation_config.json":
                    shutil.copy(baked_model_path / f, path / f)
            paths[family] = path
        return paths[family]

    return get


def decode_under_guard(model, spec, kv_dtype: torch.dtype = torch.float32, before_forward=None) -> CaptureGuard:
    """Prefills two prompts (one past every window), then runs one decode step's forward under CaptureGuard, the
    page table planned beforehand as the graph runner plans it outside the graph."""
    pages = Pages(spec.kv_groups, dtype=kv_dtype, recurrent=spec.recurrent)
    gen = torch.Generator().manual_seed(0)
    prompts = {"a": torch.randint(3, 128, (21,), generator=gen).tolist(), "b": [5, 6, 7]}
    if before_forward is not None:
        before_forward(sum(len(t) for t in prompts.values()))
    pages.run(model, list(prompts.items()))
    positions, meta = pages.table.step([(r, 1) for r in prompts])
    for backend in pages.unique:
        backend.plan(meta)
    if pages.recurrent_plan is not None:  # as CudaGraphRunner plans it: the rows' slots as a tensor only
        pages.recurrent_plan.plan(RecurrentStep.graphed(torch.tensor([pages.slots[r] for r in prompts])))
    if before_forward is not None:
        before_forward(len(prompts))
    layers = sorted(pages.caches)
    guard = CaptureGuard()
    with torch.inference_mode(), guard:
        model(
            torch.tensor([9, 10]),
            positions,
            meta,
            [pages.caches[n] for n in layers],
            [pages.backends[n] for n in layers],
        )
    assert guard.seen > 0
    return guard


@pytest.mark.parametrize("kv", ["float", "fp8"])
@pytest.mark.parametrize("family", list(BUILDERS))
def test_the_decode_step_of_every_family_is_capture_safe(family, kv, checkpoint):
    model, spec = load_model(str(checkpoint(family)), torch.float32, CPU)
    assert capture_blocker(model, CPU, torch.float32) is None
    decode_under_guard(model, spec, FP8 if kv == "fp8" else torch.float32)


def test_the_decode_step_with_lora_adapters_is_capture_safe(checkpoint, tmp_path):
    import transformers as tf

    path = checkpoint("llama")
    write_adapter(tmp_path / "a", projection_shapes(tf.AutoConfig.from_pretrained(path)), 2, targets=ALL_TARGETS)
    model, spec = load_model(str(path), torch.float32, CPU, lora=LoraConfig({"a": str(tmp_path / "a")}))
    slot = model.lora.slots["a"]
    decode_under_guard(model, spec, before_forward=lambda n: model.lora.plan.update([(slot, n)], CPU))


def test_experts_held_one_module_each_say_why_and_do_sync(checkpoint):
    """bf16 on the CPU packs each expert's projections for oneDNN: the per-expert loop needs host-side counts."""
    model, spec = load_model(str(checkpoint("qwen3_moe")), torch.bfloat16, CPU)
    reason = capture_blocker(model, CPU, torch.bfloat16)
    if reason is None:
        pytest.skip("this CPU has no bf16 packing: the experts stay stacked")
    assert "one matmul per expert" in reason
    with pytest.raises(CaptureRefused, match="host sync"):
        decode_under_guard(model, spec, torch.bfloat16)
