"""Attention backends, chosen by name from a small registry (FlashInfer is imported only when asked for).

`resolve_backend` is the one place the backend is chosen: on CUDA in fp16/bf16, FlashInfer, and a FlashInfer
that does not import stops start-up with its cause rather than leaving the engine on the much slower torch
reference; the torch backend runs there only when asked for.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend
from engine.attention.torch_ref import TorchRefBackend
from engine.cuda import kernels
from engine.errors import StartupError


def _flashinfer(device: torch.device, **kw: object) -> AttentionBackend:
    from engine.attention.flashinfer import FlashInferBackend

    return FlashInferBackend(device, **kw)


BACKENDS = {"torch": TorchRefBackend, "flashinfer": _flashinfer}


def resolve_backend(requested: str, device: torch.device | str, dtype: torch.dtype) -> tuple[str, str]:
    """(backend name, why) for `requested` (auto | torch | flashinfer); raises StartupError when it cannot run.

    auto: flashinfer on CUDA in fp16/bf16; torch on a CPU, and in float32 (FlashInfer has no float32 kernels).
    """
    device = torch.device(device)
    if requested not in ("auto", *BACKENDS):
        raise StartupError(f"unknown attention backend {requested!r} (auto, {', '.join(BACKENDS)})",
                           param="attention_backend")
    if requested == "torch":
        return "torch", "asked for"
    if device.type != "cuda":
        if requested == "flashinfer":
            raise StartupError(f"the flashinfer attention backend needs CUDA, and the device is {device}",
                               param="attention_backend")
        return "torch", f"auto: {device.type}"
    if dtype not in kernels.HALF_DTYPES:
        if requested == "flashinfer":
            raise StartupError(f"FlashInfer has no {str(dtype).removeprefix('torch.')} kernels: use dtype "
                               "bfloat16 or float16, or the torch attention backend", param="attention_backend")
        return "torch", f"auto: FlashInfer has no {str(dtype).removeprefix('torch.')} kernels"
    error = kernels.flashinfer_import_error()
    if error is not None:
        raise StartupError(f"FlashInfer does not import on this CUDA machine ({type(error).__name__}: {error}); "
                           "install the pinned flashinfer-python (requirements-cuda.txt), or set "
                           "attention_backend=torch (the torch reference, several times slower)",
                           param="attention_backend")
    return "flashinfer", "auto: CUDA" if requested == "auto" else "asked for"


def create_backend(name: str, device: torch.device | str, **kw: object) -> AttentionBackend:
    """The backend `name` (torch | flashinfer, as resolve_backend gives it) on `device`."""
    if name not in BACKENDS:
        raise StartupError(f"unknown attention backend {name!r} ({', '.join(BACKENDS)})", param="attention_backend")
    return BACKENDS[name](torch.device(device), **kw)
