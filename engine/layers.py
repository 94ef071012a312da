"""Building blocks of Llama-family decoders: RMSNorm, rotary embedding (with HF rope scaling), SiLU-and-mul.

On CUDA with a half dtype the model switches these to engine.kernels (FlashInfer) once, at init_rotary();
the torch code below is the CPU path and stays exactly as it was.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine import kernels
from engine.errors import UnsupportedModel


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 like transformers, optionally fused with the residual add.

    `fused` (set once by the model on CUDA) routes both methods to FlashInfer's kernels.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return kernels.rmsnorm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # transformers: normalise in float32, cast back, then scale in the model dtype. F.rms_norm on a half
        # input computes in float32 and rounds once: bit-identical to that math, in fewer ops.
        return self.weight * F.rms_norm(x, (x.shape[-1],), None, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual): the pre-norm decoder's residual stream step.

        Both inputs may be overwritten (they are step-local activations)."""
        if self.fused:
            return kernels.fused_add_rmsnorm(x, residual, self.weight, self.eps)
        residual = x.add_(residual)
        return self.forward(residual), residual


class PackedLinear(nn.Module):
    """A CPU bf16 Linear whose weight is pre-packed for oneDNN (AMX / AVX512-BF16).

    NOTE: a plain bf16 F.linear hands oneDNN the row-major weight, which it reorders on every call;
    at batch 1 that reorder costs more than the matmul itself.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # NOTE: packed for a batch of 64; on this kind of CPU that layout runs batch 1 no slower than a
        # batch-1 packing while larger batches avoid a re-layout per call (measured 1.3-1.5x faster steps).
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 64))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears_for_cpu(model: nn.Module) -> int:
    """Swaps every bf16 nn.Linear of a CPU model for a PackedLinear; returns how many (0 when unsupported)."""
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return 0
    return _swap_linears(
        model, lambda child: child.weight.dtype == torch.bfloat16 and child.weight.device.type == "cpu", PackedLinear
    )


# GGUF Q4_1's block: a 4-bit code per weight, and a scale and a minimum per 32 consecutive input weights.
INT4_GROUP = 32


class Int4Linear(nn.Module):
    """Weight-only 4-bit Linear on CPU through torch's int4 kernel: per group of 32 inputs, w = scale * code + min.

    NOTE: that is Q4_1's layout, and a Q4_1 quantizer gives each group's smallest weight code 0 and its
    largest code 15; so the weights of a checkpoint dequantized from Q4_1 (the default model) come back as
    exactly their original codes, and int4 serves that model as it was published rather than approximating it.
    """

    def __init__(self, linear: nn.Linear, dtype: torch.dtype) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        n, k = w.shape
        if n % 16 or k % INT4_GROUP:
            raise UnsupportedModel(
                f"int4 needs layers whose output size is a multiple of 16 and input size a multiple of "
                f"{INT4_GROUP}; this model has a {k} -> {n} layer", param="quantization",
            )
        groups = w.view(n, k // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = torch.where(high > low, (high - low) / 15, torch.ones_like(low))
        codes = ((groups - low[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.int32).view(n, k)
        self.in_features, self.out_features = k, n
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        # The kernel computes (code - 8) * scale + zero, [k / group, n, 2] in the activation dtype.
        zero = low + 8 * scale
        self.register_buffer("scales_and_zeros", torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(dtype))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scales_and_zeros)
        return y if self.bias is None else y.add_(self.bias)


def quantize_linears_int4(model: nn.Module, dtype: torch.dtype) -> int:
    """Swaps the nn.Linear layers under `model` for Int4Linear; returns how many."""
    return _swap_linears(model, lambda child: True, lambda child: Int4Linear(child, dtype))


def _swap_linears(model: nn.Module, select, make) -> int:
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and select(child)
    ]
    for parent, name, child in targets:
        setattr(parent, name, make(child))
    return len(targets)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused gate_up projection: silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def rope_inv_freq(head_dim: int, rope: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale for one of transformers' rope types (float32, CPU)."""
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    base = float(rope.get("rope_theta", 10000.0))
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModel("partial_rotary_factor != 1 is not supported", param="model")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type in ("default", "dynamic"):
        # "dynamic" starts from the plain frequencies; RotaryEmbedding rescales positions past the context.
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(rope["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, base, rope, max_position_embeddings)
    raise UnsupportedModel(f"rope type {rope_type!r} is not supported", param="model")


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: dict) -> torch.Tensor:
    factor = float(rope["factor"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old_len = float(rope["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(head_dim: int, base: float, rope: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    original = rope.get("original_max_position_embeddings") or max_pos
    factor = rope.get("factor") or max_pos / original
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        if rope.get("mscale") and rope.get("mscale_all_dim"):
            attention_factor = mscale(factor, rope["mscale"]) / mscale(factor, rope["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding:
    """Precomputed cos/sin tables (half head_dim wide) indexed by absolute positions.

    fused (CUDA): instead of the model-dtype cos/sin, one float32 cos|sin table (`cos_sin_cache`) for
    FlashInfer's in-place RoPE kernel, built from the float32 angles so no bf16 rounding enters it.

    Dynamic NTK: positions inside max_position_embeddings use the plain frequencies; a position p past it
    uses the base transformers derives for a sequence of p + 1 tokens, which is what a cached decode in
    transformers applies to that token.
    """

    def __init__(
        self,
        head_dim: int,
        rope: dict,
        max_position_embeddings: int,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
        fused: bool = False,
    ) -> None:
        inv_freq, scale = rope_inv_freq(head_dim, rope, max_position_embeddings)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        if rope.get("rope_type", rope.get("type")) == "dynamic" and max_positions > max_position_embeddings:
            freqs[max_position_embeddings:] = _dynamic_freqs(head_dim, rope, max_position_embeddings, max_positions)
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None
        self.cos_sin_cache: torch.Tensor | None = None
        if fused:
            self.cos_sin_cache = kernels.cos_sin_cache(freqs.cos() * scale, freqs.sin() * scale).to(device)
        else:
            self.cos = (freqs.cos() * scale).to(dtype=dtype, device=device)
            self.sin = (freqs.sin() * scale).to(dtype=dtype, device=device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim / 2] for the step's positions (once per forward)."""
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(0, positions).unsqueeze(1)


def _dynamic_freqs(head_dim: int, rope: dict, max_pos: int, max_positions: int) -> torch.Tensor:
    factor, theta = float(rope["factor"]), float(rope.get("rope_theta", 10000.0))
    pos = torch.arange(max_pos, max_positions, dtype=torch.float32)
    base = theta * ((factor * (pos + 1) / max_pos) - (factor - 1)) ** (head_dim / (head_dim - 2))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base[:, None] ** exponents[None, :])
    return pos[:, None] * inv_freq


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [T, heads, head_dim] in place (neox / rotate_half layout) and returns it."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    x1_orig = x1.clone()
    x1.mul_(cos).addcmul_(x2, sin, value=-1)
    x2.mul_(cos).addcmul_(x1_orig, sin)
    return x
