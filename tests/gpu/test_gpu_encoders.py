"""The encoders on CUDA: their attention is torch SDPA on every device (engine.model.layers.encoder_attention), so the
CUDA path is held to the float32 CPU reference on the same inputs. Tiny random BERT, ModernBERT and NomicBert models
embed several prompts of different lengths in one step (longer than ModernBERT's local window too) in float32 and
bfloat16; the sliding-window attention itself matches the CPU's."""

from __future__ import annotations

import pytest
import torch

from tests.encoders import LOCAL_ATTENTION, MAX_POSITIONS, add_mean_pooling, build_encoder

# 1 token; inside ModernBERT's window (9 rows); past it; far past it; the longest served
LENGTHS = (1, LOCAL_ATTENTION // 2 + 1, LOCAL_ATTENTION // 2 + 2, 40, 131, MAX_POSITIONS)
# (least cosine similarity, largest absolute difference) of a normalised embedding against the float32 CPU one
TOLERANCE = {"float32": (0.99999, 1e-4), "bfloat16": (0.995, 0.03)}


def embed_in_one_step(path, prompts: list[list[int]], **config) -> torch.Tensor:
    """The prompts' embeddings, all from the engine's first step (one batch of different lengths)."""
    from engine.config import EngineConfig
    from engine.core.engine import LLMEngine
    from engine.core.output.pooling import PoolingParams

    engine = LLMEngine(EngineConfig(model_path=str(path), num_kv_pages=256, max_num_batched_tokens=1024, **config))
    for i, prompt in enumerate(prompts):
        engine.add(str(i), engine.prepare(prompt, PoolingParams(config=engine.spec.pooling)))
    got = {out.request_id: out.embedding for out in engine.step()}
    assert len(got) == len(prompts) and not engine.has_unfinished(), "the prompts did not run in one step"
    del engine
    torch.cuda.empty_cache()
    return torch.tensor([got[str(i)] for i in range(len(prompts))])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["BertModel", "ModernBertModel", "NomicBertModel"])
def test_cuda_embeddings_match_the_cpu_reference(arch, dtype, tmp_path) -> None:
    build_encoder(arch, tmp_path)
    add_mean_pooling(tmp_path)  # every row of every prompt counts
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(5, 30000, (n,), generator=generator).tolist() for n in LENGTHS]
    cpu = embed_in_one_step(tmp_path, prompts, device="cpu", dtype="float32")
    cuda = embed_in_one_step(tmp_path, prompts, device="cuda", dtype=dtype)
    least_cosine, largest_difference = TOLERANCE[dtype]
    assert (cuda * cpu).sum(-1).min() >= least_cosine
    torch.testing.assert_close(cuda, cpu, atol=largest_difference, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_attention_matches_the_cpu(dtype) -> None:
    from engine.model.layers.encoder_attention import attend_within_sequences

    generator = torch.Generator().manual_seed(3)
    bounds = [0, 1, 9, 19, 119, 375]  # sequences of 1, 8, 10, 100 and 256 rows
    q, k, v = (torch.randn(4, bounds[-1], 64, generator=generator) for _ in range(3))
    for window in (None, LOCAL_ATTENTION // 2):
        cpu = attend_within_sequences(q, k, v, bounds, window=window)
        cuda = attend_within_sequences(*(t.to("cuda", dtype) for t in (q, k, v)), bounds, window=window)
        torch.testing.assert_close(cuda.float().cpu(), cpu, atol=1e-4 if dtype == torch.float32 else 0.03, rtol=0)
    windowed = attend_within_sequences(q, k, v, bounds, window=LOCAL_ATTENTION // 2)
    assert not torch.allclose(windowed[119:], attend_within_sequences(q, k, v, bounds)[119:])  # the window bites
