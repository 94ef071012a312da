"""Which FlashInfer modules the engine asks for on a model, read from its KV layer groups; the build's command line.

    python -m engine.core.kernel_plan --model DIR --arch 9.0a     the Docker build's step, once per GPU architecture
    python -m engine.core.kernel_plan --model DIR --list          the module names only (no nvcc)
    python -m engine.core.kernel_plan --all-families --list       the union over one config of each registered family

The model is built on the meta device as the loader builds it (image-text checkpoints keep their text shape under
text_config), so the groups, head sizes, windows, soft-caps and sinks are the engine's own; engine.cuda.precompile
names and builds the modules (one ninja: MAX_JOBS nvcc processes at a time).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Iterable
from typing import Any

import torch

from engine.attention import group_backends
from engine.attention.flashinfer_graph import use_tensor_core_decode
from engine.attention.kv_quant import resolve_kv_dtype
from engine.cuda.precompile import (
    KERNEL_MODULES,
    LIST_ARCH,
    AttentionModule,
    build,
    jit_specs,
    kernel_spec,
    module_names,
    set_cuda_arch,
)
from engine.cuda.setup import has_sinks
from engine.errors import UnsupportedModel
from engine.model.checkpoint import safetensors_files, tensor_shapes
from engine.model.kv_spec import KVGroupSpec
from engine.model.layers.parallel import TensorParallel
from engine.model.loader import TP_SIZES, read_config
from engine.model.models import ARCHITECTURES, model_class

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = ("auto", "fp8")  # KV_CACHE_DTYPE values with pages of their own dtype (fp8_e4m3 is fp8)

# One config of each registered architecture: transformers' defaults for its model_type (the family's real head
# sizes, windows, soft-caps and sinks), fixed where the defaults do not make a model the engine accepts.
FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # The encoders attend through torch's SDPA; the step still plans the one-layer KV group they declare.
    "BertModel": ("bert", {}),
    "BertForSequenceClassification": ("bert", {}),
    "DeepseekV2ForCausalLM": ("deepseek_v2", {"num_experts_per_tok": 6}),  # DeepSeek-V2's 6 of 64 (default None)
    "DeepseekV3ForCausalLM": ("deepseek_v3", {}),
    "Ernie4_5ForCausalLM": ("ernie4_5", {}),
    "Ernie4_5_MoeForCausalLM": ("ernie4_5_moe", {}),
    "Exaone4ForCausalLM": ("exaone4", {}),
    "FalconH1ForCausalLM": ("falcon_h1", {}),
    "Gemma2ForCausalLM": ("gemma2", {}),
    "Gemma3ForCausalLM": ("gemma3_text", {}),
    "Gemma3ForConditionalGeneration": ("gemma3", {"vision_config": {"image_size": 896, "patch_size": 14}}),
    "Gemma4ForCausalLM": ("gemma4_text", {}),
    "Gemma4ForConditionalGeneration": ("gemma4", {}),
    "Glm4MoeLiteForCausalLM": ("glm4_moe_lite", {}),
    "Glm4MoeForCausalLM": ("glm4_moe", {"head_dim": 128}),  # GLM-4.5's (the default's 4096 / 96 heads is 42)
    "GptOssForCausalLM": ("gpt_oss", {}),
    "GraniteForCausalLM": ("granite", {}),
    "GraniteMoeForCausalLM": ("granitemoe", {}),
    "GraniteMoeSharedForCausalLM": ("granitemoeshared", {}),
    # Granite 4.0-H's mix (the default is all Mamba2: no attention to plan) and its 8 KV heads
    "GraniteMoeHybridForCausalLM": (
        "granitemoehybrid",
        {"layer_types": (["mamba"] * 7 + ["attention"]) * 4, "num_key_value_heads": 8},
    ),
    "LlamaForCausalLM": ("llama", {}),
    "LlamaForSequenceClassification": ("llama", {}),
    "Ministral3ForCausalLM": ("ministral3", {}),
    "MistralForCausalLM": ("mistral", {}),
    "Mistral3ForConditionalGeneration": ("mistral3", {}),
    "MixtralForCausalLM": ("mixtral", {}),
    "ModernBertModel": ("modernbert", {}),
    "ModernBertForSequenceClassification": ("modernbert", {}),
    "NemotronHForCausalLM": ("nemotron_h", {}),
    "NomicBertModel": ("nomic_bert", {}),
    "Olmo2ForCausalLM": ("olmo2", {}),
    "Olmo3ForCausalLM": ("olmo3", {}),
    "OlmoeForCausalLM": ("olmoe", {}),
    "Phi3ForCausalLM": ("phi3", {}),
    "PhimoeForCausalLM": ("phimoe", {}),
    "Qwen2ForCausalLM": ("qwen2", {}),
    "RobertaModel": ("roberta", {}),
    "RobertaForSequenceClassification": ("roberta", {}),
    "Qwen2MoeForCausalLM": ("qwen2_moe", {}),
    "Qwen3ForCausalLM": ("qwen3", {}),
    "Qwen3ForSequenceClassification": ("qwen3", {}),
    "Qwen3MoeForCausalLM": ("qwen3_moe", {}),
    "Qwen3NextForCausalLM": ("qwen3_next", {}),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", {"vision_config": {"out_hidden_size": 8192}}),  # 72B
    "Qwen3VLForConditionalGeneration": ("qwen3_vl", {"vision_config": {"out_hidden_size": 4096}}),
    "Qwen3VLMoeForConditionalGeneration": ("qwen3_vl_moe", {"vision_config": {"out_hidden_size": 2048}}),
    "Qwen3_5ForCausalLM": ("qwen3_5_text", {}),
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", {"vision_config": {"out_hidden_size": 4096}}),
    "Qwen3_5MoeForCausalLM": ("qwen3_5_moe_text", {"intermediate_size": 512}),
    "Qwen3_5MoeForConditionalGeneration": (
        "qwen3_5_moe",
        {"text_config": {"intermediate_size": 512}, "vision_config": {"out_hidden_size": 2048}},
    ),
    "SeedOssForCausalLM": ("seed_oss", {}),
    "SmolLM3ForCausalLM": ("smollm3", {}),
    "XLMRobertaModel": ("xlm-roberta", {}),
    "XLMRobertaForSequenceClassification": ("xlm-roberta", {}),
}


def decode_ratios(num_q_heads: int, num_kv_heads: int) -> set[int]:
    """q heads per KV head on one rank, for each tensor-parallel size that splits the q heads (a rank with fewer
    KV heads than ranks holds one, so the ratio can fall under the tensor-core threshold)."""
    return {
        (num_q_heads // size) // TensorParallel(0, size).kv_heads(num_kv_heads)[1]
        for size in TP_SIZES
        if num_q_heads % size == 0
    }


def group_modules(
    group: KVGroupSpec, *, num_q_heads: int, dtype: torch.dtype, kv_dtype: torch.dtype, sinks: bool, bidirectional: bool
) -> set[AttentionModule]:
    """What one KV group's FlashInfer backend plans at warm-up and at run time (engine.attention.flashinfer; an MLA
    group's: engine.attention.flashinfer_mla, one module for prefill and decode)."""
    q, kv = str(dtype).removeprefix("torch."), str(kv_dtype).removeprefix("torch.")
    if group.latent is not None:
        rank, rope = group.latent.kv_lora_rank, group.latent.rope_dim
        return {AttentionModule(kind="mla", head_dim=rank, rope_dim=rope, q_dtype=q, kv_dtype=kv, sliding_window=False)}
    window, cap = group.window is not None, group.soft_cap is not None
    found = {
        AttentionModule(
            kind="prefill", head_dim=group.head_dim, q_dtype=q, kv_dtype=kv, sliding_window=window, soft_cap=cap
        )
    }
    if bidirectional and window:  # a custom mask folds the window in: planned without window_left
        found.add(
            AttentionModule(
                kind="prefill", head_dim=group.head_dim, q_dtype=q, kv_dtype=kv, sliding_window=False, soft_cap=cap
            )
        )
    if not all(use_tensor_core_decode(ratio, 1) for ratio in decode_ratios(num_q_heads, group.num_kv_heads)):
        found.add(
            AttentionModule(
                kind="decode", head_dim=group.head_dim, q_dtype=q, kv_dtype=kv, sliding_window=window, soft_cap=cap
            )
        )
    if sinks:
        found.add(AttentionModule(kind="sink", head_dim=group.head_dim, q_dtype=q, kv_dtype=kv, sliding_window=window))
    return found


