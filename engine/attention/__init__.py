"""Attention backends, chosen by name from a small registry (FlashInfer is imported only when asked for)."""

from __future__ import annotations

import importlib.util

import torch

from engine.attention.base import AttentionBackend
from engine.attention.torch_ref import TorchRefBackend
from engine.errors import InvalidRequest


def _flashinfer(device: torch.device, **kw: object) -> AttentionBackend:
    from engine.attention.flashinfer import FlashInferBackend

    return FlashInferBackend(device, **kw)


BACKENDS = {"torch": TorchRefBackend, "flashinfer": _flashinfer}


def create_backend(name: str, device: torch.device | str, **kw: object) -> AttentionBackend:
    """name: torch | flashinfer | auto (flashinfer on CUDA when it imports, else torch)."""
    device = torch.device(device)
    if name == "auto":
        cuda = device.type == "cuda" and importlib.util.find_spec("flashinfer") is not None
        name = "flashinfer" if cuda and _imports("flashinfer") else "torch"
    if name not in BACKENDS:
        known = ", ".join(["auto", *BACKENDS])
        raise InvalidRequest(f"unknown attention backend {name!r} ({known})", param="attention_backend")
    return BACKENDS[name](device, **kw)


def _imports(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # a broken CUDA build raises more than ImportError
        return False
    return True
