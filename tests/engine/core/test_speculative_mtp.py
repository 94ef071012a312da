"""Speculative decoding with the MTP head a Qwen3.5 / Qwen3-Next checkpoint ships (random mtp.* tensors added to tiny
hybrid checkpoints): the head's guesses equal a plain-torch reference of it (its fc, norms and concat written out
here, its decoder layer transformers' full-attention layer with the mtp weights) fed transformers' final hidden
states; greedy output token for token as without speculation, batched with beam search, n=2, max_tokens inside a
proposal, under preemption and after a prefix-cache hit; a model without mtp weights fails the start in one line."""

from __future__ import annotations

import copy

import pytest
import torch

from engine.config import SpeculativeConfig
from engine.errors import StartupError
from tests.engine.core.engine_run import greedy
from tests.engine.core.hybrid_spec import add_mtp_weights, hybrid_requests, run_checked, tokens
from tests.engine.model.family_parity import load_family, tiny_engine
from tests.engine.model.hybrid_checkpoints import build_hybrid_checkpoint

MTP = SpeculativeConfig(method="mtp", num_speculative_tokens=3, disable_by_batch_size=256)


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_next"])
def target(request, tmp_path_factory, baked_model_path):
    path = tmp_path_factory.mktemp(f"{request.param}-mtp")
    hf = build_hybrid_checkpoint(request.param, path)
    load_family(path, baked_model_path)
    return path, hf, add_mtp_weights(path, hf)


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The family's zero-centred RMSNorm: x / rms(x) * (1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def head_reference(mtp: dict[str, torch.Tensor], hf, tokens: list[int], hidden: torch.Tensor, steps: int) -> list[int]:
    """The head's greedy guesses after `tokens` (the prompt and the target's next token): position p reads token
    p + 1 and the target's final hidden state of p, then each guess its own previous normed output."""
    eps = hf.config.rms_norm_eps
    full = hf.config.layer_types.index("full_attention")
    layer = copy.deepcopy(hf.model.layers[full])
    layer.load_state_dict({k.removeprefix("mtp.layers.0."): v for k, v in mtp.items() if k.startswith("mtp.layers.0.")})
    embed, head = hf.model.embed_tokens.weight, hf.lm_head.weight
    ids, features, guesses = list(tokens[1:]), list(hidden), []
    with torch.no_grad():
        for _ in range(steps):
            n = len(ids)
            x = torch.cat(
                [
                    _norm(embed[ids], mtp["mtp.pre_fc_norm_embedding.weight"], eps),
                    _norm(torch.stack(features), mtp["mtp.pre_fc_norm_hidden.weight"], eps),
                ],
                -1,
            )
            x = (x @ mtp["mtp.fc.weight"].t())[None]
            positions = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            out = layer(
                x, position_embeddings=hf.model.rotary_emb(x, positions), attention_mask=mask, position_ids=positions
            )
            out = _norm((out[0] if isinstance(out, tuple) else out)[0], mtp["mtp.norm.weight"], eps)
            guesses.append(int((out[-1] @ head.t()).argmax()))
            ids.append(guesses[-1])
            features.append(out[-1])
    return guesses


def first_guesses(engine, lengths: tuple[int, ...], k: int = 3):
    """Random prompts of `lengths` prefilled in one step (the head catches up on them and guesses once for each),
    then k guesses for each: (prompts, their sequences, the guesses)."""
    prompts = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(8, ignore_eos=True))
    engine.step()
    seqs = [engine._groups[f"r{i}"].seqs[0] for i in range(len(prompts))]
    return prompts, seqs, engine.speculator.proposer.propose(seqs, [k] * len(seqs))


def test_the_heads_guesses_equal_a_reference_fed_the_targets_final_hidden_states(target):
    path, hf, mtp = target
    engine = tiny_engine(path, speculative=MTP, max_num_batched_tokens=64)
    prompts, seqs, guesses = first_guesses(engine, (6, 19, 33))
    for i, (prompt, seq) in enumerate(zip(prompts, seqs, strict=True)):
        with torch.no_grad():
            out = hf(torch.tensor([prompt]), output_hidden_states=True)
        hidden = hf.model(torch.tensor([prompt])).last_hidden_state[0]  # after the final norm
        next_token = int(out.logits[0, -1].argmax())
        assert seq.token_ids[len(prompt)] == next_token
        assert guesses[i] == head_reference(mtp, hf, prompt + [next_token], hidden.detach(), steps=3)
        engine.abort(f"r{i}")


def test_greedy_equals_without_speculation(target):
    path, _, _ = target
    requests = hybrid_requests()
    want = tokens(run_checked(tiny_engine(path), requests))
    spec = tiny_engine(path, speculative=MTP)
    assert tokens(run_checked(spec, requests, join_at={"p2": 3, "beam": 2})) == want
    assert spec.stats()["spec_verify_steps"] > 0 and spec.describe()["speculative"]["method"] == "mtp"
    head = spec.speculator.proposer
    assert head.kv.num_free == [a.num_pages for a in head.kv.allocators]  # every head page given back
    head.kv.check()
    # Preempted and recomputed on a small pool; then a second turn from the prefix cache.
    picked = {r: requests[r] for r in ("p0", "p1", "p2", "loop")}
    tight = tiny_engine(path, speculative=MTP, max_num_seqs=4, num_kv_pages=20, enable_prefix_caching=False)
    assert tokens(run_checked(tight, picked)) == {r: want[r] for r in picked}
    assert tight.scheduler.num_preemptions > 0 and tight.stats()["spec_verify_steps"] > 0
    second = requests["p1"][0] + want["p1"][0] + [5, 6, 7]
    cold = run_checked(tiny_engine(path), {"t2": (second, greedy(10, ignore_eos=True))})["t2"]
    warm = run_checked(spec, {"t2": (second, greedy(10, ignore_eos=True))})["t2"]
    assert warm.last.num_cached_tokens > len(requests["p1"][0])
    assert warm.choices[0].token_ids == cold.choices[0].token_ids


def test_a_model_without_mtp_weights_fails_the_start_in_one_line(tmp_path, baked_model_path, tiny_model_path):
    build_hybrid_checkpoint("qwen3_5_text", tmp_path)
    load_family(tmp_path, baked_model_path)
    for path in (tmp_path, tiny_model_path):
        with pytest.raises(StartupError, match="mtp") as info:
            tiny_engine(path, speculative=MTP)
        assert "\n" not in str(info.value) and "has none" in str(info.value)
