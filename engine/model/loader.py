"""Hugging Face safetensors checkpoint -> the family's modules (q/k/v and gate/up fused), cast to the serving dtype.

config.json is read as plain JSON rather than through transformers' AutoConfig: importing transformers and
building its config object cost over a second of every cold start, and the engine reads a dozen fields.
"""

from __future__ import annotations

import json
import os

import torch

from engine.config import LoraConfig
from engine.errors import StartupError, UnsupportedModel
from engine.model.checkpoint import load_weights, plan_copies, safetensors_files, tensor_shapes
from engine.model.classifier import attach_score, check_tokens, read_classifier, score_head
from engine.model.kv_scales import check_kv_cache_scheme, kv_scale_places, load_kv_scales
from engine.model.layers.linear import pack_linears_for_cpu, quantize_linears_int4
from engine.model.layers.lora import attach_lora, target_shapes
from engine.model.layers.parallel import TensorParallel
from engine.model.layers.rotary import log_longrope_choice
from engine.model.model_spec import ModelSpec, start_spec
from engine.model.models import CausalLM, model_class
from engine.model.quant.base import QuantFormat
from engine.model.quant.registry import quant_format
from engine.model.sharding import check_shardable, finish_shard

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
QUANTIZATIONS = ("int4",)
TP_SIZES = (1, 2, 4, 8)


def load_model(
    model_path: str,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
    lora: LoraConfig | None = None,
    tp: TensorParallel | None = None,
    max_model_len: int | None = None,
) -> tuple[CausalLM, ModelSpec]:
    """Reads config.json and the safetensors shards under model_path; returns the model (eval, on device).

    quantization "int4": the decoder layers' linears become 4-bit weight-only (CPU); embeddings, norms
    and lm_head stay in `dtype`. lora: its adapters wrap the projections they target (model.lora). tp: load
    only rank tp.rank's shard (engine/model/sharding.py); its KV groups then hold that rank's KV heads.
    max_model_len: the longest sequence served (None: the model's max_position_embeddings), the length of the rotary
    tables and what LongRoPE picks its factors by.
    """
    if dtype not in SUPPORTED_DTYPES:
        raise UnsupportedModel(f"dtype {dtype} is not supported (float32, bfloat16, float16)", param="dtype")
    device = torch.device(device)
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise UnsupportedModel(f"quantization {quantization!r} is not supported (int4)", param="quantization")
    if quantization == "int4" and device.type != "cpu":
        raise UnsupportedModel("quantization 'int4' runs on CPU only", param="quantization")
    config, files, shapes, model, fmt = _build_on_meta(model_path, tp)
    if fmt is not None and quantization is not None:
        raise UnsupportedModel(
            f"QUANTIZATION={quantization} quantizes float weights; this checkpoint is already "
            f"{fmt.name}: leave QUANTIZATION unset",
            param="quantization",
        )
    if quantization is not None and getattr(model, "encoder", False):
        raise UnsupportedModel(
            f"QUANTIZATION={quantization} does not quantize encoders: leave it unset", param="quantization"
        )
    tied = _tied(config, shapes)
    _materialize(model, dtype, device)
    if tied:
        model.tie_weights()
    load_weights(model, files, shapes, tied)
    if tp is not None:
        finish_shard(model, model.shard_plan, tp)
    load_kv_scales(model, files, shapes)
    if fmt is not None:
        # Before LoRA: its adapters wrap the serving modules and run in the serving dtype.
        fmt.serve(model, dtype, device)
    if lora is not None and (lora.adapters or lora.runtime):
        attach_lora(model, lora.adapters, lora.max_loras, lora.max_lora_rank, lora.runtime)
    if quantization == "int4":
        quantize_linears_int4(model.model.layers, dtype)
    head = getattr(model.lm_head, "weight", None)
    if dtype != torch.float32 and isinstance(head, torch.Tensor) and head.dtype == dtype:
        # NOTE: tied heads share the embedding's storage; an untied one is held twice once packed below.
        model.head_weight = head.detach()
    if device.type == "cpu" and dtype == torch.bfloat16:
        # Set once every bf16 linear is packed for oneDNN (a large model's are packed after this returns).
        model.cpu_packing = pack_linears_for_cpu(model)
    limit = model.args.max_position_embeddings
    max_positions = min(max_model_len or limit, limit)
    spec = start_spec(model, config, model_path, dtype=dtype, device=device, tp=tp, max_positions=max_positions)
    log_longrope_choice(getattr(model.args, "rope", None) or {}, max_positions)
    if model.classifier is not None:
        spec.score_head = score_head(model, model.classifier, model_path)
    model.eval().requires_grad_(False)
    return model, spec


def load_part(module: torch.nn.Module, model_path: str, prefix: str, dtype: torch.dtype, device: torch.device) -> None:
    """Fills `module`, built on the meta device, from the checkpoint's tensors named `prefix`* (its
    checkpoint_name() maps them to its parameters; the others are not read): a part of a checkpoint that runs
    beside the family's model (Qwen3.5's MTP head), its linears quantized as the checkpoint stores them (those
    it left in float stay float), bf16 ones packed for a CPU as the model's are. UnsupportedModel as load_model's,
    in one line."""
    files, device = safetensors_files(model_path), torch.device(device)
    shapes = {name: shape for name, shape in tensor_shapes(files).items() if name.startswith(prefix)}
    fmt = quant_format(read_config(model_path))
    if fmt is not None and any(name.endswith(f".{fmt.marker}") for name in shapes):
        fmt.swap(module, shapes)
    else:
        fmt = None
    _materialize(module, dtype, device)
    load_weights(module, files, shapes, tied=False)
    if fmt is not None:
        fmt.serve(module, dtype, device)
    if device.type == "cpu" and dtype == torch.bfloat16:
        pack_linears_for_cpu(module)