def model_modules(
    config: dict,
    names: set[str],
    *,
    dtype: torch.dtype = torch.bfloat16,
    kv_cache_dtypes: Iterable[str] = ("auto",),
    skipped: list[str] | None = None,
) -> set[AttentionModule]:
    """The attention modules of a model (its config.json and its checkpoint's tensor names): its KV groups and image
    spec as the model built on the meta device gives them (ModelSpec's sources); a group the engine runs on the torch
    backend (a head size or an MLA latent FlashInfer does not serve: engine.attention.group_backends) adds none (why:
    `skipped`)."""
    architecture = (config.get("architectures") or ["<none>"])[0]
    cls = model_class(architecture)
    try:
        args = cls.read_args(config, names)
    except KeyError as exc:
        raise UnsupportedModel(f"config.json lacks {exc.args[0]!r}", param="model") from None
    with torch.device("meta"):
        model = cls(args)
    groups = model.kv_groups(config)
    vision = model.vision_spec() if hasattr(model, "vision_spec") else None
    sinks = has_sinks(model)  # warm-up plans the sink variant beside the plain kernels on every group
    found: set[AttentionModule] = set()
    latent = [None if g.latent is None else (g.latent.kv_lora_rank, g.latent.rope_dim) for g in groups]
    choices = group_backends("flashinfer", [g.head_dim for g in groups], latent=latent)
    for group, (backend, why) in zip(groups, choices, strict=True):
        if backend != "flashinfer":
            if skipped is not None:
                skipped.append(f"{architecture} {group.label}: {why}: its layers run on the {backend} backend")
            continue
        bidirectional = vision is not None and vision.bidirectional_in(group.window)
        for name in kv_cache_dtypes:
            kv_dtype = resolve_kv_dtype(name, dtype)
            if group.latent is not None and kv_dtype != dtype:
                if skipped is not None:
                    skipped.append(f"{architecture} {group.label}: kv_cache_dtype {name}: FlashInfer's MLA refuses it")
                continue
            found |= group_modules(
                group,
                num_q_heads=args.num_q_heads,
                dtype=dtype,
                kv_dtype=kv_dtype,
                sinks=sinks,
                bidirectional=bidirectional,
            )
    return found


