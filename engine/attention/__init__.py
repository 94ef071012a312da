"""Attention backends, chosen by name from a small registry (FlashInfer is imported only when asked for).

`resolve_backend` is the one place the backend is chosen: on CUDA in fp16/bf16, FlashInfer, and a FlashInfer
that does not import stops start-up with its cause rather than leaving the engine on the much slower torch
reference; the torch backend runs there only when asked for. `group_backends` then gives each KV layer group the
chosen backend, or the torch reference where FlashInfer has no kernel for the group's head size (Gemma 4's global
layers), with the reason for the start-up log. A multi-head latent attention (MLA) group runs the torch reference's
latent attention (engine/attention/mla.py) on every device: FlashInfer's MLA wrapper is not wired in yet.
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


BACKENDS: dict[str, Callable[..., AttentionBackend]] = {"torch": TorchRefBackend, "flashinfer": _flashinfer}
MLA_TORCH_ONLY = "FlashInfer's multi-head latent attention (MLA) is not wired in yet; the torch reference runs it"


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
    name: str, head_dims: list[int], *, requested: str = "auto", latent: list[bool] | None = None
) -> list[tuple[str, str | None]]:
    """(backend name, why it is not `name` or None) for each KV layer group of these head sizes (`latent`: which
    are MLA groups), where `name` is resolve_backend's choice. A group FlashInfer cannot serve runs on the torch
    reference, which reads the same pages, unless flashinfer was asked for by name: then start-up stops, saying
    which group and why."""
    if name != "flashinfer":
        return [(name, None) for _ in head_dims]
    choices: list[tuple[str, str | None]] = []
    for index, head_dim in enumerate(head_dims):
        error = MLA_TORCH_ONLY if latent and latent[index] else kernels.flashinfer_head_dim_error(head_dim)
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
    group FlashInfer cannot serve (group_backends), said once here."""
    from engine.cuda.setup import backend_kwargs

    latent = [group.latent is not None for group in groups]
    if any(latent) and kv_dtype == FP8:
        raise StartupError(
            "kv_cache_dtype fp8 is not supported with multi-head latent attention (MLA) yet: use auto",
            param="kv_cache_dtype",
        )
    choices = group_backends(name, [group.head_dim for group in groups], requested=requested, latent=latent)
    backends: list[AttentionBackend] = []
    for group, (chosen, why) in zip(groups, choices, strict=True):
        if group.latent is not None:
            log.log(
                logging.WARNING if why else logging.INFO,
                "KV layer group %s (multi-head latent attention) runs on the torch attention backend%s",
                group.label,
                f": {why}" if why else "",
            )
            backends.append(TorchMLABackend(torch.device(device), **group.attention_extras()))
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
