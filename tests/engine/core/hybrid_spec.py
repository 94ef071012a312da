"""Speculation on tiny hybrid (Gated DeltaNet, Mamba2) targets: their checkpoints with the baked tokenizer, an
oracle proposer that knows the plain answer and errs where told, and the requests the hybrid speculative tests
send."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.core.engine import LLMEngine
from engine.core.scheduling.sequence import Sequence
from engine.model.layers.delta_rule import materialise
from engine.sample.params import SamplingParams
from tests.engine.core.engine_run import greedy, run
from tests.engine.model.family_parity import load_family, tiny_engine
from tests.engine.model.hybrid_checkpoints import build_hybrid_checkpoint
from tests.engine.model.mamba_checkpoints import (
    build_falcon_h1_checkpoint,
    build_granite_hybrid_checkpoint,
    build_nemotron_h_checkpoint,
)


def hybrid_target(kind: str, path: Path, baked_model_path: Path, mtp: bool = False, **change) -> Path:
    """A tiny random `kind` checkpoint at `path` (config `change`d) with the baked model's tokenizer (and random mtp.*
    tensors). kind "nemotron_h", "falcon_h1" or "granitemoehybrid": a Nemotron-H, Falcon-H1 or Granite 4.0-H checkpoint
    (Mamba2 state slots)."""
    mamba = {
        "nemotron_h": build_nemotron_h_checkpoint,
        "falcon_h1": build_falcon_h1_checkpoint,
        "granitemoehybrid": build_granite_hybrid_checkpoint,
    }
    hf = mamba[kind](path, **change) if kind in mamba else build_hybrid_checkpoint(kind, path, **change)
    load_family(path, baked_model_path)
    if mtp:
        add_mtp_weights(path, hf)
    return path


def hybrid_requests(seed: int = 5) -> dict[str, tuple[list[int], SamplingParams]]:
    """Prompts that repeat and that do not, a beam search (which never speculates) beside them, n=2 choices, and
    max_tokens that end inside a proposal."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (5, 13, 22)]
    requests = {f"p{i}": (p, greedy(24, ignore_eos=True)) for i, p in enumerate(prompts)}
    requests["loop"] = ([7, 8, 9, 10, 11] * 4, greedy(24, ignore_eos=True))
    requests["n2"] = (prompts[1], greedy(18, n=2, ignore_eos=True))
    requests["beam"] = (prompts[0], SamplingParams(temperature=0.0, max_tokens=8, n=2, use_beam_search=True))
    for m in (1, 2, 3, 6):
        requests[f"max{m}"] = (prompts[2], greedy(m, ignore_eos=True))
    return requests


def tokens(results) -> dict[str, list[list[int]]]:
    return {r: [c.token_ids for _, c in sorted(res.choices.items())] for r, res in results.items()}


def run_checked(engine: LLMEngine, requests: dict, **kw) -> dict:
    """run(), with the state slots checked every step too (each free, a snapshot, or one sequence's)."""
    original = engine.step

    def step():
        out = original()
        seqs = [s for g in engine.scheduler.running for s in g.seqs]
        engine.kv.check(seqs)
        for seq in seqs:  # a page's hash is of its tokens as they are (never of a page a rejected token ended)
            fresh = Sequence(seq_id=0, token_ids=list(seq.token_ids), num_prompt_tokens=seq.num_prompt_tokens)
            assert seq.page_hashes == fresh.hashes(len(seq.page_hashes), engine.kv.page_size)
        return out

    engine.step = step
    try:
        return run(engine, requests, **kw)
    finally:
        engine.step = original


