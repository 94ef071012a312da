"""Fused kernels from FlashInfer (RMSNorm, RoPE, SiLU-and-mul) with torch fallbacks.

Each function takes FlashInfer's kernel when its tensors are float16/bfloat16 on CUDA and flashinfer imports; otherwise
the torch code here runs, which follows transformers' math and is what the GPU tests compare the kernels against.
flashinfer is imported lazily.
"""

from __future__ import annotations

import functools
import importlib

import torch
import torch.nn.functional as F

HALF_DTYPES = (torch.float16, torch.bfloat16)
# The prefill kernel family the attention backend plans with and engine.cuda.precompile builds.
# NOTE: FA2 for prefill on every GPU: on Hopper "auto" would pick FA3, a second large JIT build per head
# dim, while prompts of a few hundred tokens spend little of a step in attention. Pass "auto" to get FA3.
DEFAULT_PREFILL_BACKEND = "fa2"


# Head sizes the attention backend sends to FlashInfer 0.5.3's paged kernels: the ones FlashInfer's own AOT build
# and tests cover. Its FA2 prefill tiles are all invalid at 512 (KernelTraits::IsInvalid in attention/prefill.cuh:
# 8 * head_dim / 16 MMA columns must stay under 256), so Gemma 4's global layers cannot run there; a KV group of a
# size outside this set runs on the torch backend, said at start-up (engine.attention.resolve_group_backends).
FLASHINFER_HEAD_DIMS = (64, 128, 256)


def flashinfer_head_dim_error(head_dim: int) -> str | None:
    """None when FlashInfer's paged attention serves `head_dim`, else why not (one line)."""
    if head_dim in FLASHINFER_HEAD_DIMS:
        return None
    sizes = ", ".join(map(str, FLASHINFER_HEAD_DIMS))
    return f"FlashInfer 0.5.3's paged attention has no kernel for head size {head_dim} (it serves {sizes})"


# The multi-head latent attention (MLA) kernel family and the latent shapes (kv_lora_rank, rope dim) the attention
# backend sends to FlashInfer 0.5.3's BatchMLAPagedAttentionWrapper: FA2's (the one FlashInfer's MLA tests run, with
# one module name on every GPU; "auto" would take FA3 on Hopper, a second build) at DeepSeek's 512 + 64, the only
# shape its tests, and every released MLA model (DeepSeek V2 / V3 / R1, Kimi K2, GLM-4.7-Flash), use. Its tiles are
# cut for it (HEAD_DIM_CKV / 128 and HEAD_DIM_KPE / 64 fragment loops in attention/mla.cuh), so another shape runs on
# the torch reference, said at start-up. The kernel wants at least 92,672 bytes of shared memory per SM: sm_80 on.
MLA_BACKEND = "fa2"
FLASHINFER_MLA_SHAPES = ((512, 64),)
MLA_MIN_CAPABILITY = (8, 0)


def flashinfer_mla_error(kv_lora_rank: int, rope_dim: int, capability: tuple[int, int] | None = None) -> str | None:
    """None when FlashInfer's MLA paged attention serves this latent (on a GPU of `capability` when given), else why
    not (one line)."""
    if (kv_lora_rank, rope_dim) not in FLASHINFER_MLA_SHAPES:
        shapes = ", ".join(f"{rank} + {rope}" for rank, rope in FLASHINFER_MLA_SHAPES)
        return (
            f"FlashInfer 0.5.3's multi-head latent attention (MLA) has no kernel for a latent of {kv_lora_rank} + "
            f"rope {rope_dim} (it serves {shapes})"
        )
    if capability is not None and tuple(capability) < MLA_MIN_CAPABILITY:
        return (
            f"FlashInfer 0.5.3's multi-head latent attention (MLA) needs sm_{''.join(map(str, MLA_MIN_CAPABILITY))} "
            f"or newer (this GPU is sm_{''.join(map(str, capability))})"
        )
    return None


def sink_module_args(
    *, backend: str, q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, sliding_window: bool
) -> tuple[list, dict]:
    """(jit_args, jit_kwargs) of FlashInfer's attention-sink prefill variant, for its prefill wrapper's jit_args.

    NOTE: BatchAttentionWithAttentionSinkWrapper names its JIT module by q dtype, window and backend only, so two
    head sizes or KV dtypes in one process load one library; the name here is FlashInfer's own AOT name
    (gen_batch_prefill_attention_sink_module), which holds every parameter, so engine.cuda.precompile builds the same
    file.
    """
    from flashinfer.jit.attention.modules import get_batch_prefill_attention_sink_uri
    from flashinfer.jit.attention.variants import attention_sink_decl

    uri = get_batch_prefill_attention_sink_uri(
        backend=backend,
        dtype_q=q_dtype,
        dtype_kv=kv_dtype,
        dtype_o=q_dtype,
        dtype_idx=torch.int32,
        head_dim_qk=head_dim,
        head_dim_vo=head_dim,
        pos_encoding_mode=0,
        use_sliding_window=sliding_window,
    )
    jit_args = [
        uri,
        q_dtype,
        kv_dtype,
        q_dtype,
        torch.int32,
        head_dim,
        head_dim,
        ["sink"],
        ["float"],
        ["sm_scale"],
        ["double"],
        "AttentionSink",
        attention_sink_decl[backend],
    ]
    jit_kwargs = {
        "pos_encoding_mode": 0,
        "use_sliding_window": sliding_window,
        "use_logits_soft_cap": False,
        "use_fp16_qk_reduction": False,
        "fp8_enabled": False,
    }
    return jit_args, jit_kwargs


