"""What every model family's parity test does against transformers: load a tiny checkpoint with a tokenizer, run
paged steps through each KV group's torch backend, compare logits on prompts and decode steps, and drive the
engine greedily (batched, from the prefix cache, alone); for a family that carries a state per sequence, forked
choices and a prefix hit from a state snapshot against transformers."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch

from engine.attention.mla import TorchMLABackend
from engine.attention.torch_ref import TorchRefBackend
from engine.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.core.kv.state_cache import StatePool
from engine.model.kv_spec import KVGroupSpec
from engine.model.layers.recurrent_step import RecurrentPlan, RecurrentSpec, RecurrentStep
from engine.model.loader import load_model
from engine.sample.params import SamplingParams
from tests.engine.conftest import TOKENIZER_FILES
from tests.engine.core.engine_run import run
from tests.paging import PageTable

ATOL = 1e-4


def load_family(path: Path, baked_model_path: Path, **kw):
    """The checkpoint at `path` in float32 on CPU, with the baked model's tokenizer copied in (the tiny models'
    ids stay below its vocabulary). Returns (model, spec)."""
    for name in TOKENIZER_FILES:
        if (baked_model_path / name).exists() and name != "generation_config.json":
            shutil.copy(baked_model_path / name, path / name)
    return load_model(str(path), torch.float32, torch.device("cpu"), **kw)


def load_case(case: str, tmp_path_factory, baked_model_path: Path, write) -> SimpleNamespace:
    """A parametrised fixture's "kind/family" case: write(kind, family, path) saves the checkpoint and returns the
    transformers model; the case holds it, the engine's float32 model and spec, and the folder."""
    kind, family = case.split("/")
    path = tmp_path_factory.mktemp(f"{kind}-{family}")
    hf = write(kind, family, path)
    model, spec = load_family(path, baked_model_path)
    return SimpleNamespace(kind=kind, family=family, hf=hf, model=model, spec=spec, path=path)


