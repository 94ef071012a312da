"""Incremental detokenization: ours (engine/text/detokenizer.py: a short window decoded per token, vLLM's
prefix/read offsets) against the tokenizers library's own `decoders.DecodeStream`, token by token over the same
ids, on the bake's tokenizer. Prints microseconds per token (best of --repeat) and whether the two texts agree.

    python bench/detokenize.py                       the default bake, a mixed text (code, accents, CJK, emoji)
    python bench/detokenize.py --model /path/to/bake --repeat 5
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.text.detokenizer import Detokenizer  # noqa: E402
from engine.text.tokenizer import load_tokenizer  # noqa: E402

TEXT = (
    "def mean(xs: list[float]) -> float:\n    return sum(xs) / len(xs)  # naïve, café, Zürich\n"
    "東京は日本の首都です。 Emoji: 🤗🚀👩‍👩‍👧 and the end of a line.\n\n"
) * 40


def ours(tokenizer, ids: list[int]) -> str:
    detok = Detokenizer(tokenizer=tokenizer)
    text = "".join(detok.push([i]).text for i in ids)
    return text + detok.flush()


def library(tokenizer, ids: list[int]) -> str:
    from tokenizers.decoders import DecodeStream

    stream, backend, parts = DecodeStream(skip_special_tokens=True), tokenizer.backend_tokenizer, []
    for i in ids:
        chunk = stream.step(backend, i)
        if chunk is not None:
            parts.append(chunk)
    return "".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / ".models" / "model")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    tokenizer = load_tokenizer(str(args.model))
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    want = tokenizer.decode(ids, skip_special_tokens=True)
    print(f"{len(ids)} tokens; runs alternate, best of {args.repeat}")
    best = {"ours": float("inf"), "DecodeStream": float("inf")}
    for _ in range(args.repeat):
        for name, run in (("ours", ours), ("DecodeStream", library)):
            started = time.perf_counter()
            text = run(tokenizer, ids)
            best[name] = min(best[name], time.perf_counter() - started)
            if text != want:
                print(f"{name}: the streamed text differs from decode() of all ids")
    for name, seconds in best.items():
        print(f"{name}: {1e6 * seconds / len(ids):.1f} us a token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
