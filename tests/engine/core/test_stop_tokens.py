"""Which tokens end a sequence: the config's and generation config's eos_token_id, or, where neither names one, the
tokenizer's eos token (as vLLM does). Without any stop token a grammar could never end: its last state would allow
no token at all."""

from __future__ import annotations

import json

import pytest
import torch

from engine.sample.params import SamplingParams
from engine.sample.structured.spec import StructuredSpec
from tests.engine.model.family_parity import load_family, tiny_engine


@pytest.fixture(scope="module")
def no_eos_folder(tmp_path_factory, baked_model_path):
    """A tiny random Llama whose config and generation config name no eos_token_id, with the baked tokenizer
    (tokenizer_config.json names its eos token)."""
    import transformers as tf

    path = tmp_path_factory.mktemp("no-eos")
    torch.manual_seed(0)
    config = tf.AutoConfig.for_model(
        "llama",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=49152,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    load_family(path, baked_model_path)  # copies the tokenizer files in
    assert "eos_token_id" not in json.loads((path / "generation_config.json").read_text())
    return path


def test_the_tokenizer_eos_stops_a_model_whose_configs_name_none(no_eos_folder):
    engine = tiny_engine(no_eos_folder)
    try:
        want = engine.tokenizer.eos_token_id
        assert want is not None and engine.spec.eos_token_ids == {want}
        # A grammar of one choice ends on that stop token: the request finishes, it does not fail.
        choice = StructuredSpec(kind="choice", value=json.dumps(["yes"]))
        engine.add_request(
            "a", engine.tokenizer.encode("Answer:"), SamplingParams(temperature=0.0, max_tokens=16, structured=choice)
        )
        outs = [out for _ in range(64) if engine.has_unfinished() for out in engine.step()]
        assert "".join(o.outputs[0].text for o in outs) == "yes"  # each output holds the step's new text
        assert [o.outputs[0].finish_reason for o in outs if o.finished] == ["stop"]
    finally:
        engine.close()
