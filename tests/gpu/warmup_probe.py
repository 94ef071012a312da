"""`python -m tests.gpu.warmup_probe DEVICE`: engine.cuda.kernels.warmup in a fresh process, and what it made
FlashInfer build and load; prints one JSON line.

A fresh process, because FlashInfer keeps each loaded JIT module for the life of its process (functools.cache on
its getters): inside the test session the kernel tests before it would already have loaded them.
"""

from __future__ import annotations

import json
import sys

import flashinfer.activation
import flashinfer.norm
import flashinfer.rope
import torch
from flashinfer.jit.core import jit_spec_registry

from engine.cuda import kernels

# FlashInfer 0.5.3's cached getter of each JIT module the engine's fused kernels call, by the module's spec name
# (flashinfer/norm.py, activation.py, rope.py): rmsnorm and fused_add_rmsnorm load "norm", silu_and_mul loads
# "silu_and_mul", apply_rope_with_cos_sin_cache_inplace loads "rope".
LOADERS = {
    "norm": flashinfer.norm.get_norm_module,
    "silu_and_mul": flashinfer.activation.get_act_and_mul_module,
    "rope": flashinfer.rope.get_rope_module,
}


def loaded() -> dict[str, int]:
    """How many modules each getter holds in this process."""
    return {name: getter.cache_info().currsize for name, getter in LOADERS.items()}


def main(device: str) -> None:
    before = loaded()
    kernels.warmup(896, 4864, 64, torch.bfloat16, torch.device(device))
    # A spec registers when FlashInfer first asks for its module; it is compiled when its .so is in the JIT cache
    # (FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/.../cached_ops/<name>/) or shipped ahead of time.
    built = {name: spec.is_compiled for name, spec in jit_spec_registry.get_all_specs().items()}
    print(json.dumps({"loaded_before": before, "loaded_after": loaded(), "built": built}))


if __name__ == "__main__":
    main(sys.argv[1])