def reference_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def hf_greedy(hf, prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(int(reference_logits(hf, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


class Pages:
    """Each KV group's NaN-filled pools and backend over one shuffled page table; a shared-KV layer gets its
    source's pages and backend; a hybrid model's recurrent layers a state slot per request (zeros at its start)."""

    def __init__(
        self,
        groups: list[KVGroupSpec],
        num_pages: int = 128,
        page_size: int = 4,
        dtype: torch.dtype = torch.float32,
        recurrent: RecurrentSpec | None = None,
    ) -> None:
        free = list(range(num_pages))
        random.Random(0).shuffle(free)
        self.table = PageTable(page_size, free)
        self.caches, self.backends = {}, {}
        for g in groups:
            backend = (TorchMLABackend if g.latent else TorchRefBackend)("cpu", **g.attention_extras())
            shape = (num_pages, page_size, g.num_kv_heads, g.head_dim)
            for layer in g.layers:
                if g.latent is not None:  # one row store seen as (ckv, kpe), as LatentPagePool holds it
                    rows = torch.full((num_pages, page_size, g.latent.width), float("nan")).to(dtype)
                    rank = g.latent.kv_lora_rank
                    self.caches[layer] = (rows[..., :rank], rows[..., rank:])
                else:
                    self.caches[layer] = (
                        torch.full(shape, float("nan")).to(dtype),
                        torch.full(shape, float("nan")).to(dtype),
                    )
                self.backends[layer] = backend
            for reader, source in g.readers:
                self.caches[reader], self.backends[reader] = self.caches[source], backend
        self.unique = list({id(b): b for b in self.backends.values()}.values())
        self.slots: dict[str, int] = {}
        self.recurrent_plan: RecurrentPlan | None = None
        if recurrent is not None:
            state_dtype = dtype if dtype.itemsize > 1 else torch.float32  # FP8 pages: the state stays wide
            self.state, self.recurrent_plan = StatePool(recurrent, 16, state_dtype, "cpu"), RecurrentPlan()
            for layer, slots in zip(recurrent.layers, self.state.layer_states, strict=True):
                self.caches[layer], self.backends[layer] = slots, self.recurrent_plan

    def run(
        self, model, batch: list[tuple[str, list[int]]], positions: torch.Tensor | None = None, **extra
    ) -> torch.Tensor:
        """One paged step of `batch`; positions: the model's own (3-D rotary ones) instead of the table's; extra:
        more forward arguments (image_embeds)."""
        table_positions, meta = self.table.step([(r, len(t)) for r, t in batch])
        positions = table_positions if positions is None else positions
        for b in self.unique:
            b.plan(meta)
        if self.recurrent_plan is not None:
            slots = [self.slots.setdefault(r, len(self.slots)) for r, _ in batch]
            starts = [sum(len(t) for _, t in batch[:i]) for i in range(len(batch))]
            self.recurrent_plan.plan(
                RecurrentStep(
                    spans=[(s, len(t)) for s, (_, t) in zip(starts, batch, strict=True)],
                    slots=slots,
                    captures=[],
                    slot_index=torch.tensor(slots),
                    is_decode=all(len(t) == 1 for _, t in batch),
                )
            )
        return self.forward(model, batch, positions, meta, **extra)

    def forward(
        self, model, batch: list[tuple[str, list[int]]], positions: torch.Tensor, meta, **extra
    ) -> torch.Tensor:
        """The logits of a step whose positions and metadata are made and whose backends are planned."""
        layers = sorted(self.caches)
        with torch.inference_mode():
            hidden = model(
                torch.tensor([t for _, ts in batch for t in ts]),
                positions,
                meta,
                [self.caches[n] for n in layers],
                [self.backends[n] for n in layers],
                **extra,
            )
            return model.compute_logits(hidden)


def check_prefill_and_decode(
    model, spec, hf, lengths=(5, 13, 30), decode_steps: int = 10, vocab: int = 128, atol: float = ATOL
) -> None:
    """Prompts of `lengths` prefilled in one step, then decoded together: every logit row equals transformers'
    (within `atol`)."""
    gen = torch.Generator().manual_seed(1)
    prompts = {f"r{i}": torch.randint(0, vocab, (n,), generator=gen).tolist() for i, n in enumerate(lengths)}
    pages = Pages(spec.kv_groups, recurrent=spec.recurrent)
    logits = pages.run(model, list(prompts.items()))
    row = 0
    for tokens in prompts.values():
        torch.testing.assert_close(logits[row : row + len(tokens)], reference_logits(hf, tokens), atol=atol, rtol=1e-4)
        row += len(tokens)
    seqs = {r: list(t) for r, t in prompts.items()}
    for _ in range(decode_steps):
        nxt = {r: int(torch.randint(0, vocab, (1,), generator=gen)) for r in seqs}
        logits = pages.run(model, [(r, [t]) for r, t in nxt.items()])
        for i, (r, t) in enumerate(nxt.items()):
            seqs[r].append(t)
            torch.testing.assert_close(logits[i], reference_logits(hf, seqs[r])[-1], atol=atol, rtol=1e-4)


def tiny_engine(path: Path, **kw) -> LLMEngine:
    """float32, pages of 4 tokens, a 16-token step budget (so longer prompts prefill in chunks)."""
    kw = {"dtype": "float32", "page_size": 4, "max_num_seqs": 8, "max_num_batched_tokens": 16, "num_kv_pages": 64, **kw}
    return LLMEngine(EngineConfig(model_path=str(path), **kw))


def greedy(engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    """Each prompt's greedy tokens, run together; every step the KV counts are rebuilt and no page leaks."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for r, prompt in prompts.items():
        engine.add_request(r, prompt, params)
    out: dict[str, list[int]] = {r: [] for r in prompts}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.outputs[0].token_ids
        engine.kv.check([s for g in engine.scheduler.running for s in g.seqs])
    assert engine.kv.num_free == [a.num_pages for a in engine.kv.allocators], "pages leaked"
    if engine.kv.state is not None:
        engine.kv.state.check([])  # every state slot free or a snapshot
    return out


def mixed_prompts(seed: int = 2, vocab: int = 128) -> dict[str, list[int]]:
    """Prompts of 11, 19 and 33 tokens sharing a 10-token prefix, and a short one."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (10,), generator=gen).tolist()
    prompts = {f"p{n}": shared + torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (1, 9, 23)}
    prompts["short"] = [5, 6, 7]
    return prompts


def check_engine_greedy(path: Path, hf, max_tokens: int = 10, **kw) -> dict[str, list[int]]:
    """Through the engine: mixed prompts batched (chunked prefill), again from the prefix cache, and each alone
    give transformers' greedy tokens. Returns the batched tokens."""
    prompts = mixed_prompts()
    engine = tiny_engine(path, **kw)
    batched = greedy(engine, prompts, max_tokens)
    assert greedy(engine, prompts, max_tokens) == batched  # again, from the prefix cache
    for r, prompt in prompts.items():
        assert batched[r] == hf_greedy(hf, prompt, max_tokens), r
        assert greedy(tiny_engine(path, **kw), {r: prompt}, max_tokens) == {r: batched[r]}
    return batched


def check_preemption(path: Path, vocab: int = 128, **kw) -> None:
    """A pool too small for every request at once, prefix caching off: requests are preempted and recomputed (a
    shared-KV layer reads the recomputed pages of its source), and every answer equals the roomy run's. kw: more
    engine settings for both runs (an FP8 KV cache)."""
    gen = torch.Generator().manual_seed(3)
    prompts = {f"q{i}": torch.randint(3, vocab, (n,), generator=gen).tolist() for i, n in enumerate((14, 19, 22, 9))}
    roomy = greedy(tiny_engine(path, **kw), prompts, 12)
    tight = tiny_engine(path, **{**kw, "max_num_seqs": 4, "num_kv_pages": 20, "enable_prefix_caching": False})
    squeezed = greedy(tight, prompts, 12)
    assert tight.scheduler.num_preemptions > 0
    assert squeezed == roomy


def check_forked_choices(family: SimpleNamespace, prompt_length: int = 19) -> None:
    """A family that carries a state per sequence: n=2 sampled choices fork from one prefilled prompt, and every
    sampled token's logprob is transformers' for that choice's own context (a shared or unforked state would give
    the other choice's)."""
    prompt = torch.randint(3, 128, (prompt_length,), generator=torch.Generator().manual_seed(8)).tolist()
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, logprobs=0, ignore_eos=True)
    got = run(tiny_engine(family.path), {"f": (prompt, params)})["f"]
    assert got.choices[0].token_ids != got.choices[1].token_ids
    for choice in got.choices.values():
        tokens = prompt + choice.token_ids
        ref = torch.log_softmax(reference_logits(family.hf, tokens), -1)
        for i, (t, lp) in enumerate(zip(choice.token_ids, choice.logprobs, strict=True)):
            assert lp.chosen.token_id == t
            assert abs(lp.chosen.logprob - float(ref[len(prompt) - 1 + i, t])) < 1e-4


def check_prefix_hit_from_snapshot(family: SimpleNamespace) -> None:
    """A family that carries a state per sequence: a second turn repeating the first turn's 21 tokens and its answer
    hits the cache up to the last page boundary that has a state snapshot (prefill's last, or the latest decode one),
    and its tokens are a cold engine's and transformers', each with transformers' logprob (greedy tokens alone can
    survive a lost state: an attention layer still sees the prefix)."""
    gen = torch.Generator().manual_seed(7)
    first = torch.randint(3, 128, (21,), generator=gen).tolist()
    engine = tiny_engine(family.path)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True)
    answer = run(engine, {"t1": (first, params)})["t1"].choices[0].token_ids
    second = first + answer + torch.randint(3, 128, (9,), generator=gen).tolist()
    warm = run(engine, {"t2": (second, params)})["t2"]
    cold = run(tiny_engine(family.path), {"t2": (second, params)})["t2"]
    assert warm.last.num_cached_tokens >= 24  # past the first prompt: a decode-time snapshot
    assert warm.last.num_cached_tokens % 4 == 0
    assert cold.last.num_cached_tokens == 0
    tokens = warm.choices[0].token_ids
    assert tokens == cold.choices[0].token_ids == hf_greedy(family.hf, second, 6)
    ref = torch.log_softmax(reference_logits(family.hf, second + tokens), -1)
    for i, (t, lp) in enumerate(zip(tokens, warm.choices[0].logprobs, strict=True)):
        assert abs(lp.chosen.logprob - float(ref[len(second) - 1 + i, t])) < 1e-4
    engine.kv.state.check([])
