"""Speculative decoding with an EAGLE-3 head: the head's guesses equal a plain-torch reference fed transformers'
hidden states of the same layers, greedy output is token for token as without speculation (batched with requests
that do not speculate, after a prefix-cache hit, under preemption), the head's pages are given back, and heads that
do not fit the model fail the start in one line."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import SpeculativeConfig
from engine.errors import StartupError
from engine.sample.params import SamplingParams
from tests.engine.core.eagle3_heads import head_reference, write_head
from tests.engine.core.engine_run import greedy, make_engine, run


def _eagle(path, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(
        method="eagle3", model=str(path), num_speculative_tokens=3, **{"disable_by_batch_size": 256, **kw}
    )


@pytest.fixture(scope="module")
def target_config(baked_model_path) -> dict:
    return json.loads((baked_model_path / "config.json").read_text())


@pytest.fixture(scope="module")
def head_path(tmp_path_factory, target_config):
    folder = tmp_path_factory.mktemp("eagle3")
    write_head(folder, target_config)
    return folder


@pytest.fixture(scope="module")
def plain(baked_model_path):
    return make_engine(baked_model_path, num_kv_pages=256)


@pytest.fixture(scope="module")
def eagle(baked_model_path, head_path):
    return make_engine(baked_model_path, num_kv_pages=256, speculative=_eagle(head_path))


def _tokens(results) -> dict[str, list[list[int]]]:
    return {r: [c.token_ids for _, c in sorted(res.choices.items())] for r, res in results.items()}


@pytest.mark.parametrize("layer_ids", [None, [27, 2, 15]])
def test_the_heads_guesses_equal_a_reference_fed_transformers_hidden_states(
    baked_model_path, eagle, head_path, target_config, layer_ids, tmp_path
):
    """With EAGLE-3's default layers, and with a head config naming its own, out of the layers' order."""
    from safetensors.torch import load_file

    if layer_ids is not None:
        write_head(tmp_path, target_config, eagle_config={"eagle_aux_hidden_state_layer_ids": layer_ids})
        head_path = tmp_path
        eagle = make_engine(baked_model_path, num_kv_pages=256, speculative=_eagle(tmp_path))
    prompt = eagle.tokenizer.encode("The quick brown fox jumps over the lazy dog because")
    eagle.add_request("r", prompt, greedy(8, ignore_eos=True))
    eagle.step()  # the prefill: the head catches up on the prompt and guesses once
    seq = eagle._groups["r"].seqs[0]
    guesses = eagle.speculator.proposer.propose([seq], [3])[0]
    eagle.abort("r")
    hf = AutoModelForCausalLM.from_pretrained(baked_model_path, dtype=torch.float32)
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_hidden_states=True)
    layers = layer_ids or (2, target_config["num_hidden_layers"] // 2, target_config["num_hidden_layers"] - 3)
    features = torch.cat([out.hidden_states[i][0] for i in layers], -1)
    next_token = int(out.logits[0, -1].argmax())
    assert seq.token_ids[len(prompt)] == next_token
    want = head_reference(
        load_file(str(head_path / "model.safetensors")),
        hf.model.embed_tokens.weight,
        prompt + [next_token],
        features,
        target_config["vocab_size"],
        steps=3,
    )
    assert guesses == want


def test_greedy_equals_without_speculation_batched_with_requests_that_do_not_speculate(plain, eagle):
    tok = plain.tokenizer
    requests = {
        "story": (tok.encode("Once upon a time"), greedy(20)),
        "code": (tok.encode("def fibonacci(n):"), greedy(16, logprobs=2)),
        "stop": (tok.encode("The capital of France is"), greedy(16, stop=["."])),
        "n2": (tok.encode("Name a colour:"), SamplingParams(temperature=0.0, max_tokens=10, n=2)),
        "beam": (tok.encode("The sea"), SamplingParams(temperature=0.0, max_tokens=8, n=2, use_beam_search=True)),
    }
    before = eagle.stats()["spec_verify_steps"]
    assert _tokens(run(eagle, requests, join_at={"beam": 2})) == _tokens(run(plain, requests, join_at={"beam": 2}))
    assert eagle.stats()["spec_verify_steps"] > before  # it did speculate
    # A second run of the same prompts hits the prefix cache: the head runs those positions without features.
    long = {"long": (tok.encode("In a hole in the ground there lived a hobbit. " * 4), greedy(12))}
    first = run(eagle, long)
    hits = run(eagle, long)
    assert hits["long"].last.num_cached_tokens >= 32
    assert _tokens(hits) == _tokens(first) == _tokens(run(plain, long))
    head = eagle.speculator.proposer
    assert head.kv.num_free == [a.num_pages for a in head.kv.allocators]  # every head page given back
    head.kv.check()


def test_preemption_on_a_small_pool_gives_the_same_tokens(baked_model_path, head_path, plain):
    tight = make_engine(baked_model_path, num_kv_pages=6, max_model_len=64, page_size=16, speculative=_eagle(head_path))
    prompt = plain.tokenizer.encode("Once upon a time")
    crowd = {f"c{i}": (prompt + [11] * i, greedy(24, ignore_eos=True)) for i in range(4)}
    assert _tokens(run(tight, crowd)) == _tokens(run(plain, crowd))
    assert tight.scheduler.num_preemptions > 0 and tight.stats()["spec_verify_steps"] > 0


def test_heads_that_do_not_fit_fail_the_start_in_one_line(baked_model_path, tmp_path, target_config):
    cases = {
        "hidden": ({**target_config, "hidden_size": 512}, {}, "reads hidden states of size 512; the model's are 576"),
        "vocab": ({**target_config, "vocab_size": 1000}, {"draft_vocab_size": 512}, "vocabulary of 1000 tokens"),
        "layers": (
            target_config,
            {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 99]}},
            "reads layers [1, 2, 99], but the model has 30 layers",
        ),
        "arch": (target_config, {"architectures": ["LlamaForCausalLM"]}, "not an EAGLE-3 head"),
    }
    for name, (shape, config, words) in cases.items():
        write_head(tmp_path / name, shape, draft_vocab=config.pop("draft_vocab_size", 512), **config)
        with pytest.raises(StartupError, match="EAGLE-3 head") as info:
            make_engine(baked_model_path, speculative=_eagle(tmp_path / name))
        assert words in info.value.message and "\n" not in info.value.message, (name, info.value.message)
        assert info.value.param == "speculative.model"