def check_checkpoint(model_path: str) -> str:
    """What the bake asks before it keeps a folder: the engine runs this architecture and config, every checkpoint
    tensor has a place of the right shape (read from the headers; no weights are loaded), and the model built from
    the config passes what start-up asks of it (load_model's start_spec). Returns the architecture; raises
    UnsupportedModel with one line naming what is missing."""
    config, _, shapes, model, _ = _build_on_meta(model_path)
    plan_copies(model, shapes, _tied(config, shapes))
    kv_scale_places(model, shapes)
    # NOTE: a table of one position on the CPU: rotary tables on the meta device run torch's Python reference
    # kernels (sympy's import, over a second), and what the rotary refuses reads the config, not the table's length.
    start_spec(model, config, model_path, dtype=torch.float32, device=torch.device("cpu"), tp=None, max_positions=1)
    check_tokens(model.classifier, model_path)
    return config["architectures"][0]


def shard_refusal(model_path: str, size: int) -> str | None:
    """Why `size` tensor-parallel ranks cannot split the checkpoint, in one line (None: they can): its counts
    (sharding.check_shardable), its format's groups, and each tensor the last rank reads, sliced as that rank's load
    slices them, on the meta device (no weights are read). Start-up's check and the bake's list both ask it."""
    if size == 1:
        return None
    try:
        _build_on_meta(model_path, TensorParallel(size - 1, size))
    except StartupError as exc:
        return exc.message
    except UnsupportedModel as exc:  # what only a shard's shapes meet (the whole model passed the bake's check)
        return f"tensor_parallel_size={size}: {exc.message}"
    return None


def tensor_parallel_sizes(model_path: str) -> list[int]:
    """The sizes among TP_SIZES that split the checkpoint (the bake records them)."""
    return [size for size in TP_SIZES if shard_refusal(model_path, size) is None]


def _read_args(model_path: str) -> tuple[dict, type, object, list[str], dict[str, tuple[int, ...]]]:
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise UnsupportedModel(
            f"no model at {model_path!r} (no config.json there): bake one with `python -m builder --out "
            f"{model_path}`, or point MODEL_PATH (or BASE_PATH) at a baked folder",
            param="model",
        )
    config = read_config(model_path)
    cls = model_class((config.get("architectures") or ["<none>"])[0])
    quant_format(config)  # an unsupported format is named before the weights are looked at
    check_kv_cache_scheme(config)
    files = safetensors_files(model_path)
    shapes = tensor_shapes(files)
    try:
        args = cls.read_args(config, set(shapes))
    except KeyError as exc:
        raise UnsupportedModel(f"config.json lacks {exc.args[0]!r}", param="model") from None
    return config, cls, args, files, shapes


def _build_on_meta(
    model_path: str, tp: TensorParallel | None = None
) -> tuple[dict, list[str], dict[str, tuple[int, ...]], CausalLM, QuantFormat | None]:
    """config.json, the weight files, their tensors' shapes, the family's model on the meta device (its quantized
    linears in their checkpoint layout; tp: rank tp.rank's shard of it), and the quantization format (None for
    float weights)."""
    config, cls, args, files, shapes = _read_args(model_path)
    fmt = quant_format(config)
    classifier = read_classifier(config, shapes)
    with torch.device("meta"):
        model = cls(args)
        attach_score(model, classifier, args.hidden_size)
    model.classifier = classifier
    if tp is not None:
        if classifier is not None:
            raise StartupError(
                "tensor parallelism does not shard cross-encoders yet: serve it with tensor_parallel_size=1",
                param="tensor_parallel_size",
            )
        if fmt is not None:
            fmt.check_shard(args, tp.size)
        check_shardable(config["architectures"][0], args, tp.size)
        whole = target_shapes(model)  # what a LoRA adapter is checked against before a rank takes its part
        with torch.device("meta"):
            model.shard_plan = model.shard(tp)
        if tp.rank:  # rank 0 alone runs an image tower: it sends the other ranks each step's image embeddings
            for name in getattr(model, "TOWER_MODULES", ()):
                setattr(model, name, None)  # (and its tensors are not read: engine/model/checkpoint.py)
        model.shard_plan.lora_shapes = whole
        model.checkpoint_sources = model.shard_plan.sources
    if fmt is not None:
        fmt.swap(model, shapes)
    return config, files, shapes, model, fmt


def _tied(config: dict, shapes: dict[str, tuple[int, ...]]) -> bool:
    """The lm_head is the embedding's: the checkpoint has none, or config.json ties them and an image-text config's
    text_config does not say otherwise (transformers 4's rule; Mistral3Config's top level defaults to tied while its
    checkpoints carry their own head)."""
    # (language_model.lm_head.weight: an image-text checkpoint of transformers 4's layout, Mistral 3's)
    if not {"lm_head.weight", "language_model.lm_head.weight"} & set(shapes):
        return True
    text = config.get("text_config") or {}
    return bool(config.get("tie_word_embeddings")) and text.get("tie_word_embeddings") is not False


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
        # A quantized linear's codes and scales (True: all its parameters), or the names of those it keeps.
        keep = getattr(module, "checkpoint_dtypes", False)
        for name, param in module.named_parameters(recurse=False):
            kept = keep is True or (bool(keep) and name in keep)
            empty = torch.empty(param.shape, dtype=param.dtype if kept else dtype, device=device)
            setattr(module, name, torch.nn.Parameter(empty, requires_grad=False))
        for name, buffer in module.named_buffers(recurse=False):
            kind = dtype if buffer.is_floating_point() else buffer.dtype
            module.register_buffer(name, torch.empty(buffer.shape, dtype=kind, device=device))
