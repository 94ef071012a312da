"""Tiny quantized checkpoints, written in each format's own layout from a random transformers model.

AWQ and GPTQ are packed here as AutoAWQ and AutoGPTQ pack them (their layouts are defined by that code);
compressed-tensors checkpoints are written by the compressed-tensors library itself. Each writer returns the
float32 weights the checkpoint stands for, which the transformers reference model then runs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
# A hub MoE checkpoint's expert projection (Mixtral's w1 gate, w3 up, w2 down) and its place in transformers 5's
# fused experts: (parameter, which half of gate_up_proj or None).
EXPERT = re.compile(r"^(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
EXPERT_PLACE = {
    "gate_proj": ("gate_up_proj", 0),
    "w1": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "w3": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
    "w2": ("down_proj", None),
}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack: nibble i of a word holds column AWQ_ORDER[i] of its 8
TINY = dict(
    vocab_size=128,
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_hidden_layers=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
)


def checkpoint_linear(fmt, tensors: dict[str, torch.Tensor], in_features: int, out: int):
    """One quantized linear holding `tensors` (a single checkpoint matrix), as the loader would fill it."""
    from engine.model.quant.base import CheckpointLinear

    linear = CheckpointLinear(
        fmt=fmt,
        shards={"proj": out},
        in_features=in_features,
        bias=False,
        shapes={k: tuple(v.shape) for k, v in tensors.items()},
    )
    for layout in linear.present:
        value = tensors[layout.suffix]
        value = value[None] if layout.dim is None else value
        setattr(linear, layout.suffix, nn.Parameter(value.to(layout.dtype), requires_grad=False))
    return linear


def int4_codes(w: torch.Tensor, group: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group of inputs: codes q [out, in] 0..15, zeros z and fp16-exact scales s [out, in / group];
    w ~ (q - z) * s (z = 8 when symmetric)."""
    n, k = w.shape
    g = w.view(n, k // group, group)
    if symmetric:
        s = g.abs().amax(-1) / 7
        z = torch.full_like(s, 8)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        s = (hi - lo) / 15
        z = (-lo / s).round().clamp(0, 15)
    s = s.half().float()
    q = ((g / s[..., None]).round() + z[..., None]).clamp(0, 15)
    return q.view(n, k).int(), z.int(), s


def dequant(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, group: int) -> torch.Tensor:
    return (q.float() - z.float().repeat_interleave(group, 1)) * s.repeat_interleave(group, 1)


def pack_columns(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[rows, cols] 0..15 -> [rows, cols / 8] int32; nibble i of word j holds column 8 j + order[i]."""
    out = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int32)
    for i in range(8):
        out |= values[:, order[i] :: 8].int() << (4 * i)
    return out


def awq_tensors(w: torch.Tensor, group: int = 128) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    q, z, s = int4_codes(w, group, symmetric=False)
    tensors = {
        "qweight": pack_columns(q.t(), AWQ_ORDER),
        "qzeros": pack_columns(z.t(), AWQ_ORDER),
        "scales": s.t().half().contiguous(),
    }
    return tensors, dequant(q, z, s, group)


def gptq_tensors(w: torch.Tensor, group: int = 128, symmetric: bool = True) -> tuple[dict, torch.Tensor]:
    """AutoGPTQ's v1 layout: qweight packs 8 input rows per word, qzeros hold z - 1 (wrapped to 4 bits)."""
    q, z, s = int4_codes(w, group, symmetric)
    n, k = w.shape
    tensors = {
        "qweight": pack_columns(q, tuple(range(8))).t().contiguous(),
        "qzeros": pack_columns(((z - 1) & 15).t()),
        "scales": s.t().half().contiguous(),
        "g_idx": (torch.arange(k) // group).int(),
    }
    assert tensors["qweight"].shape == (k // 8, n)
    return tensors, dequant(q, z, s, group)


def compressed_int4_tensors(w: torch.Tensor, group: int = 128, symmetric: bool = False) -> tuple[dict, torch.Tensor]:
    """compressed-tensors' own PackedQuantizationCompressor; the reference is its own decompress()."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    q, z, s = int4_codes(w, group, symmetric)
    scheme = compressed_int4_scheme(group, symmetric)
    state = {"weight": dequant(q, z, s, group), "weight_scale": s}
    if not symmetric:
        state["weight_zero_point"] = (z - 8).to(torch.int8)
    packed = PackedQuantizationCompressor.compress(state, scheme)
    back = PackedQuantizationCompressor.decompress(dict(packed), scheme)["weight"].float()
    return dict(packed), back


def compressed_int4_scheme(group: int, symmetric: bool):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group),
    )


def compressed_fp8_tensors(w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """Per-channel FP8 weights (dynamic per-token activations), compressed by FloatQuantizationCompressor."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor

    scheme = compressed_fp8_scheme()
    scale = w.abs().amax(1, keepdim=True) / 448
    packed = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    back = FloatQuantizationCompressor.decompress(dict(packed), scheme)["weight"].float()
    return dict(packed), back


def compressed_fp8_scheme(strategy: str = "channel"):
    """FP8 weights per output channel with dynamic per-token activations, or per tensor with static activation
    scales (input_scale)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    activations = "token" if strategy == "channel" else "tensor"
    return QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True),
        input_activations=QuantizationArgs(
            num_bits=8, type="float", strategy=activations, dynamic=strategy == "channel"
        ),
    )


def compressed_fp8_tensor_tensors(w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """Per-tensor FP8 weights with a static per-tensor input_scale, compressed by FloatQuantizationCompressor."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor

    scheme = compressed_fp8_scheme("tensor")
    packed = FloatQuantizationCompressor.compress(
        {"weight": w, "weight_scale": (w.abs().amax() / 448).reshape(1)}, scheme
    )
    back = FloatQuantizationCompressor.decompress(dict(packed), scheme)["weight"].float()
    return {**packed, "input_scale": torch.tensor([0.02])}, back


def fp8_block_tensors(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[dict, torch.Tensor]:
    """The hub's block-wise FP8: weight_scale_inv per [rows, columns] block (a partial last block where the rows or
    columns are not a multiple, as a 64-row K projection has); the reference is transformers' own dequantiser."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    n, k = w.shape
    (br, bc), rows, cols = block, -(-n // block[0]), -(-k // block[1])
    padded = torch.zeros(rows * br, cols * bc)
    padded[:n, :k] = w
    blocks = padded.view(rows, br, cols, bc)
    scale = (blocks.abs().amax((1, 3)) / 448).clamp(min=1e-12)  # an all-zero block (0 / 0) would be NaN
    weight = (blocks / scale[:, None, :, None]).view(rows * br, cols * bc)[:n, :k].to(torch.float8_e4m3fn)
    back = _dequantize_fp8_weight(weight, scale, list(block), torch.float32).float()
    return {"weight": weight, "weight_scale_inv": scale}, back


def quantization_config(kind: str, float_modules: tuple[str, ...] = ()) -> dict:
    """`float_modules`: what the checkpoint leaves in float beside lm_head (an MoE's routers), listed as each
    format's config lists them."""
    not_converted = ["lm_head", *float_modules]
    if kind == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": 128,
            "version": "gemm",
            "zero_point": True,
            **({"modules_to_not_convert": list(float_modules)} if float_modules else {}),
        }
    if kind in ("gptq", "gptq_asym"):
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": 128,
            "desc_act": False,
            "sym": kind == "gptq",
            "checkpoint_format": "gptq",
        }
    if kind == "fp8_block":
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": not_converted,
        }
    if kind.startswith("ct_fp8"):
        scheme, fmt = compressed_fp8_scheme("tensor" if kind == "ct_fp8_tensor" else "channel"), "float-quantized"
    else:
        scheme, fmt = compressed_int4_scheme(128, symmetric=False), "pack-quantized"
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "ignore": not_converted,
        "quantization_status": "compressed",
        "config_groups": {"group_0": scheme.model_dump(mode="json")},
    }


WRITERS = {
    "awq": awq_tensors,
    "gptq": gptq_tensors,
    "gptq_asym": lambda w: gptq_tensors(w, symmetric=False),
    "ct_int4": compressed_int4_tensors,
    "ct_fp8": compressed_fp8_tensors,
    "fp8_block": fp8_block_tensors,
    "ct_fp8_tensor": compressed_fp8_tensor_tensors,
}


def write_quantized(kind: str, model_type: str, path: Path, **sizes: object):
    """A tiny random model (TINY, with `sizes` changed) saved in `kind`'s format; returns the transformers model
    holding the weights that checkpoint stands for (float32)."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.AutoConfig.for_model(model_type, **{**TINY, **sizes})
    model = tf.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.5 if "embed" in name else 0.15)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    state = model.state_dict()
    for name in list(tensors):
        module, _, kind_ = name.rpartition(".")
        if kind_ != "weight" or module.rsplit(".", 1)[-1] not in PROJECTIONS:
            continue
        quantized, reference = WRITERS[kind](tensors.pop(name).float())
        tensors.update({f"{module}.{k}": v.contiguous() for k, v in quantized.items()})
        with torch.no_grad():
            reference_slot(state, name).copy_(reference)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config_json = json.loads((path / "config.json").read_text())
    routers = sorted({n.removesuffix(".weight") for n in tensors if re.search(r"\.(mlp|block_sparse_moe)\.gate\.", n)})
    config_json["quantization_config"] = quantization_config(kind, tuple(routers))
    (path / "config.json").write_text(json.dumps(config_json))
    return model


def reference_slot(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The transformers tensor a checkpoint matrix `name` loads into: itself, or an expert's slice of the fused
    experts (experts.gate_up_proj [E, 2I, H] gate first, experts.down_proj [E, H, I])."""
    match = EXPERT.match(name)
    if match is None:
        return state[name]
    layer, expert, proj = match.groups()
    param, half = EXPERT_PLACE[proj]
    fused = state[f"{layer}.mlp.experts.{param}"][int(expert)]
    return fused if half is None else fused.chunk(2, dim=0)[half]


def fp8_stacked_linear(strategy: str, sizes: dict[str, int], in_features: int, seed: int = 0):
    """(fmt, CheckpointLinear) of q|k|v-style matrices (`sizes`: name -> rows) in compressed-tensors FP8: one scale
    per matrix ("tensor", each its own amax / 448) or per row ("channel")."""
    from engine.model.quant.base import CheckpointLinear
    from engine.model.quant.fp8 import Fp8Format

    torch.manual_seed(seed)
    w = torch.randn(sum(sizes.values()), in_features) * 0.05
    parts = w.split(list(sizes.values()))
    if strategy == "channel":
        scale = w.abs().amax(1, keepdim=True) / 448
        rows = scale
    else:
        scale = torch.stack([p.abs().max() / 448 for p in parts])[:, None]
        rows = scale.repeat_interleave(torch.tensor(list(sizes.values())), dim=0)
    fmt = Fp8Format("compressed-tensors fp8", "weight_scale", strategy)
    shapes = {"weight": tuple(w.shape), "weight_scale": (1,) if strategy == "tensor" else (w.shape[0], 1)}
    linear = CheckpointLinear(fmt=fmt, shards=sizes, in_features=in_features, bias=False, shapes=shapes)
    linear.weight = nn.Parameter((w / rows).to(torch.float8_e4m3fn), requires_grad=False)
    linear.weight_scale = nn.Parameter(scale, requires_grad=False)
    return fmt, linear
