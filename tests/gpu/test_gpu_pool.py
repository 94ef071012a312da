"""The KV pool sized from free GPU memory: the engine's whole footprint stays inside gpu_memory_utilization."""

from __future__ import annotations

import gc

import torch

UTILIZATION = 0.25


def test_pool_and_peak_stay_within_budget(tmp_path, tiny_llama_checkpoint):
    from engine.config import EngineConfig
    from engine.core.engine import LLMEngine
    from engine.sample.params import SamplingParams

    path = tiny_llama_checkpoint(tmp_path / "m", num_q_heads=8, num_kv_heads=2, layers=4)
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    other = total - free - torch.cuda.memory_reserved()  # CUDA context and anything outside torch
    torch.cuda.reset_peak_memory_stats()
    budget = UTILIZATION * total - other

    engine = LLMEngine(
        EngineConfig(
            model_path=str(path),
            device="cuda",
            dtype="bfloat16",
            attention_backend="flashinfer",
            gpu_memory_utilization=UTILIZATION,
            max_num_seqs=64,
            max_num_batched_tokens=1024,
        )
    )
    info = engine.describe()
    assert info["backend"] == "flashinfer" and info["dtype"] == "bfloat16"
    # the pool takes most of the budget (the model and activations are tiny) yet fits inside it
    assert 0.5 * budget < info["kv_bytes"] <= budget, (info["kv_bytes"], budget)

    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True)
    for i in range(96):  # more than max_num_seqs: queueing, long prompts: chunked prefill
        prompt = torch.randint(3, 512, (int(torch.randint(1, 700, (1,), generator=g)),), generator=g).tolist()
        engine.add_request(str(i), prompt, params)
    finished = 0
    while engine.has_unfinished():
        finished += sum(o.finished for o in engine.step())
    assert finished == 96
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    assert peak <= budget, f"peak {peak / 2**30:.2f} GiB above the budget {budget / 2**30:.2f} GiB"