def folder_modules(model_path: str, **kw: Any) -> set[AttentionModule]:
    """model_modules() of a model folder (a bake): config.json, the tensor names from the safetensors headers."""
    return model_modules(read_config(model_path), set(tensor_shapes(safetensors_files(model_path))), **kw)


def family_checkpoint(architecture: str) -> tuple[dict, set[str]]:
    """(config.json, tensor names) of FAMILY_CONFIGS' config for `architecture`, from transformers' model of it on
    the meta device (nothing allocated, nothing downloaded)."""
    import transformers

    model_type, overrides = FAMILY_CONFIGS[architecture]
    config = transformers.AutoConfig.for_model(model_type, **overrides)
    with torch.device("meta"):
        names = set(getattr(transformers, architecture)(config).state_dict())
    return {**config.to_dict(), "architectures": [architecture]}, names


def all_family_modules(skipped: list[str] | None = None) -> set[AttentionModule]:
    """The union over every registered architecture, in bfloat16, with KV pages in it and in FP8."""
    missing = sorted(set(ARCHITECTURES) - set(FAMILY_CONFIGS))
    if missing:
        raise UnsupportedModel(f"FAMILY_CONFIGS has no config for {', '.join(missing)}", param="model")
    found: set[AttentionModule] = set()
    for architecture in ARCHITECTURES:
        config, names = family_checkpoint(architecture)
        found |= model_modules(config, names, kv_cache_dtypes=KV_CACHE_DTYPES, skipped=skipped)
    return found


def main(argv: list[str] | None = None) -> None:
    """The command line: list or build a model's modules (or every family's) for one architecture."""
    parser = argparse.ArgumentParser(prog="python -m engine.core.kernel_plan", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a model folder (config.json and safetensors)")
    source.add_argument("--all-families", action="store_true", help="one config of each registered architecture")
    parser.add_argument("--arch", help="FlashInfer's name of the GPU architecture (8.0, 8.6, 8.9, 9.0a, ...)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="the model's serving dtype")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        action="append",
        help="KV page dtypes to build for (repeatable; default auto; --all-families: both)",
    )
    parser.add_argument("--list", action="store_true", help="print the module names, build nothing")
    parser.add_argument("--only", metavar="REGEX", help="only the modules whose name matches (a subset to rebuild)")
    args = parser.parse_args(argv)
    if args.arch or (args.list and "FLASHINFER_CUDA_ARCH_LIST" not in os.environ):
        set_cuda_arch(args.arch or LIST_ARCH)  # names do not depend on the arch, but FlashInfer asks for one
    skipped: list[str] = []
    if args.all_families:
        attention = all_family_modules(skipped)
    else:
        attention = folder_modules(
            args.model, dtype=DTYPES[args.dtype], kv_cache_dtypes=args.kv_cache_dtype or ("auto",), skipped=skipped
        )
    for line in skipped:
        print(f"skipped: {line}", file=sys.stderr)
    kernels = list(KERNEL_MODULES)
    if args.only:
        kernels = [k for k in kernels if re.search(args.only, kernel_spec(k).name)]
        attention = {m for m in attention if re.search(args.only, m.name())}
    if args.list:
        print("\n".join(module_names(attention, kernels)))
        return
    start = time.monotonic()
    specs = jit_specs(attention, kernels)
    build(specs)
    arch = os.environ.get("FLASHINFER_CUDA_ARCH_LIST", "the visible GPUs")
    print(f"precompiled {len(specs)} FlashInfer modules for sm {arch} in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
