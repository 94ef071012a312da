"""Rotary position embedding with transformers' rope types (default, linear, dynamic, llama3, yarn, proportional,
longrope).

On CUDA with a half dtype the model switches to FlashInfer's RoPE kernel once, at init_rotary(); the torch code
here is the CPU path.
"""

from __future__ import annotations

import logging
import math

import torch

from engine.cuda import kernels
from engine.errors import UnsupportedModel

log = logging.getLogger(__name__)


def rope_parameters(config: dict) -> dict:
    """transformers 5 `rope_parameters`, or the older `rope_scaling` + `rope_theta` pair, as one dict. A top-level
    partial_rotary_factor joins it, as transformers moves it there (only a RotaryEmbedding built `partial` runs it;
    rope_inv_freq refuses it rather than rotate the whole head)."""
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        rope = dict(rope)
    elif isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        raise UnsupportedModel("per-layer-type rope parameters are not supported", param="model")
    else:
        rope = dict(config.get("rope_scaling") or {})
        rope["rope_type"] = rope.get("rope_type", rope.pop("type", "default"))
        rope["rope_theta"] = config.get("rope_theta") or 10000.0
    if config.get("partial_rotary_factor") is not None:
        rope.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    return rope


def rope_inv_freq(
    head_dim: int, rope: dict, max_position_embeddings: int, max_positions: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale for one of transformers' rope types (float32, CPU). max_positions:
    the longest sequence served (LongRoPE picks its factors by it; None: max_position_embeddings)."""
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    base = float(rope.get("rope_theta", 10000.0))
    if rope_type == "proportional":
        return _proportional_inv_freq(head_dim, base, rope), 1.0
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
    if rope_type == "longrope":
        return _longrope_inv_freq(head_dim, base, rope, max_position_embeddings, max_positions)
    raise UnsupportedModel(f"rope type {rope_type!r} is not supported", param="model")


def _proportional_inv_freq(head_dim: int, base: float, rope: dict) -> torch.Tensor:
    """Gemma 4's global layers: the first partial_rotary_factor of each half rotates at the full-width frequencies,
    the rest does not rotate (frequency 0: cos 1, sin 0)."""
    angles = int(float(rope.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    rotated = 1.0 / (base ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
    inv_freq = torch.cat((rotated, torch.zeros(head_dim // 2 - angles)))
    return inv_freq / float(rope.get("factor", 1.0))


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


def _longrope_inv_freq(
    head_dim: int, base: float, rope: dict, max_pos: int, max_positions: int | None
) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3, Phi-3.5-MoE, Phi-4-mini): per-frequency divisors, `long_factor` for a context past
    original_max_position_embeddings, `short_factor` within it; the scale `long_mscale` / `short_mscale` where the
    config gives them, else sqrt(1 + log(factor) / log(original)).

    NOTE: transformers picks the factors per forward call by the longest position in it, so a sequence changes
    factors as it grows past the original context while its cached keys keep the old ones. Here, as in vLLM, one set
    serves every position: the long factors when the served context (max_positions) is past the original, else the
    short. Within the original context with a served context inside it, and for a prompt past it with a served
    context past it, both give transformers' values; a short prompt served with a long context is rotated by the
    long factors."""
    missing = [k for k in ("short_factor", "long_factor", "original_max_position_embeddings") if not rope.get(k)]
    if missing:
        raise UnsupportedModel(f"rope type 'longrope' needs {' and '.join(missing)}", param="model")
    original = int(rope["original_max_position_embeddings"])
    for key in ("short_factor", "long_factor"):
        if len(rope[key]) != head_dim // 2:
            raise UnsupportedModel(
                f"longrope factors give {len(rope[key])} frequencies for a rotary width of {head_dim}", param="model"
            )
    long = uses_long_factors(rope, max_positions or max_pos)
    factors = torch.tensor(rope["long_factor" if long else "short_factor"], dtype=torch.float32)
    factor = rope.get("factor") or max_pos / original
    scale = rope.get("long_mscale" if long else "short_mscale") or rope.get("attention_factor")
    if scale is None:
        scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (factors * base**exponents), float(scale)


def uses_long_factors(rope: dict, served: int) -> bool:
    """LongRoPE's one set for a served context of `served` positions: the long factors past the original context."""
    return served > int(rope["original_max_position_embeddings"])


def log_longrope_choice(rope: dict, served: int) -> None:
    """Says which LongRoPE factors the served context picks, once at start-up (nothing for another rope type). The
    bake's check builds its tables for one position and says nothing: the worker's served context is its own."""
    if rope.get("rope_type", rope.get("type")) != "longrope":
        return
    log.info(
        "LongRoPE: the %s factors for a served context of %d (original %d)",
        "long" if uses_long_factors(rope, served) else "short",
        served,
        int(rope["original_max_position_embeddings"]),
    )


def partial_rotary(head_dim: int, rope: dict) -> tuple[int, dict]:
    """(rotary_dim, the rope without its factor) for transformers' partial rotary as GLM-4.5 applies it: the first
    head_dim * partial_rotary_factor dims of each head rotate (rotate_half within them), at frequencies computed
    over those dims as if they were the whole head; the rest pass through."""
    factor = float(rope.get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * factor)
    if not 0 < factor <= 1 or rotary_dim % 2:
        raise UnsupportedModel(
            f"partial_rotary_factor={factor} does not give an even rotary width of the {head_dim}-wide heads",
            param="model",
        )
    return rotary_dim, {k: v for k, v in rope.items() if k != "partial_rotary_factor"}


class RotaryEmbedding:
    """Precomputed cos/sin tables (rotary_dim / 2 wide) indexed by absolute positions.

    partial: the family's reference rotates only the first partial_rotary_factor of each head (partial_rotary());
    rotary_dim is that width, and apply_rotary_ and FlashInfer's kernel rotate those dims alone (the tables' width
    says how many). Otherwise a factor other than 1 is refused: those references rotate the whole head.

    fused (CUDA): instead of the model-dtype cos/sin, one float32 cos|sin table (`cos_sin_cache`) for
    FlashInfer's in-place RoPE kernel, built from the float32 angles so no bf16 rounding enters it.

    Dynamic NTK: positions inside max_position_embeddings use the plain frequencies; a position p past it
    uses the base transformers derives for a sequence of p + 1 tokens, which is what a cached decode in
    transformers applies to that token.
    """

    def __init__(
        self,
        *,
        head_dim: int,
        rope: dict,
        max_position_embeddings: int,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
        fused: bool = False,
        partial: bool = False,
    ) -> None:
        self.rotary_dim = head_dim
        if partial:
            self.rotary_dim, rope = partial_rotary(head_dim, rope)
            head_dim = self.rotary_dim
        inv_freq, scale = rope_inv_freq(head_dim, rope, max_position_embeddings, max_positions)
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
        """cos, sin of shape [T, 1, rotary_dim / 2] for the step's positions (once per forward)."""
        assert self.cos is not None and self.sin is not None, "the unfused tables (fused rotary has cos_sin_cache)"
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(0, positions).unsqueeze(1)


def _dynamic_freqs(head_dim: int, rope: dict, max_pos: int, max_positions: int) -> torch.Tensor:
    factor, theta = float(rope["factor"]), float(rope.get("rope_theta", 10000.0))
    pos = torch.arange(max_pos, max_positions, dtype=torch.float32)
    base = theta * ((factor * (pos + 1) / max_pos) - (factor - 1)) ** (head_dim / (head_dim - 2))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base[:, None] ** exponents[None, :])
    return pos[:, None] * inv_freq


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [T, heads, head_dim] in place (neox / rotate_half layout) and returns it: its first 2 * cos's width
    dims (the whole head, or a partial rotary's leading part; the rest untouched)."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    x1_orig = x1.clone()
    x1.mul_(cos).addcmul_(x2, sin, value=-1)
    x2.mul_(cos).addcmul_(x1_orig, sin)
    return x


def pairs_as_halves(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] with its rotary pairs (x0, x1), (x2, x3), ... (GPT-J's interleaved layout) laid out as
    halves, a copy: rotate_half's rotation of it is the interleaved rotation, permuted. Applied alike to q and k, the
    permutation leaves every score as it was."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pieces: int = 1) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, rotate_half taken within each of `pieces` equal parts of the last dimension
    (a 2-D rotary turns one part by each axis), out of place, in cos's dtype where it is wider than x's; cos and sin
    span the whole last dimension, sin with rotate_half's sign in it (full_width_rotary builds them).

    NOTE: the vision towers' rotary, where apply_rotary_'s half-width broadcasts (16 or 32 values per head) run a
    few times slower than full-width ones on the CPU."""
    d = x.shape[-1]
    swapped = x.unflatten(-1, (pieces, 2, d // (2 * pieces))).flip(-2).flatten(-3)
    return torch.mul(x, cos).addcmul_(swapped, sin)


def full_width_rotary(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """angles [..., pieces, d / (2 * pieces)] -> cos, sin [..., d] for rotate_pairs: each part's angles twice, the
    sines of the first copy negated."""
    cos, sin = angles.cos(), angles.sin()
    return torch.stack([cos, cos], -2).flatten(-3), torch.stack([-sin, sin], -2).flatten(-3)
