"""An FP8 (e4m3) KV cache: pages hold K / scale and V / scale, one scale per layer for K and one for V.

The scale is the checkpoint's (k_scale / v_scale tensors, as compressed-tensors' kv_cache_scheme writes them)
or 1.0, as vLLM does: K and V of trained models sit well inside e4m3's +-448, so 1.0 loses only precision
(3 mantissa bits), and values past 448 saturate rather than turn into NaN.
"""

from __future__ import annotations

import torch

from engine.errors import StartupError

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
# KV_CACHE_DTYPE -> the pages' dtype (None: the model's own)
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8": FP8, "fp8_e4m3": FP8}


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the KV pages for KV_CACHE_DTYPE `name`; StartupError on an unknown name."""
    if name not in KV_CACHE_DTYPES:
        raise StartupError(f"unknown KV cache dtype {name!r} ({', '.join(KV_CACHE_DTYPES)})", param="kv_cache_dtype")
    return KV_CACHE_DTYPES[name] or model_dtype


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8


def write_slots(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, scale: float = 1.0) -> None:
    """Scatters x [tokens, kv_heads, head_dim] into the flat slots of `cache` (one layer's K or V pages),
    quantised (x / scale, saturated at +-448) when the pages are FP8."""
    _, _, h, d = cache.shape
    # view() (not reshape) so that a non-contiguous pool raises instead of writing into a copy.
    flat = cache.view(-1, h, d)
    if not is_fp8(cache):
        flat.index_copy_(0, slots, x)
        return
    q = (x.float() / scale if scale != 1.0 else x.float()).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    # NOTE: torch has no index_copy_ for float8 on CPU; the same bytes through a uint8 view.
    flat.view(torch.uint8).index_copy_(0, slots, q.view(torch.uint8))


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Gathered K or V rows in `dtype`: FP8 rows times their scale; others as they are."""
    if x.dtype == dtype:
        return x
    x = x.to(dtype)
    return x.mul_(scale) if scale != 1.0 else x


def write_kv_slots(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatters k, v [tokens, kv_heads, head_dim] into the flat slots (page * page_size + offset) of the pool."""
    write_slots(k, k_cache, slots, k_scale)
    write_slots(v, v_cache, slots, v_scale)


def fp8_scales(k_cache: torch.Tensor, k_scale: float, v_scale: float) -> tuple[float | None, float | None]:
    """FlashInfer run()'s k_scale and v_scale: the layer's for FP8 pages, None (its default) for pages in the
    query's dtype."""
    return (k_scale, v_scale) if is_fp8(k_cache) else (None, None)
