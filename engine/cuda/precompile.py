"""FlashInfer's JIT modules by name, built ahead of time without a GPU (nvcc is enough), all in one ninja.

An AttentionModule is one paged-attention variant as the runtime wrappers JIT it (flashinfer 0.5.3's
BatchPrefillWithPagedKVCacheWrapper.plan, BatchDecodeWithPagedKVCacheWrapper.plan, the attention-sink prefill
variant of engine.cuda.kernels.sink_module_args, and BatchMLAPagedAttentionWrapper.plan for multi-head latent
attention), so a worker finds each one built under FLASHINFER_WORKSPACE_BASE.
Which modules a model asks for is engine.core.kernel_plan's business (this package sits below the model).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from engine.cuda.kernels import DEFAULT_PREFILL_BACKEND, MLA_BACKEND

# NOTE: no FlashInfer sampling: it draws a batch from one generator, and a seeded request must get the same
# tokens whatever shares its batch (engine.sample.sampler draws each row from its own).
KERNEL_MODULES = ("norm", "activation", "rope")
LIST_ARCH = "9.0a"  # what a listing tells FlashInfer when no arch is given and no GPU is visible


class PrecompileError(RuntimeError):
    """Modules that did not build, each named, with the first lines nvcc said about it."""


@dataclass(frozen=True, order=True, kw_only=True)
class AttentionModule:
    """One FlashInfer attention module as the runtime asks for it.

    kind: "prefill" (FA2's paged prefill; the tensor-core decode plans the same module, and a custom mask is one of
    its four compiled mask modes), "decode" (the CUDA-core decode, for fewer than 4 q heads per KV head), "sink"
    (the attention-sink prefill variant, gpt-oss; it serves decode steps too) or "mla" (multi-head latent attention's
    paged kernel, prefill and decode: head_dim is the latent's kv_lora_rank, rope_dim its rotary part).
    """

    kind: str
    head_dim: int
    q_dtype: str  # "bfloat16" / "float16"
    kv_dtype: str  # q_dtype, or "float8_e4m3fn"
    sliding_window: bool
    soft_cap: bool = False
    rope_dim: int = 0  # "mla" only

    def jit_spec(self) -> Any:
        """FlashInfer's JitSpec for this module; writes its generated sources (no compile). No RoPE in the kernel
        (pos_encoding_mode 0) and int32 page tables, as the attention backend plans."""
        from flashinfer.jit.attention import modules

        q, kv = getattr(torch, self.q_dtype), getattr(torch, self.kv_dtype)
        d, window = self.head_dim, self.sliding_window
        if self.kind == "mla":
            return modules.gen_batch_mla_module(
                backend=MLA_BACKEND,
                dtype_q=q,
                dtype_kv=kv,
                dtype_o=q,
                dtype_idx=torch.int32,
                head_dim_ckv=d,
                head_dim_kpe=self.rope_dim,
                use_profiler=False,
            )
        if self.kind == "sink":
            return modules.gen_batch_prefill_attention_sink_module(
                backend=DEFAULT_PREFILL_BACKEND,
                dtype_q=q,
                dtype_kv=kv,
                dtype_o=q,
                dtype_idx=torch.int32,
                head_dim_qk=d,
                head_dim_vo=d,
                pos_encoding_mode=0,
                use_sliding_window=window,
            )
        if self.kind == "decode":
            return modules.gen_batch_decode_module(
                dtype_q=q,
                dtype_kv=kv,
                dtype_o=q,
                dtype_idx=torch.int32,
                head_dim_qk=d,
                head_dim_vo=d,
                pos_encoding_mode=0,
                use_sliding_window=window,
                use_logits_soft_cap=self.soft_cap,
            )
        return modules.gen_batch_prefill_module(
            backend=DEFAULT_PREFILL_BACKEND,
            dtype_q=q,
            dtype_kv=kv,
            dtype_o=q,
            dtype_idx=torch.int32,
            head_dim_qk=d,
            head_dim_vo=d,
            pos_encoding_mode=0,
            use_sliding_window=window,
            use_logits_soft_cap=self.soft_cap,
            use_fp16_qk_reduction=False,
        )

    def name(self) -> str:
        """The module's name (its cache folder), from FlashInfer's own uri functions: no sources written."""
        from flashinfer.jit.attention import modules

        q, kv = getattr(torch, self.q_dtype), getattr(torch, self.kv_dtype)
        d, window = self.head_dim, self.sliding_window
        if self.kind == "mla":
            return modules.get_batch_mla_uri(
                backend=MLA_BACKEND,
                dtype_q=q,
                dtype_kv=kv,
                dtype_o=q,
                dtype_idx=torch.int32,
                head_dim_ckv=d,
                head_dim_kpe=self.rope_dim,
                use_profiler=False,
            )
        if self.kind == "sink":
            return modules.get_batch_prefill_attention_sink_uri(
                backend=DEFAULT_PREFILL_BACKEND,
                dtype_q=q,
                dtype_kv=kv,
                dtype_o=q,
                dtype_idx=torch.int32,
                head_dim_qk=d,
                head_dim_vo=d,
                pos_encoding_mode=0,
                use_sliding_window=window,
            )
        if self.kind == "decode":
            return modules.get_batch_decode_uri(
                dtype_q=q,
                dtype_kv=kv,
                dtype_o=q,
                dtype_idx=torch.int32,
                head_dim_qk=d,
                head_dim_vo=d,
                pos_encoding_mode=0,
                use_sliding_window=window,
                use_logits_soft_cap=self.soft_cap,
            )
        return modules.get_batch_prefill_uri(
            backend=DEFAULT_PREFILL_BACKEND,
            dtype_q=q,
            dtype_kv=kv,
            dtype_o=q,
            dtype_idx=torch.int32,
            head_dim_qk=d,
            head_dim_vo=d,
            pos_encoding_mode=0,
            use_sliding_window=window,
            use_logits_soft_cap=self.soft_cap,
            use_fp16_qk_reduction=False,
        )


def kernel_spec(name: str) -> Any:
    """The JitSpec of one of KERNEL_MODULES, as engine.cuda.kernels' wrappers JIT it."""
    from flashinfer.jit import activation, norm, rope

    makers = {
        "norm": norm.gen_norm_module,
        "rope": rope.gen_rope_module,
        "activation": lambda: activation.gen_act_and_mul_module(act_func_name="silu"),
    }
    return makers[name]()


def module_names(attention: Iterable[AttentionModule], kernels: Iterable[str] = KERNEL_MODULES) -> list[str]:
    """Sorted module names; nothing is compiled (the activation module's one generated source is written)."""
    return sorted({*(kernel_spec(k).name for k in kernels), *(m.name() for m in attention)})


def set_cuda_arch(cuda_arch: str) -> None:
    """FLASHINFER_CUDA_ARCH_LIST for the build. flashinfer reads it (and FLASHINFER_WORKSPACE_BASE) once, at
    import, into the cache folder's name, so it must be set first."""
    if "flashinfer" in sys.modules and os.environ.get("FLASHINFER_CUDA_ARCH_LIST") != cuda_arch:
        raise RuntimeError(
            f"flashinfer was imported before the arch list was set to {cuda_arch!r}: its cache "
            "folder is named already; set FLASHINFER_CUDA_ARCH_LIST before importing it"
        )
    os.environ["FLASHINFER_CUDA_ARCH_LIST"] = cuda_arch


def build(specs: list[Any]) -> None:
    """One ninja over every spec (MAX_JOBS at a time). A failure is rebuilt with `ninja -k 0`, so that every module
    that cannot build is named (PrecompileError), not only the first."""
    from flashinfer.jit import build_jit_specs
    from flashinfer.jit.core import get_tmpdir

    for spec in specs:  # NOTE: build_jit_specs keeps an existing build.ninja: a changed flag would not reach it
        spec.write_ninja()
    try:
        build_jit_specs(specs=specs, verbose=False)
    except RuntimeError:
        ninja = get_tmpdir() / "flashinfer_jit.ninja"
        jobs = ["-j", os.environ["MAX_JOBS"]] if os.environ.get("MAX_JOBS", "").isdigit() else []
        again = subprocess.run(
            ["ninja", "-k", "0", *jobs, "-f", str(ninja)], cwd=ninja.parent.parent, capture_output=True, text=True
        )
        failed = [s.name for s in specs if not s.jit_library_path.exists()]
        said = [line for line in again.stdout.splitlines() if line.startswith("FAILED") or "error" in line]
        raise PrecompileError(
            f"{len(failed)} FlashInfer modules did not build: " + ", ".join(failed) + "\n" + "\n".join(said[:40])
        ) from None


def jit_specs(attention: Iterable[AttentionModule], kernels: Iterable[str] = KERNEL_MODULES) -> list[Any]:
    """The JitSpecs (sources generated) of the kernels and attention modules, each name once."""
    specs = {spec.name: spec for spec in [*(kernel_spec(k) for k in kernels), *(m.jit_spec() for m in attention)]}
    return [specs[name] for name in sorted(specs)]
