"""Quantized checkpoints served end to end: a tiny random Qwen3 in AWQ and a tiny Llama in compressed-tensors FP8,
each with the default model's tokenizer and vocabulary, baked from a local folder by the real builder and served
by `handler.py --serve`; the openai client's greedy chat answer is the one transformers gives on the weights the
checkpoint stands for."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from local_worker import LocalWorker, start_worker, stop_worker

from tests.engine.model.quant_writers import write_quantized

KINDS = {"awq": "qwen3", "ct_fp8": "llama"}  # format -> the family it is written for
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
MESSAGES = [{"role": "user", "content": "Name three colours."}]
MAX_TOKENS = 8


@pytest.fixture(scope="module", params=list(KINDS))
def quantized(request, baked_model_path: Path, tmp_path_factory) -> Iterator[tuple[object, LocalWorker]]:
    from builder.bake import bake
    from builder.sources import resolve

    kind = request.param
    folder = tmp_path_factory.mktemp(kind)
    source = folder / f"tiny-{kind}"
    baked = json.loads((baked_model_path / "config.json").read_text())
    hf = write_quantized(
        kind,
        KINDS[kind],
        source,
        vocab_size=baked["vocab_size"],
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        bos_token_id=baked["bos_token_id"],
        eos_token_id=baked["eos_token_id"],
    )
    for name in TOKENIZER_FILES:
        shutil.copy(baked_model_path / name, source / name)
    bake(resolve(str(source), None), folder / "model")
    worker = start_worker(folder / "model", folder / "worker.log")
    yield hf, worker
    stop_worker(worker)


def test_a_quantized_checkpoint_serves_the_greedy_answer_of_its_weights(quantized, tokenizer):
    hf, worker = quantized
    client = worker.client()
    (model,) = [m.id for m in client.models.list().data]
    answer = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)[
            0, len(prompt) :
        ].tolist()
    assert answer.usage.prompt_tokens == len(prompt) and answer.usage.completion_tokens == MAX_TOKENS
    assert answer.choices[0].finish_reason == "length"
    assert answer.choices[0].message.content == tokenizer.decode(ids, skip_special_tokens=True)
