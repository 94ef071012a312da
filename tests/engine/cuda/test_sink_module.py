"""The attention-sink variant's JIT module is named by everything it is built for. FlashInfer 0.5.3's
BatchAttentionWithAttentionSinkWrapper names it by q dtype, window and backend only, so a process with two head sizes
(or a bf16 and an FP8 KV cache) loaded the first one's library for the second; the engine builds the same variant
under FlashInfer's own AOT name, which engine.cuda.precompile builds too."""

from __future__ import annotations

import inspect

import pytest
import torch

from engine.cuda.kernels import sink_module_args

flashinfer = pytest.importorskip("flashinfer", reason="flashinfer is installed in make test's image-torch venv")


def args(head_dim: int = 64, kv_dtype: torch.dtype = torch.bfloat16, sliding_window: bool = False) -> tuple:
    return sink_module_args(
        backend="fa2", q_dtype=torch.bfloat16, kv_dtype=kv_dtype, head_dim=head_dim, sliding_window=sliding_window
    )


def test_the_library_wrapper_names_two_head_sizes_alike() -> None:
    """The defect itself, read from the installed release: if this starts failing, FlashInfer fixed its name and the
    engine could use its wrapper again."""
    source = inspect.getsource(flashinfer.BatchAttentionWithAttentionSinkWrapper.__init__)
    assert (
        'f"batch_prefill_attention_sink_{filename_safe_dtype_map[q_data_type]}_swa_{window_left >= 0}_{backend}"'
        in source
    )


def test_module_names_differ_by_head_size_kv_dtype_and_window() -> None:
    names = {args(64)[0][0], args(128)[0][0], args(64, torch.float8_e4m3fn)[0][0], args(64, sliding_window=True)[0][0]}
    assert len(names) == 4
    assert "head_dim_qk_128" in args(128)[0][0] and "dtype_kv_e4m3" in args(64, torch.float8_e4m3fn)[0][0]


def test_the_arguments_are_the_wrapper_variant_s_and_bind_to_the_module_builder() -> None:
    from flashinfer.jit.attention.modules import get_batch_prefill_attention_sink_uri
    from flashinfer.prefill import get_customize_batch_prefill_module

    jit_args, jit_kwargs = args(256, sliding_window=True)
    # What the prefill wrapper does with them: get_customize_batch_prefill_module(backend, *jit_args, **jit_kwargs).
    bound = inspect.signature(get_customize_batch_prefill_module).bind("fa2", *jit_args, **jit_kwargs)
    assert bound.arguments["uri"] == get_batch_prefill_attention_sink_uri(
        backend="fa2",
        dtype_q=torch.bfloat16,
        dtype_kv=torch.bfloat16,
        dtype_o=torch.bfloat16,
        dtype_idx=torch.int32,
        head_dim_qk=256,
        head_dim_vo=256,
        pos_encoding_mode=0,
        use_sliding_window=True,
    )
    assert (bound.arguments["head_dim_qk"], bound.arguments["head_dim_vo"]) == (256, 256)
    assert bound.arguments["additional_tensor_names"] == ["sink"]
    assert bound.arguments["additional_scalar_names"] == ["sm_scale"]
    assert bound.arguments["variant_name"] == "AttentionSink"
    assert bound.arguments["use_sliding_window"] is True
