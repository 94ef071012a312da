"""A KV layer group FlashInfer 0.5.3 cannot serve (Gemma 4's 512-wide global heads) runs on the torch reference on
the GPU, beside FlashInfer for the other groups, and attends as the float32 reference does on the CPU."""

from __future__ import annotations

from dataclasses import fields, replace

import torch

from engine.attention import create_group_backends
from engine.attention.flashinfer import FlashInferBackend
from engine.attention.torch_ref import TorchRefBackend
from engine.model.kv_spec import KVGroupSpec

SLIDING = KVGroupSpec(layers=(0, 1), num_kv_heads=2, head_dim=256, window=32)
GLOBAL = KVGroupSpec(layers=(2,), num_kv_heads=1, head_dim=512)


class ModelShape:
    num_q_heads = 4


def test_each_group_gets_a_backend_that_serves_its_head_size():
    backends = create_group_backends(
        "flashinfer", [SLIDING, GLOBAL], "cuda", spec=ModelShape(), dtype=torch.bfloat16, kv_dtype=torch.bfloat16
    )
    assert [type(b) for b in backends] == [FlashInferBackend, TorchRefBackend]
    backends[0].warmup(page_size=16)  # the 256-wide sliding group's kernels build and run


def test_the_512_wide_group_on_cuda_equals_the_float32_reference(gpu_pager):
    (backend,) = create_group_backends(
        "flashinfer", [GLOBAL], "cuda", spec=ModelShape(), dtype=torch.bfloat16, kv_dtype=torch.bfloat16
    )
    pager = gpu_pager(num_layers=1, num_kv_heads=1, head_dim=512, page_size=16)
    reference = TorchRefBackend("cpu")
    cpu_cache = tuple(c.float().cpu() for c in pager.caches["ref"][0])
    gen = torch.Generator(device="cuda").manual_seed(0)
    for step in [[("a", 40), ("b", 3)], [("a", 1), ("b", 1)], [("a", 1), ("b", 1)]]:
        _, meta = pager.step(step)
        tokens = sum(n for _, n in step)
        q, k, v = (
            torch.randn(tokens, heads, 512, generator=gen, device="cuda").to(torch.bfloat16) for heads in (4, 1, 1)
        )
        backend.plan(meta)
        backend.write_kv(k, v, *pager.caches["test"][0])
        got = backend.run(q, *pager.caches["test"][0])
        cpu_meta = replace(
            meta,
            **{f.name: getattr(meta, f.name).cpu() for f in fields(meta) if torch.is_tensor(getattr(meta, f.name))},
        )
        reference.plan(cpu_meta)
        reference.write_kv(k.float().cpu(), v.float().cpu(), *cpu_cache)
        want = reference.run(q.float().cpu(), *cpu_cache)
        torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=2e-2)
