"""LLMEngine on the baked SmolLM2 (float32): greedy parity with transformers' generate, a request alone equal to
the same in a batch of 16, and the thread pool it reports."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.core.engine_run import greedy, make_engine, run


@pytest.fixture(scope="module")
def smol(baked_model_path):
    return make_engine(baked_model_path, dtype="float32", num_kv_pages=512)


def test_a_cpu_engine_reports_its_thread_pool(smol):
    assert smol.describe()["threads"] == torch.get_num_threads()


def test_greedy_matches_transformers_generate(smol, baked_model_path):
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(baked_model_path, dtype=torch.float32).eval()
    tok = smol.tokenizer
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "<|im_start|>user\nWhat is 2+2? Answer briefly.<|im_end|>\n<|im_start|>assistant\n",
    ]
    prompts = [tok.encode(t) for t in texts]
    got = run(smol, {str(i): (p, greedy(20)) for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False)[0, len(p) :].tolist()
        assert got[str(i)].choices[0].token_ids == ref
        assert got[str(i)].choices[0].text == tok.decode(ref, skip_special_tokens=True)
    assert got["2"].choices[0].finish_reason == "stop"  # the chat answer ends on <|im_end|>


def test_smollm2_request_alone_equals_in_a_batch_of_16(smol, baked_model_path):
    tok = smol.tokenizer
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bold jumbo zebras".split()
    rng = random.Random(1)
    prompts = [tok.encode(" ".join(rng.choice(words) for _ in range(rng.randint(3, 40)))) for _ in range(15)]
    target = tok.encode("Write a short poem about the sea.")
    alone = run(smol, {"t": (target, greedy(16, ignore_eos=True))})["t"].choices[0].token_ids
    batch = {"t": (target, greedy(16, ignore_eos=True))}
    batch |= {f"o{i}": (p, greedy(4 + i % 9, ignore_eos=True)) for i, p in enumerate(prompts)}
    assert run(smol, batch)["t"].choices[0].token_ids == alone
    # Chunked prefill (32-token budget) and a pool of 8 pages, small enough to preempt, in one run.
    tight = make_engine(
        baked_model_path, dtype="float32", num_kv_pages=8, max_model_len=96, max_num_batched_tokens=32, page_size=16
    )
    assert run(tight, batch)["t"].choices[0].token_ids == alone
    assert tight.scheduler.num_preemptions > 0


# ---- the tiny model
