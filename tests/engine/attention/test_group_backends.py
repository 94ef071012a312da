"""Each KV layer group gets a backend that serves its head size: FlashInfer 0.5.3 has no paged kernel for Gemma 4's
512-wide global heads, so that group runs on the torch reference (said at start-up) while the 256-wide sliding
groups stay on FlashInfer; asked for by name, FlashInfer refuses at start-up instead of failing in warm-up."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from engine.attention import create_group_backends, group_backends
from engine.attention.torch_ref import TorchRefBackend
from engine.cuda import kernels
from engine.errors import StartupError
from engine.model.kv_spec import KVGroupSpec

# Gemma 4 31B's shape: sliding layers of 16 KV heads of 256, global layers of 4 KV heads of 512.
SLIDING = KVGroupSpec(layers=(0, 1, 2, 3, 4), num_kv_heads=16, head_dim=256, window=1024)
GLOBAL = KVGroupSpec(layers=(5,), num_kv_heads=4, head_dim=512)


def test_head_sizes_flashinfer_serves() -> None:
    assert [kernels.flashinfer_head_dim_error(d) for d in (64, 128, 256)] == [None, None, None]
    for head_dim in (32, 80, 512):
        assert f"no kernel for head size {head_dim}" in kernels.flashinfer_head_dim_error(head_dim)


def test_a_group_flashinfer_cannot_serve_runs_on_torch_with_the_reason() -> None:
    choices = group_backends("flashinfer", [SLIDING.head_dim, GLOBAL.head_dim])
    assert choices[0] == ("flashinfer", None)
    assert choices[1][0] == "torch" and "head size 512" in choices[1][1]
    # The torch reference stays what was chosen, whatever the head size.
    assert group_backends("torch", [256, 512]) == [("torch", None), ("torch", None)]


def test_flashinfer_asked_for_by_name_refuses_a_head_size_it_cannot_serve() -> None:
    with pytest.raises(StartupError, match="KV layer group 1: .*head size 512") as err:
        group_backends("flashinfer", [256, 512], requested="flashinfer")
    assert err.value.param == "attention_backend"


def test_create_group_backends_builds_the_fallback_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    spec = SimpleNamespace(num_q_heads=32)
    with caplog.at_level(logging.WARNING, logger="engine.attention"):
        (backend,) = create_group_backends(
            "flashinfer", [GLOBAL], "cpu", spec=spec, dtype=torch.bfloat16, kv_dtype=torch.bfloat16
        )
    assert isinstance(backend, TorchRefBackend)
    assert backend.window is None
    assert "head size 512) runs on the torch attention backend" in caplog.text