@functools.cache
def import_error(module: str) -> Exception | None:
    """None when `module` imports, else the error it raised: a broken CUDA install, or a Triton without a GPU
    driver, raises more than ImportError."""
    try:
        importlib.import_module(module)
    except Exception as exc:
        return exc
    return None


def flashinfer_import_error() -> Exception | None:
    """The one probe of FlashInfer: the attention backend is chosen from it (engine.attention)."""
    return import_error("flashinfer")


def flashinfer_available() -> bool:
    """Whether flashinfer imports."""
    return flashinfer_import_error() is None


def use_fused_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on `device` in `dtype` should run FlashInfer's norm / RoPE / activation kernels."""
    return device.type == "cuda" and dtype in HALF_DTYPES and flashinfer_available()


def _fused(t: torch.Tensor) -> bool:
    return t.is_cuda and t.dtype in HALF_DTYPES and flashinfer_available()


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [tokens, dim] or [tokens, heads, dim]; weight [dim] in x's dtype."""
    if _fused(x) and x.dim() in (2, 3) and x.stride(-1) == 1:
        import flashinfer

        return flashinfer.norm.rmsnorm(input=x, weight=weight, eps=eps)
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # transformers: normalise in float32, cast back, then scale in the model dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual += x, then x = rmsnorm(residual). Returns (x, residual), both [tokens, dim]."""
    if _fused(x) and x.dim() == 2 and x.stride(-1) == 1 and residual.stride(-1) == 1:
        import flashinfer

        flashinfer.norm.fused_add_rmsnorm(input=x, residual=residual, weight=weight, eps=eps)
        return x, residual
    residual.add_(x)
    x.copy_(rmsnorm(residual, weight, eps))
    return x, residual


def cos_sin_cache(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """FlashInfer's RoPE table from cos, sin [positions, rotary_dim / 2]: [positions, rotary_dim] float32,
    cos in the first half. Build it from float32 cos/sin (not ones already cast to bf16)."""
    return torch.cat([cos, sin], dim=-1).float().contiguous()


def apply_rope_with_cos_sin_cache_inplace(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    head_dim: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """Rotates q [tokens, q_heads, head_dim] and k [tokens, kv_heads, head_dim] in place (views welcome).

    cos_sin_cache: [max_positions, rotary_dim] float32 from cos_sin_cache(); positions: [tokens] int.
    """
    if _fused(q) and q.stride(-1) == 1 and k.stride(-1) == 1:
        import flashinfer

        flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(
            positions=positions, query=q, key=k, head_size=head_dim, cos_sin_cache=cos_sin_cache, is_neox=is_neox
        )
        return
    half = cos_sin_cache.shape[-1] // 2
    table = cos_sin_cache[positions]
    # Like transformers: the table is cast to the activations' dtype before the rotation.
    cos, sin = table[:, None, :half].to(q.dtype), table[:, None, half:].to(q.dtype)
    for x in (q.view(q.shape[0], -1, head_dim), k.view(k.shape[0], -1, head_dim)):
        rot = x[..., : 2 * half]
        x1, x2 = (rot[..., :half], rot[..., half:]) if is_neox else (rot[..., 0::2], rot[..., 1::2])
        x1_orig = x1.clone()
        x1.mul_(cos).addcmul_(x2, sin, value=-1)
        x2.mul_(cos).addcmul_(x1_orig, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused gate|up projection [..., 2 * n] -> silu(gate) * up [..., n]."""
    # NOTE: contiguous, not just a unit last stride: the kernel addresses row i at i * 2n and ignores row strides.
    if _fused(x) and x.is_contiguous() and (x.shape[-1] * x.element_size()) % 16 == 0:
        import flashinfer

        return flashinfer.activation.silu_and_mul(input=x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def warmup(
    hidden_size: int,
    intermediate_size: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Calls each kernel once on a few rows, so FlashInfer's JIT builds happen at start-up."""
    x = torch.randn(4, hidden_size, dtype=dtype, device=device)
    w = torch.ones(hidden_size, dtype=dtype, device=device)
    rmsnorm(x, w, 1e-6)
    fused_add_rmsnorm(x.clone(), x.clone(), w, 1e-6)
    silu_and_mul(torch.randn(4, 2 * intermediate_size, dtype=dtype, device=device))
    half = torch.zeros(8, head_dim // 2, device=device)
    qk = torch.randn(4, 2, head_dim, dtype=dtype, device=device)
    apply_rope_with_cos_sin_cache_inplace(
        torch.arange(4, device=device), qk[:, :1], qk[:, 1:], head_dim, cos_sin_cache(half.cos(), half.sin())
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
