"""Cross-encoder scores on the CUDA path (FlashInfer attention, the score head's matmul on the GPU; an encoder's SDPA
and its head) against the torch reference on CPU in float32, for each tiny cross-encoder layout. bfloat16 on the
GPU: the scores (sigmoids) may move by a few thousandths (ModernBERT's three pre-norm layers more: transformers' own
bf16 scores of its tiny test model move by up to 0.013); the ranking of clearly different scores must not change."""

from __future__ import annotations

import pytest
import torch

from tests.cross_encoders import ENCODER_KINDS, KINDS, build_cross_encoder, build_encoder_cross_encoder, encode_pair
from tests.engine.core.engine_run import random_prompts

TOLERANCE = 0.02  # absolute, on a sigmoid / softmax output, bf16 against float32
MODERNBERT_TOLERANCE = 0.03


def scores(path, prompts: list[list[int]], types: list[list[int]] | None = None, **config) -> list[list[float]]:
    from engine.config import EngineConfig
    from engine.core.engine import LLMEngine
    from engine.core.output.pooling import PoolingParams

    engine = LLMEngine(EngineConfig(model_path=str(path), num_kv_pages=256, **config))
    for i, prompt in enumerate(prompts):
        given = None if types is None else types[i]
        params = PoolingParams(config=engine.spec.pooling, head=engine.spec.score_head, token_type_ids=given)
        engine.add(str(i), engine.prepare(prompt, params))
    got: dict[str, list[float]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] = out.embedding
    del engine
    torch.cuda.empty_cache()
    return [got[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("kind", KINDS)
def test_cuda_scores_match_the_cpu_reference(kind, tmp_path, baked_model_path) -> None:
    build_cross_encoder(kind, tmp_path, baked_model_path)
    prompts = [random_prompts(1, n, n, seed=n)[0] for n in (3, 17, 64, 200)]
    cpu = scores(tmp_path, prompts, device="cpu", dtype="float32")
    cuda = scores(tmp_path, prompts, device="cuda", dtype="bfloat16", attention_backend="flashinfer")
    torch.testing.assert_close(torch.tensor(cuda), torch.tensor(cpu), atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("kind", [*ENCODER_KINDS, "modernbert"])
def test_cuda_encoder_scores_match_the_cpu_reference(kind, tmp_path) -> None:
    build_encoder_cross_encoder(kind, tmp_path)
    pairs = [encode_pair(tmp_path, "a query", " ".join(["document"] * n)) for n in (1, 20, 100)]
    prompts, types = [ids for ids, _ in pairs], [t for _, t in pairs]
    cpu = scores(tmp_path, prompts, types, device="cpu", dtype="float32", max_num_batched_tokens=130)
    cuda = scores(tmp_path, prompts, types, device="cuda", dtype="bfloat16", max_num_batched_tokens=130)
    atol = MODERNBERT_TOLERANCE if kind.startswith("modernbert") else TOLERANCE
    torch.testing.assert_close(torch.tensor(cuda), torch.tensor(cpu), atol=atol, rtol=0)
