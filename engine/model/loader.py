"""Hugging Face safetensors checkpoint -> our modules (q/k/v and gate/up fused), cast to the serving dtype.

config.json is read as plain JSON rather than through transformers' AutoConfig: importing transformers and
building its config object cost over a second of every cold start, and the engine reads a dozen fields.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from glob import glob

import torch
from safetensors import safe_open

from engine.config import LoraConfig
from engine.core.kv_spec import KVGroupSpec, kv_groups, layer_windows
from engine.errors import UnsupportedModel
from engine.model.layers.linear import pack_linears_for_cpu, quantize_linears_int4
from engine.model.layers.lora import attach_lora
from engine.model.models import model_class
from engine.model.models.llama import FusedLinear, LlamaArgs, LlamaForCausalLM

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
    kv_groups: list[KVGroupSpec]  # the KV cache's layer groups (one for a full-attention model)


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
    config = read_config(model_path)
    architecture = (config.get("architectures") or ["<none>"])[0]
    cls = model_class(architecture)
    if config.get("quantization_config"):
        raise UnsupportedModel("quantized checkpoints are not supported", param="model")
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act {config['hidden_act']!r} is not supported", param="model")

    files = _safetensors_files(model_path)
    names = _tensor_names(files)
    args = _llama_args(config, architecture, names)
    tied = bool(config.get("tie_word_embeddings")) or "lm_head.weight" not in names

    with torch.device("meta"):
        model = cls(args)
    _materialize(model, dtype, device)
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
        max_position_embeddings=args.max_position_embeddings,
        eos_token_ids=_eos_token_ids(config, model_path),
        dtype=dtype,
        kv_groups=kv_groups(layer_windows(config, args.num_layers), args.num_kv_heads, args.head_dim),
    )
    return model, spec


def read_config(model_path: str) -> dict:
    """config.json as a dict (transformers fills in its defaults for keys it leaves out; so do the readers)."""
    with open(os.path.join(model_path, "config.json")) as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise UnsupportedModel("config.json does not hold a JSON object", param="model")
    return config


def _materialize(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Meta parameters and buffers -> uninitialised ones of `dtype` on `device`, which the checkpoint fills.

    NOTE: not `model.to(dtype).to_empty(device)`: on meta tensors those run torch's Python reference kernels,
    which import sympy and torch.fx (about half a second of every cold start).
    """
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            empty = torch.empty(param.shape, dtype=dtype, device=device)
            setattr(module, name, torch.nn.Parameter(empty, requires_grad=False))
        for name, buffer in module.named_buffers(recurse=False):
            kind = dtype if buffer.is_floating_point() else buffer.dtype
            module.register_buffer(name, torch.empty(buffer.shape, dtype=kind, device=device))


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


def rope_parameters(config: dict) -> dict:
    """transformers 5 `rope_parameters`, or the older `rope_scaling` + `rope_theta` pair, as one dict."""
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        return dict(rope)
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        raise UnsupportedModel("per-layer-type rope parameters are not supported", param="model")
    scaling = dict(config.get("rope_scaling") or {})
    scaling["rope_type"] = scaling.get("rope_type", scaling.pop("type", "default"))
    scaling["rope_theta"] = config.get("rope_theta") or 10000.0
    return scaling


def _llama_args(config: dict, architecture: str, names: set[str]) -> LlamaArgs:
    try:
        heads, hidden = config["num_attention_heads"], config["hidden_size"]
        return LlamaArgs(
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_q_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            vocab_size=config["vocab_size"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            rope=rope_parameters(config),
            # Biases are read off the checkpoint: Qwen2 always has qkv bias, Llama only with attention_bias.
            qkv_bias=any(n.endswith("self_attn.q_proj.bias") for n in names),
            o_bias=any(n.endswith("self_attn.o_proj.bias") for n in names),
            mlp_bias=any(n.endswith("mlp.gate_proj.bias") for n in names),
            qk_norm=architecture == "Qwen3ForCausalLM",
        )
    except KeyError as exc:
        raise UnsupportedModel(f"config.json lacks {exc.args[0]!r}", param="model") from None


def _eos_token_ids(config: dict, model_path: str) -> set[int]:
    ids: set[int] = set()
    sources = [config.get("eos_token_id")]
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
