"""The model's CUDA dispatch (FlashInfer norm / RoPE / SiLU-and-mul) and engine.cuda.setup on a real GPU.

Tests that run the fused model need FlashInfer's RoPE module, a JIT build of minutes: they are marked slow,
like the RoPE kernel test (bench/gpu/check.sh builds it in the background and runs slow tests last).
"""

from __future__ import annotations

import pytest
import torch

from engine.attention import resolve_backend
from engine.core.cuda_graphs import prepare_cuda
from engine.cuda import setup as cuda_setup

DT = torch.bfloat16


def load(tmp_path, tiny_llama_checkpoint, **kw):
    from engine.model.loader import load_model

    path = tiny_llama_checkpoint(tmp_path / "model", **kw)
    return load_model(str(path), DT, torch.device("cuda"))


def test_auto_backend_on_this_gpu():
    cuda = torch.device("cuda")
    assert resolve_backend("auto", cuda, DT) == ("flashinfer", "auto: CUDA")
    assert resolve_backend("auto", cuda, torch.float32)[0] == "torch"


def test_kv_budget_bytes_follows_free_memory():
    dev = torch.device("cuda")
    free, total = torch.cuda.mem_get_info(dev)
    reserve = 1 << 30
    budget = cuda_setup.kv_budget_bytes(dev, 0.9, reserve)
    expected = int(total * 0.9) - (total - free) - reserve
    assert abs(budget - max(0, expected)) < (64 << 20)  # free memory moves a little (empty_cache)
    assert cuda_setup.kv_budget_bytes(dev, 0.9, total) == 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fused_model_matches_torch_path(tmp_path, tiny_llama_checkpoint, gpu_pager, kind):
    from engine.attention.flashinfer import FlashInferBackend
    from engine.model.models.llama import LlamaAttention

    model, spec = load(tmp_path, tiny_llama_checkpoint, kind=kind)
    assert model.fused_kernels, "a bf16 CUDA model must pick FlashInfer's kernels at load"
    table = model.rotary.cos_sin_cache
    assert table.is_cuda and table.dtype == torch.float32
    assert all(m.cos_sin_cache is table for m in model.modules() if isinstance(m, LlamaAttention))

    pager = gpu_pager(
        num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, pools=("fused", "torch")
    )
    backend = FlashInferBackend(device="cuda", **cuda_setup.backend_kwargs(spec, DT))
    g = torch.Generator().manual_seed(0)
    lengths = {"a": 37, "b": 5, "c": 16}
    steps = [[(r, torch.randint(0, 512, (n,), generator=g).tolist()) for r, n in lengths.items()]]
    steps += [[(r, [int(torch.randint(0, 512, (1,), generator=g))]) for r in lengths] for _ in range(3)]
    logits: dict[str, list[torch.Tensor]] = {"fused": [], "torch": []}
    for batch in steps:
        positions, meta = pager.step([(r, len(t)) for r, t in batch])
        ids = torch.tensor([x for _, t in batch for x in t], device="cuda")
        for name in logits:  # the same step on each path, each with its own pool
            model.init_rotary(spec.max_position_embeddings, DT, torch.device("cuda"), fused=name == "fused")
            with torch.inference_mode():
                backend.plan(meta)
                hidden = model(ids, positions, meta, pager.caches[name], backend)
                logits[name].append(model.compute_logits(hidden[meta.qo_indptr[1:].long() - 1]))
    for f, t in zip(logits["fused"], logits["torch"], strict=True):
        torch.testing.assert_close(f, t, atol=0.15, rtol=0.05)
        top2 = t.topk(2).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.15
        assert torch.equal(f.argmax(-1)[clear], t.argmax(-1)[clear])


@pytest.mark.slow
def test_prepare_cuda_captures_within_the_reserve(tmp_path, tiny_llama_checkpoint):
    from engine.attention.flashinfer import FlashInferBackend
    from engine.core.kv.cache import PagePool

    model, spec = load(tmp_path, tiny_llama_checkpoint)
    dev, page_size, max_model_len, max_num_seqs = torch.device("cuda"), 16, 1024, 24
    backend = FlashInferBackend(device=dev, **cuda_setup.backend_kwargs(spec, DT))
    assert cuda_setup.warm_up(model, backend, page_size) >= 0
    max_pages = -(-max_model_len // page_size)
    graph_reserve = cuda_setup.reserve_bytes(
        model.args,
        DT,
        max_num_batched_tokens=1,
        max_num_seqs=max_num_seqs,
        max_pages_per_seq=max_pages,
        graphs=True,
    )
    pool = PagePool(
        num_layers=spec.num_layers,
        num_pages=256,
        page_size=page_size,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        dtype=DT,
        device=dev,
    )
    assert (
        prepare_cuda(
            model,
            backend,
            pool.kv_caches,
            page_size=page_size,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            enforce_eager=True,
        )
        is None
    )
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info(dev)[0]
    runner = prepare_cuda(
        model,
        backend,
        pool.kv_caches,
        page_size=page_size,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enforce_eager=False,
    )
    torch.cuda.synchronize()
    used = free_before - torch.cuda.mem_get_info(dev)[0]
    assert runner is not None and runner.batch_sizes == [1, 2, 4, 8, 16, 24]
    assert sorted(runner.graphs) == runner.batch_sizes
    assert used <= graph_reserve, f"graphs took {used} bytes, the reserve allows {graph_reserve}"
