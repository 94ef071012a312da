"""Each KV layer group gets a backend that serves its head size: FlashInfer 0.5.3 has no paged kernel for Gemma 4's
512-wide global heads, so that group runs on the torch reference (said at start-up) while the 256-wide sliding
groups stay on FlashInfer; asked for by name, FlashInfer refuses at start-up instead of failing in warm-up. A multi-head
latent attention (MLA) group gets FlashInfer's MLA kernel for DeepSeek's latent (512 + 64) on sm_80 and newer, the
torch reference for any other, by the same rules."""

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


# Multi-head latent attention: DeepSeek's latent (512 + 64) is FlashInfer's MLA kernel's; a tiny test config's is not.
DEEPSEEK_LATENT, TINY_LATENT = (512, 64), (32, 16)


def test_an_mla_group_of_deepseeks_latent_gets_flashinfer_and_another_latent_the_torch_reference() -> None:
    from engine.cuda.kernels import flashinfer_mla_error

    assert flashinfer_mla_error(*DEEPSEEK_LATENT) is None
    assert flashinfer_mla_error(*DEEPSEEK_LATENT, capability=(9, 0)) is None
    choices = group_backends("flashinfer", [576, 48], latent=[DEEPSEEK_LATENT, TINY_LATENT], capability=(9, 0))
    assert choices[0] == ("flashinfer", None)
    assert choices[1][0] == "torch" and "latent of 32 + rope 16" in choices[1][1] and "512 + 64" in choices[1][1]
    # A GPU under sm_80 lacks the shared memory the kernel needs; a K/V group beside it is judged by its head size.
    (mla, plain) = group_backends("flashinfer", [576, 128], latent=[DEEPSEEK_LATENT, None], capability=(7, 5))
    assert mla[0] == "torch" and "sm_80" in mla[1] and "sm_75" in mla[1]
    assert plain == ("flashinfer", None)
    # torch chosen (a CPU, float32, or asked for): every MLA group stays on the torch reference, with no reason.
    assert group_backends("torch", [576, 48], latent=[DEEPSEEK_LATENT, TINY_LATENT]) == [("torch", None)] * 2


def test_flashinfer_asked_for_by_name_refuses_an_mla_latent_it_cannot_serve_naming_the_group() -> None:
    group_backends("flashinfer", [576], requested="flashinfer", latent=[DEEPSEEK_LATENT], capability=(9, 0))
    with pytest.raises(StartupError, match="KV layer group 1: .*multi-head latent attention.*32 \\+ rope 16") as err:
        group_backends("flashinfer", [128, 48], requested="flashinfer", latent=[None, TINY_LATENT])
    assert err.value.param == "attention_backend"
    assert "\n" not in str(err.value)
    with pytest.raises(StartupError, match="KV layer group 0: .*sm_80"):
        group_backends("flashinfer", [576], requested="flashinfer", latent=[DEEPSEEK_LATENT], capability=(7, 5))


def test_create_group_backends_puts_an_mla_group_flashinfer_cannot_serve_on_the_torch_reference_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from engine.attention.mla import TorchMLABackend
    from engine.model.kv_spec import LatentKV, latent_group

    group = latent_group(2, LatentKV(*TINY_LATENT), scale=0.25)
    with caplog.at_level(logging.INFO, logger="engine.attention"):
        (backend,) = create_group_backends(
            "flashinfer",
            [group],
            "cpu",
            spec=SimpleNamespace(num_q_heads=4),
            dtype=torch.bfloat16,
            kv_dtype=torch.bfloat16,
        )
    assert isinstance(backend, TorchMLABackend) and backend.scale == 0.25
    assert "multi-head latent attention) runs on the torch attention backend: FlashInfer 0.5.3's" in caplog.text
    assert [r.levelno for r in caplog.records if "latent" in r.getMessage()] == [logging.WARNING]