class Oracle:
    """A proposer that knows each prompt's plain greedy answer and proposes it, except that at a sequence of L
    tokens its (L % (k + 2))-th guess is wrong: every acceptance length from 0 to k occurs."""

    name = "oracle"
    deterministic = True

    def __init__(self, answers: dict[tuple[int, ...], list[int]], k: int) -> None:
        self.answers, self.k = answers, k

    def propose(self, seqs, limits):
        out = []
        for seq, limit in zip(seqs, limits, strict=True):
            prompt = tuple(seq.token_ids[: seq.num_prompt_tokens])
            full = list(prompt) + self.answers.get(prompt, [])
            length = seq.num_tokens
            guess = full[length : length + min(limit, self.k)]
            wrong = length % (self.k + 2)
            if wrong < len(guess):
                guess[wrong] = (guess[wrong] + 1) % 128
            out.append(guess)
        return out

    def retain(self, live) -> None:
        pass

    def describe(self) -> dict:
        return {}


def oracle_engine(path: Path, answers: dict[tuple[int, ...], list[int]], k: int = 4, **kw) -> LLMEngine:
    """A tiny engine speculating with Oracle (on an n-gram Speculator's bookkeeping)."""
    from engine.config import SpeculativeConfig

    engine = tiny_engine(
        path, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=k, disable_by_batch_size=256), **kw
    )
    engine.speculator.proposer = Oracle(answers, k)
    return engine


def reference_snapshots(path: Path, texts: list[list[int]]) -> LLMEngine:
    """A plain engine that prefilled each of `texts` four tokens a step: it holds a snapshot of the state at every
    page boundary of them (pages of 4), the reference for the snapshots a speculating engine takes."""
    engine = tiny_engine(path, max_num_batched_tokens=4, max_num_seqs=256, num_kv_pages=512)
    run(engine, {f"r{i}": (text, greedy(1)) for i, text in enumerate(texts)})
    return engine


def check_snapshots(engine: LLMEngine, reference: LLMEngine) -> int:
    """Every snapshot the engine registered under tokens the reference prefilled holds the state the reference has
    after them (one that saw a rejected token would not: its hash is of the accepted tokens, which the reference
    has); returns how many were compared. (Beams that were dropped leave snapshots the reference never saw.)"""
    pool, ref = engine.state_pool, reference.state_pool
    # A delta-rule slot holds S / c and log c (two forms of one state); a Mamba2 slot holds its state as it is.
    state = (lambda held: held) if engine.spec.recurrent.kind == "mamba2" else materialise
    compared = 0
    for h, slot in engine.kv.state._snapshots.items():
        other = reference.kv.state._snapshots.get(h)
        if other is None:
            continue
        torch.testing.assert_close(state(pool.delta[:, slot]), state(ref.delta[:, other]), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(pool.conv[:, slot], ref.conv[:, other], atol=1e-4, rtol=1e-4)
        compared += 1
    return compared


def add_mtp_weights(path: Path, hf, seed: int = 1) -> dict[str, torch.Tensor]:
    """random_mtp_weights saved into the checkpoint at `path`; returns them."""
    from safetensors.torch import load_file, save_file

    mtp = random_mtp_weights(hf, seed)
    file = path / "model.safetensors"
    save_file({**load_file(str(file)), **mtp}, str(file), metadata={"format": "pt"})
    return mtp


def random_mtp_weights(hf, seed: int = 1) -> dict[str, torch.Tensor]:
    """Random mtp.* tensors in the hub's layout (transformers drops them): fc, the two pre-fc norms, the final norm
    and layer 0, shaped as the model's full-attention layer (its MLP or experts)."""
    gen = torch.Generator().manual_seed(seed)
    full = hf.config.layer_types.index("full_attention")
    h = hf.config.hidden_size
    mtp = {
        f"mtp.layers.0.{name.split(f'layers.{full}.', 1)[1]}": t
        for name, t in hf.state_dict().items()
        if f"layers.{full}." in name
    }
    mtp |= {
        "mtp.fc.weight": torch.empty(h, 2 * h),
        "mtp.norm.weight": torch.empty(h),
        "mtp.pre_fc_norm_embedding.weight": torch.empty(h),
        "mtp.pre_fc_norm_hidden.weight": torch.empty(h),
    }
    for name, t in mtp.items():
        scale = 0.2 if "norm" in name else 0.15
        mtp[name] = (torch.randn(t.shape, generator=gen) * scale).float().contiguous()
    return mtp
