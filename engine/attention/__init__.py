"""Attention backends, chosen by name from a small registry (FlashInfer is imported only when asked for).

`resolve_backend` is the one place the backend is chosen: on CUDA in fp16/bf16, FlashInfer, and a FlashInfer
that does not import stops start-up with its cause rather than leaving the engine on the much slower torch
reference; the torch backend runs there only when asked for. `group_backends` then gives each KV layer group the
chosen backend, or the torch reference where FlashInfer has no kernel for the group's head size (Gemma 4's global
layers), with the reason for the start-up log. A multi-head latent attention (MLA) group gets FlashInfer's MLA paged
attention (engine/attention/flashinfer_mla.py) where FlashInfer was chosen and serves its latent shape and the GPU,
else the torch reference's latent attention (engine/attention/mla.py), said the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from engine.attention.base import AttentionBackend
from engine.attention.kv_quant import FP8
from engine.attention.mla import TorchMLABackend
from engine.attention.torch_ref import TorchRefBackend
from engine.cuda import kernels
from engine.errors import StartupError

log = logging.getLogger(__name__)


def _flashinfer(device: torch.device, **kw: Any) -> AttentionBackend:
    from engine.attention.flashinfer import FlashInferBackend

    return FlashInferBackend(device=device, **kw)


def _flashinfer_mla(device: torch.device, **kw: Any) -> AttentionBackend:
    from engine.attention.flashinfer_mla import FlashInferMLABackend

    return FlashInferMLABackend(device=device, **kw)


BACKENDS: dict[str, Callable[..., AttentionBackend]] = {"torch": TorchRefBackend, "flashinfer": _flashinfer}
MLA_BACKENDS: dict[str, Callable[..., AttentionBackend]] = {"torch": TorchMLABackend, "flashinfer": _flashinfer_mla}


def resolve_backend(requested: str, device: torch.device | str, dtype: torch.dtype) -> tuple[str, str]:
    """(backend name, why) for `requested` (auto | torch | flashinfer); raises StartupError when it cannot run.

    auto: flashinfer on CUDA in fp16/bf16; torch on a CPU, and in float32 (FlashInfer has no float32 kernels).
    """
    device = torch.device(device)
    if requested not in ("auto", *BACKENDS):
        raise StartupError(
            f"unknown attention backend {requested!r} (auto, {', '.join(BACKENDS)})", param="attention_backend"
        )
    if requested == "torch":
        return "torch", "asked for"
    if device.type != "cuda":
        if requested == "flashinfer":
            raise StartupError(
                f"the flashinfer attention backend needs CUDA, and the device is {device}", param="attention_backend"
            )
        return "torch", f"auto: {device.type}"
    if dtype not in kernels.HALF_DTYPES:
        if requested == "flashinfer":
            raise StartupError(
                f"FlashInfer has no {str(dtype).removeprefix('torch.')} kernels: use dtype "
                "bfloat16 or float16, or the torch attention backend",
                param="attention_backend",
            )
        return "torch", f"auto: FlashInfer has no {str(dtype).removeprefix('torch.')} kernels"
    error = kernels.flashinfer_import_error()
    if error is not None:
        raise StartupError(
            f"FlashInfer does not import on this CUDA machine ({type(error).__name__}: {error}); "
            "install the pinned flashinfer-python (requirements-cuda.txt), or set "
            "attention_backend=torch (the torch reference, several times slower)",
            param="attention_backend",
        )
    return "flashinfer", "auto: CUDA" if requested == "auto" else "asked for"


def group_backends(
    name: str,
    head_dims: list[int],
    *,
    requested: str = "auto",
    latent: list[tuple[int, int] | None] | None = None,
    capability: tuple[int, int] | None = None,
) -> list[tuple[str, str | None]]:
    """(backend name, why it is not `name` or None) for each KV layer group of these head sizes, where `name` is
    resolve_backend's choice (flashinfer: CUDA in fp16 or bf16). latent: each group's MLA row as (kv_lora_rank,
    rope_dim), None for K and V pages; capability: the GPU's (None: not checked). A group FlashInfer cannot serve runs
    on the torch reference, which reads the same pages, unless flashinfer was asked for by name: then start-up stops,
    saying which group and why."""
    if name != "flashinfer":
        return [(name, None) for _ in head_dims]
    choices: list[tuple[str, str | None]] = []
    for index, head_dim in enumerate(head_dims):
        row = latent[index] if latent else None
        error = (
            kernels.flashinfer_head_dim_error(head_dim)
            if row is None
            else kernels.flashinfer_mla_error(*row, capability=capability)
        )
        if error is not None and requested == "flashinfer":
            raise StartupError(
                f"KV layer group {index}: {error}; use attention_backend auto, which runs that group "
                "on the torch backend",
                param="attention_backend",
            )
        choices.append(("flashinfer", None) if error is None else ("torch", error))
    return choices


def create_backend(name: str, device: torch.device | str, **kw: Any) -> AttentionBackend:
    """The backend `name` (torch | flashinfer, as resolve_backend gives it) on `device`."""
    if name not in BACKENDS:
        raise StartupError(f"unknown attention backend {name!r} ({', '.join(BACKENDS)})", param="attention_backend")
    return BACKENDS[name](torch.device(device), **kw)


def create_group_backends(
    name: str,
    groups: list[Any],
    device: torch.device | str,
    *,
    spec: Any,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    requested: str = "auto",
) -> list[AttentionBackend]:
    """One backend per KV layer group (a KVGroupSpec of the ModelSpec `spec`): `name`, or the torch reference for a
    group FlashInfer cannot serve (group_backends), said once here; an MLA group's is MLA_BACKENDS' of that name."""
    from engine.cuda.setup import backend_kwargs

    latent = [None if g.latent is None else (g.latent.kv_lora_rank, g.latent.rope_dim) for g in groups]
    device = torch.device(device)
    mla_on_gpu = any(latent) and name == "flashinfer" and device.type == "cuda"
    capability = torch.cuda.get_device_capability(device) if mla_on_gpu else None
    choices = group_backends(
        name, [group.head_dim for group in groups], requested=requested, latent=latent, capability=capability
    )
    refuse_fp8_latent_pages(groups, [chosen for chosen, _ in choices], kv_dtype)
    backends: list[AttentionBackend] = []
    for group, (chosen, why) in zip(groups, choices, strict=True):
        if group.latent is not None:
            log.log(
                logging.WARNING if why else logging.INFO,
                "KV layer group %s (multi-head latent attention) runs on the %s attention backend%s",
                group.label,
                chosen,
                f": {why}" if why else "",
            )
            backends.append(
                MLA_BACKENDS[chosen](
                    device,
                    **group.attention_extras(),
                    num_heads=spec.num_q_heads,
                    kv_lora_rank=group.latent.kv_lora_rank,
                    rope_dim=group.latent.rope_dim,
                    dtype=dtype,
                )
            )
            continue
        if why is not None:
            log.warning(
                "KV layer group %s (head size %d) runs on the torch attention backend: %s",
                group.label,
                group.head_dim,
                why,
            )
        backends.append(
            create_backend(
                chosen, device, **group.attention_extras(), kv_dtype=kv_dtype, **backend_kwargs(spec, dtype, group)
            )
        )
    return backends


def refuse_fp8_latent_pages(groups: list[Any], chosen: list[str], kv_dtype: torch.dtype) -> None:
    """StartupError where FP8 pages would meet FlashInfer's MLA (its pages here are bf16 / fp16); the torch
    reference runs MLA over FP8 pages."""
    if kv_dtype == FP8 and any(g.latent is not None and c == "flashinfer" for g, c in zip(groups, chosen, strict=True)):
        raise StartupError(
            "kv_cache_dtype fp8 with multi-head latent attention (MLA) runs on the torch attention backend only "
            "(FlashInfer's MLA pages here are bf16 / fp16): use auto, or ATTENTION_BACKEND=torch",
            param="kv_cache_dtype",
        )
