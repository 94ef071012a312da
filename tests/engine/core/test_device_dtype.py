"""DTYPE=auto: bfloat16 where the hardware computes it natively, float32 where it would be emulated."""

from __future__ import annotations

import pytest
import torch

from engine.core.device import resolve_dtype

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("amx", "avx512_bf16", "expected"),
    [
        (True, True, (torch.bfloat16, "auto: the CPU has AMX")),
        (False, True, (torch.bfloat16, "auto: the CPU has AVX512-BF16")),
        (False, False, (torch.float32, "auto: the CPU has no bfloat16 instructions")),
    ],
)
def test_auto_follows_the_cpus_bfloat16_instructions(monkeypatch, amx, avx512_bf16, expected):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    assert resolve_dtype("auto", CPU) == expected


def test_auto_is_bfloat16_for_int4_and_cuda_and_a_named_dtype_is_kept(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert resolve_dtype("auto", CPU, "int4") == (torch.bfloat16, "auto: int4 weights")
    assert resolve_dtype("auto", torch.device("cuda")) == (torch.bfloat16, "auto: CUDA")
    assert resolve_dtype("float32", CPU) == (torch.float32, "DTYPE")


def test_the_probes_answer_on_this_torch():
    # The private probes auto relies on exist in the pinned torch and in the image's (make test runs both).
    assert isinstance(torch.cpu._is_amx_tile_supported(), bool)
    assert isinstance(torch.cpu._is_avx512_bf16_supported(), bool)
