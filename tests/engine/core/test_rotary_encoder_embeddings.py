"""ModernBERT and NomicBert embeddings in LLMEngine equal transformers' on tiny random float32 configs: the CLS row
(no modules.json) and the mean over every row (sentence-transformers' files) on several prompt lengths, longer than
ModernBERT's local window included, batched equal to solo; NomicBert's remote-code layout (the nomic-embed
checkpoints' names and config keys) equals transformers' layout of the same weights and serves the positions it was
trained on; a remote-code option transformers' model lacks is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from engine.errors import UnsupportedModel
from tests.encoders import LOCAL_ATTENTION, MAX_POSITIONS, add_mean_pooling, build_encoder, write_nomic_remote_layout
from tests.engine.core.engine_run import make_engine
from tests.engine.core.test_encoder_embeddings import embed_all

ARCHS = ("ModernBertModel", "NomicBertModel")
# 1 token; inside the local window (9 rows: 8 either side); just past it; far past it; the longest served
LENGTHS = (1, 7, LOCAL_ATTENTION // 2 + 1, LOCAL_ATTENTION // 2 + 2, 40, 131, MAX_POSITIONS)


def random_prompts() -> dict[str, list[int]]:
    generator = torch.Generator().manual_seed(1)
    return {str(n): torch.randint(5, 30000, (n,), generator=generator).tolist() for n in LENGTHS}


def transformers_hidden(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).last_hidden_state[0]


@pytest.mark.parametrize("pooling", ["cls", "mean"])
@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_random_encoder_equals_transformers(tmp_path, arch, pooling) -> None:
    hf = build_encoder(arch, tmp_path)
    if pooling == "mean":
        add_mean_pooling(tmp_path)
    engine = make_engine(tmp_path, max_num_batched_tokens=MAX_POSITIONS)
    assert engine.spec.pooling.method == pooling and engine.spec.pooling.normalize
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [arch]
    assert engine.max_model_len == MAX_POSITIONS
    prompts = random_prompts()
    batched = embed_all(engine, prompts)
    for rid, prompt in prompts.items():
        hidden = transformers_hidden(hf, prompt)
        want = torch.nn.functional.normalize(hidden[0] if pooling == "cls" else hidden.mean(0), dim=-1)
        torch.testing.assert_close(torch.tensor(batched[rid]), want, atol=1e-5, rtol=0)
        alone = embed_all(engine, {"solo": prompt})["solo"]
        torch.testing.assert_close(torch.tensor(alone), torch.tensor(batched[rid]), atol=1e-6, rtol=0)


def test_modernbert_checkpoint_under_model_prefix_with_its_head_loads(tmp_path) -> None:
    """A ModernBertForMaskedLM folder (ModernBERT-base's layout: model.*, head.*, decoder.*) renamed to the encoder
    embeds as the encoder does."""
    import transformers

    hf = build_encoder("ModernBertModel", tmp_path / "encoder")
    masked = transformers.ModernBertForMaskedLM(hf.config).eval()
    masked.model.load_state_dict(hf.state_dict())
    masked.save_pretrained(tmp_path / "masked")
    config = json.loads((tmp_path / "masked" / "config.json").read_text())
    (tmp_path / "masked" / "config.json").write_text(json.dumps({**config, "architectures": ["ModernBertModel"]}))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        (tmp_path / "masked" / name).write_bytes((tmp_path / "encoder" / name).read_bytes())
    prompt = random_prompts()["40"]
    got = embed_all(make_engine(tmp_path / "masked", max_num_batched_tokens=MAX_POSITIONS), {"a": prompt})["a"]
    want = torch.nn.functional.normalize(transformers_hidden(hf, prompt)[0], dim=-1)
    torch.testing.assert_close(torch.tensor(got), want, atol=1e-5, rtol=0)


def test_nomic_remote_code_layout_equals_transformers(tmp_path) -> None:
    hf = build_encoder("NomicBertModel", tmp_path / "transformers")
    write_nomic_remote_layout(hf, tmp_path / "remote")
    engine = make_engine(tmp_path / "remote", max_num_batched_tokens=MAX_POSITIONS)
    assert engine.max_model_len == MAX_POSITIONS  # n_positions
    prompts = random_prompts()
    got = embed_all(engine, prompts)
    for rid, prompt in prompts.items():
        want = torch.nn.functional.normalize(transformers_hidden(hf, prompt)[0], dim=-1)
        torch.testing.assert_close(torch.tensor(got[rid]), want, atol=1e-5, rtol=0)


def test_nomic_serves_its_trained_positions_and_reads_transformers_keys_over_remote_ones(tmp_path) -> None:
    hf = build_encoder("NomicBertModel", tmp_path / "transformers")
    write_nomic_remote_layout(hf, tmp_path / "remote")
    config = json.loads((tmp_path / "remote" / "config.json").read_text())
    (tmp_path / "remote" / "config.json").write_text(json.dumps({**config, "max_trained_positions": 128}))
    assert make_engine(tmp_path / "remote", max_num_batched_tokens=MAX_POSITIONS).max_model_len == 128
    # A config with both layouts' keys (nomic-embed-text-v1.5's): transformers' win wherever they differ
    both = {**config, "n_positions": 8192, "max_position_embeddings": 192, "rotary_emb_base": 5.0}
    (tmp_path / "remote" / "config.json").write_text(json.dumps({**both, "rope_parameters": hf.config.rope_parameters}))
    engine = make_engine(tmp_path / "remote", max_num_batched_tokens=MAX_POSITIONS)
    assert engine.max_model_len == 192
    prompt = random_prompts()["131"]
    want = torch.nn.functional.normalize(transformers_hidden(hf, prompt)[0], dim=-1)
    torch.testing.assert_close(torch.tensor(embed_all(engine, {"a": prompt})["a"]), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("key", "value"), [("prenorm", True), ("rotary_emb_fraction", 0.5), ("qkv_proj_bias", True)])
def test_a_remote_code_option_transformers_lacks_is_refused_in_one_line(tmp_path, key, value) -> None:
    hf = build_encoder("NomicBertModel", tmp_path / "transformers")
    write_nomic_remote_layout(hf, tmp_path / "remote")
    config = json.loads((tmp_path / "remote" / "config.json").read_text())
    (tmp_path / "remote" / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(UnsupportedModel, match=f"NomicBert {key}=") as err:
        make_engine(tmp_path / "remote", max_num_batched_tokens=MAX_POSITIONS)
    assert "\n" not in str(err.value)
