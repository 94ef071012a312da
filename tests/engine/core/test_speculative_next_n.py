"""Speculative decoding (method mtp) with the next-n prediction layer DeepSeek-V3 and GLM-4.5 checkpoints ship (random
model.layers.{n}.* tensors added to tiny checkpoints): the head's guesses equal a plain-torch reference of it (enorm,
hnorm, eh_proj and shared_head written out here, its decoder layer transformers' layer of the family with the next-n
weights) fed transformers' final hidden states; greedy output token for token as without speculation, with guesses
accepted, at k = 1 and 2, batched beside beam search and n=2, and under preemption; a checkpoint without the layer
fails the start in one line."""

from __future__ import annotations

import pytest
import torch

from engine.config import SpeculativeConfig
from engine.errors import StartupError
from tests.engine.core.hybrid_spec import hybrid_requests, run_checked, tokens
from tests.engine.core.next_n_spec import KINDS, add_agreeing_next_n, add_random_next_n, build_target
from tests.engine.core.test_speculative_mtp import first_guesses
from tests.engine.model.family_parity import tiny_engine


def mtp(k: int) -> SpeculativeConfig:
    return SpeculativeConfig(method="mtp", num_speculative_tokens=k, disable_by_batch_size=256)


@pytest.fixture(scope="module", params=KINDS)
def target(request, tmp_path_factory, baked_model_path):
    """A three-layer target with random next-n tensors: DeepSeek's with its own embedding and head, GLM's without
    (the target's are read)."""
    path = tmp_path_factory.mktemp(f"{request.param}-next-n")
    hf = build_target(request.param, path, baked_model_path)
    tensors, layer = add_random_next_n(path, hf, own=request.param == "deepseek_v3")
    return path, hf, tensors, layer


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def head_reference(t: dict[str, torch.Tensor], layer, hf, tokens: list[int], hidden: torch.Tensor, steps: int):
    """The head's greedy guesses after `tokens` (the prompt and the target's next token): position p reads token
    p + 1 and the target's final hidden state of p, then each guess its own previous output before shared_head.norm."""
    eps = hf.config.rms_norm_eps
    embed = t.get("embed_tokens.weight", hf.model.embed_tokens.weight)
    head = t.get("shared_head.head.weight", hf.lm_head.weight)
    ids, features, guesses = list(tokens[1:]), list(hidden), []
    with torch.no_grad():
        for _ in range(steps):
            n = len(ids)
            e, h = _norm(embed[ids], t["enorm.weight"], eps), _norm(torch.stack(features), t["hnorm.weight"], eps)
            x = (torch.cat([e, h], -1) @ t["eh_proj.weight"].t())[None]
            positions = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            out = layer(
                x, position_embeddings=hf.model.rotary_emb(x, positions), attention_mask=mask, position_ids=positions
            )
            out = (out[0] if isinstance(out, tuple) else out)[0]
            guesses.append(int((_norm(out[-1], t["shared_head.norm.weight"], eps) @ head.t()).argmax()))
            ids.append(guesses[-1])
            features.append(out[-1])
    return guesses


def test_the_heads_guesses_equal_a_reference_fed_the_targets_final_hidden_states(target):
    path, hf, tensors, layer = target
    engine = tiny_engine(path, speculative=mtp(3), max_num_batched_tokens=64)
    prompts, seqs, guesses = first_guesses(engine, (6, 19, 33))
    for i, (prompt, seq) in enumerate(zip(prompts, seqs, strict=True)):
        with torch.no_grad():
            next_token = int(hf(torch.tensor([prompt])).logits[0, -1].argmax())
            hidden = hf.model(torch.tensor([prompt])).last_hidden_state[0]  # after the final norm
        assert seq.token_ids[len(prompt)] == next_token
        assert guesses[i] == head_reference(tensors, layer, hf, prompt + [next_token], hidden, steps=3)
        engine.abort(f"r{i}")
    assert len({g for gs in guesses for g in gs}) > 1  # the guesses are the head's, not one token everywhere


ONE_LAYER = {
    "deepseek_v3": dict(num_hidden_layers=1, first_k_dense_replace=0),
    "glm4_moe": dict(num_hidden_layers=1, first_k_dense_replace=0),
    "glm4_moe_lite": dict(num_hidden_layers=1, mlp_layer_types=["sparse"]),
}


@pytest.mark.parametrize("kind", list(ONE_LAYER))
def test_greedy_equals_without_speculation_with_guesses_accepted(kind, tmp_path, baked_model_path):
    """A one-layer target (its layer MoE) whose next-n layer agrees with it often (next_n_spec.add_agreeing_next_n)."""
    hf = build_target(kind, tmp_path, baked_model_path, **ONE_LAYER[kind])
    add_agreeing_next_n(tmp_path, hf)
    requests = hybrid_requests()
    want = tokens(run_checked(tiny_engine(tmp_path), requests))
    for k in (1, 2):
        spec = tiny_engine(tmp_path, speculative=mtp(k))
        assert tokens(run_checked(spec, requests, join_at={"p2": 3, "beam": 2})) == want
        stats = spec.stats()
        assert spec.describe()["speculative"]["method"] == "mtp"
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"], stats
        head = spec.speculator.proposer
        assert head.kv.num_free == [a.num_pages for a in head.kv.allocators]  # every head page given back
        head.kv.check()
    # Preempted and recomputed on a small pool.
    picked = {r: requests[r] for r in ("p0", "p1", "p2", "loop")}
    tight = tiny_engine(tmp_path, speculative=mtp(2), max_num_seqs=4, num_kv_pages=20, enable_prefix_caching=False)
    assert tokens(run_checked(tight, picked)) == {r: want[r] for r in picked}
    assert tight.scheduler.num_preemptions > 0 and tight.stats()["spec_accepted_tokens"] > 0


def test_a_checkpoint_without_the_next_n_layer_fails_the_start_in_one_line(tmp_path, baked_model_path):
    build_target("deepseek_v3", tmp_path, baked_model_path)
    with pytest.raises(StartupError, match="next-n") as info:
        tiny_engine(tmp_path, speculative=mtp(1))
    assert "\n" not in str(info.value) and "has none" in str(info.value)
