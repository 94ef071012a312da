"""Hugging Face safetensors checkpoint -> our modules (q/k/v and gate/up fused), cast to the serving dtype."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from glob import glob

import torch
from safetensors import safe_open
from transformers import AutoConfig

from engine.config import LoraConfig
from engine.errors import UnsupportedModel
from engine.layers import pack_linears_for_cpu, quantize_linears_int4
from engine.lora import attach_lora
from engine.models import model_class
from engine.models.llama import FusedLinear, LlamaArgs, LlamaForCausalLM

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
QUANTIZATIONS = ("int4",)
# Buffers some checkpoints carry that we recompute.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class ModelSpec:
    """What the engine needs to know about a loaded model (KV shapes, limits, stop tokens)."""

    architecture: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: set[int]
    dtype: torch.dtype


def load_model(
    model_path: str, dtype: torch.dtype, device: torch.device, quantization: str | None = None,
    lora: LoraConfig | None = None,
) -> tuple[LlamaForCausalLM, ModelSpec]:
    """Reads config.json and the safetensors shards under model_path; returns the model (eval, on device).

    quantization "int4": the decoder layers' linears become 4-bit weight-only (CPU); embeddings, norms
    and lm_head stay in `dtype`. lora: its adapters wrap the projections they target (model.lora).
    """
    if dtype not in SUPPORTED_DTYPES:
        raise UnsupportedModel(f"dtype {dtype} is not supported (float32, bfloat16, float16)", param="dtype")
    device = torch.device(device)
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise UnsupportedModel(
            f"no model at {model_path!r} (no config.json there): bake one with `python -m builder --out "
            f"{model_path}`, or point MODEL_PATH (or BASE_PATH) at a baked folder", param="model",
        )
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise UnsupportedModel(f"quantization {quantization!r} is not supported (int4)", param="quantization")
    if quantization == "int4" and device.type != "cpu":
        raise UnsupportedModel("quantization 'int4' runs on CPU only", param="quantization")
    config = AutoConfig.from_pretrained(model_path)
    architecture = (getattr(config, "architectures", None) or ["<none>"])[0]
    cls = model_class(architecture)
    if getattr(config, "quantization_config", None):
        raise UnsupportedModel("quantized checkpoints are not supported", param="model")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act {config.hidden_act!r} is not supported", param="model")

    files = _safetensors_files(model_path)
    names = _tensor_names(files)
    args = _llama_args(config, architecture, names)
    tied = bool(getattr(config, "tie_word_embeddings", False)) or "lm_head.weight" not in names

    with torch.device("meta"):
        model = cls(args)
    model = model.to(dtype=dtype).to_empty(device=device)
    if tied:
        model.tie_weights()
    _load_weights(model, files, tied)
    if lora is not None and lora.adapters:
        attach_lora(model, lora.adapters, lora.max_loras, lora.max_lora_rank)
    if quantization == "int4":
        quantize_linears_int4(model.model.layers, dtype)
    if device.type == "cpu" and dtype == torch.bfloat16:
        pack_linears_for_cpu(model)
    model.init_rotary(args.max_position_embeddings, dtype, device)
    model.eval().requires_grad_(False)

    spec = ModelSpec(
        architecture=architecture,
        num_layers=args.num_layers,
        num_q_heads=args.num_q_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        hidden_size=args.hidden_size,
        vocab_size=args.vocab_size,
        max_position_embeddings=_context_limit(config, args),
        eos_token_ids=_eos_token_ids(config, model_path),
        dtype=dtype,
    )
    return model, spec


def _safetensors_files(model_path: str) -> list[str]:
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_path, s) for s in shards]
    files = sorted(glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise UnsupportedModel(f"no *.safetensors weights in {model_path}", param="model")
    return files


def _tensor_names(files: list[str]) -> set[str]:
    names: set[str] = set()
    for path in files:
        with safe_open(path, framework="pt") as f:
            names.update(f.keys())
    return names


def rope_parameters(config) -> dict:
    """transformers 5 `rope_parameters`, or the older `rope_scaling` + `rope_theta` pair, as one dict."""
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and "rope_theta" in rope:
        return dict(rope)
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        raise UnsupportedModel("per-layer-type rope parameters are not supported", param="model")
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling["rope_type"] = scaling.get("rope_type", scaling.pop("type", "default"))
    scaling["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    return scaling


def _llama_args(config, architecture: str, names: set[str]) -> LlamaArgs:
    heads = config.num_attention_heads
    return LlamaArgs(
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_q_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        vocab_size=config.vocab_size,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        rope=rope_parameters(config),
        # Biases are read off the checkpoint: Qwen2 always has qkv bias, Llama only with attention_bias.
        qkv_bias=any(n.endswith("self_attn.q_proj.bias") for n in names),
        o_bias=any(n.endswith("self_attn.o_proj.bias") for n in names),
        mlp_bias=any(n.endswith("mlp.gate_proj.bias") for n in names),
        qk_norm=architecture == "Qwen3ForCausalLM",
    )


def _context_limit(config, args: LlamaArgs) -> int:
    """max_position_embeddings, capped at a sliding window we do not implement (exact up to the window)."""
    limit = args.max_position_embeddings
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    slides = "sliding_attention" in layer_types if layer_types else window is not None
    if getattr(config, "use_sliding_window", True) is False:
        slides = False
    if slides and window:
        limit = min(limit, int(window))
    return limit


def _eos_token_ids(config, model_path: str) -> set[int]:
    ids: set[int] = set()
    sources = [getattr(config, "eos_token_id", None)]
    gen_path = os.path.join(model_path, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            sources.append(json.load(f).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return ids


def _load_weights(model: LlamaForCausalLM, files: list[str], tied: bool) -> None:
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    pending = {name: None for name in params}  # params not yet fully written
    fused_seen: dict[str, set[str]] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                tensor = f.get_tensor(name)
                target = _fused_target(name, modules)
                if target is not None:
                    param_name, shard = target
                    module = modules[param_name.rsplit(".", 1)[0]]
                    offset, size = module.shard_offsets[shard]
                    _copy(params[param_name].data.narrow(0, offset, size), tensor, name)
                    fused_seen.setdefault(param_name, set()).add(shard)
                    if len(fused_seen[param_name]) == len(module.shard_offsets):
                        pending.pop(param_name, None)
                elif name in params:
                    _copy(params[name].data, tensor, name)
                    pending.pop(name, None)
                else:
                    raise UnsupportedModel(f"unexpected tensor {name!r} in checkpoint", param="model")
    if pending:
        raise UnsupportedModel(f"checkpoint lacks tensors for: {', '.join(sorted(pending)[:8])}", param="model")


def _fused_target(name: str, modules: dict) -> tuple[str, str] | None:
    """'...self_attn.k_proj.weight' -> ('...self_attn.qkv_proj.weight', 'k_proj') when fused."""
    parts = name.split(".")
    if len(parts) < 3:
        return None
    parent, shard, kind = ".".join(parts[:-2]), parts[-2], parts[-1]
    for fused in ("qkv_proj", "gate_up_proj"):
        module = modules.get(f"{parent}.{fused}")
        if isinstance(module, FusedLinear) and shard in module.shard_offsets:
            return f"{parent}.{fused}.{kind}", shard
    return None


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise UnsupportedModel(
            f"tensor {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}", param="model"
        )
    dst.copy_(src)
