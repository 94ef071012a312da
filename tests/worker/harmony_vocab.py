"""A real gpt-oss tokenizer without the hub: o200k from the npm package js-tiktoken (pinned in js/), turned into
openai-harmony's o200k_base.tiktoken and into a tokenizer.json with gpt-oss's special tokens at their ids.

js-tiktoken's `dist/ranks/o200k_base.cjs` holds the ranks as lines "<x> <first rank> <base64 token> ...", ranks
consecutive; writing "base64 rank" per token gives exactly the file openai-harmony checks by sha256.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from engine.text.o200k_file import O200K_FILE, O200K_RANKS, O200K_SHA256

JS = Path(__file__).resolve().parents[2] / "js"
RANKS_JS = JS / "node_modules" / "js-tiktoken" / "dist" / "ranks" / "o200k_base.cjs"
NUM_TOKENS = 201088  # gpt-oss's vocabulary: o200k's ranks plus its special and reserved tokens


def js_o200k() -> dict:
    """The parsed o200k_base.cjs, installing js/node_modules from the lock file when missing (skips without npm)."""
    if not RANKS_JS.is_file():
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip("npm is not installed: the offline o200k vocabulary comes from js-tiktoken")
        result = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"], cwd=JS, capture_output=True, text=True, timeout=300
        )
        if result.returncode != 0:
            pytest.skip(f"npm ci failed: {result.stderr.strip().splitlines()[-1:]}")
    text = RANKS_JS.read_text(encoding="utf-8")
    return json.loads(text[text.index("{") : text.rindex("}") + 1])


def tiktoken_lines(data: dict) -> bytes:
    lines = []
    for line in data["bpe_ranks"].split("\n"):
        parts = line.split(" ")
        if len(parts) < 3:
            continue
        first = int(parts[1])
        lines += [b"%s %d\n" % (token.encode(), first + i) for i, token in enumerate(parts[2:])]
    return b"".join(lines)


def special_tokens(folder: Path) -> dict[int, str]:
    """gpt-oss's specials by id, named as openai-harmony's own o200k_harmony encoding names them."""
    from worker.openai.harmony.encoding import harmony_encoding

    encoding = harmony_encoding(str(folder))
    return {i: encoding.decode([i]) for i in range(O200K_RANKS, NUM_TOKENS)}


def build_tokenizer_json(tiktoken_file: Path, pattern: str, specials: dict[int, str]) -> str:
    """A byte-level BPE tokenizer.json as transformers' TikTokenConverter makes it, specials added at their ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    ranks = {
        base64.b64decode(token): int(rank)
        for token, rank in (line.split() for line in tiktoken_file.read_text().splitlines())
    }
    encoder = bytes_to_unicode()

    def chars(b: bytes) -> str:
        return "".join(encoder[x] for x in b)

    merges = []
    for token, rank in ranks.items():
        if len(token) == 1:
            continue
        local = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in ranks and token[k:] in ranks]
        local.sort(key=lambda pair: (ranks[pair[0]], ranks[pair[1]]))
        merges += [(left, right, rank) for left, right in local]
    merges.sort(key=lambda m: m[2])
    vocab = {chars(token): rank for token, rank in ranks.items()}
    tokenizer = Tokenizer(BPE(vocab, [(chars(a), chars(b)) for a, b, _ in merges], fuse_unk=False, ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    for i in sorted(specials):  # added in id order, so each lands on its own id
        assert tokenizer.add_special_tokens([AddedToken(specials[i], normalized=False, special=True)]) == 1
        assert tokenizer.token_to_id(specials[i]) == i, specials[i]
    return tokenizer.to_str()


def o200k_folder(cache: Path) -> Path:
    """A folder holding o200k_base.tiktoken (hash-checked) and gpt-oss's tokenizer.json, built once per cache."""
    cache.mkdir(parents=True, exist_ok=True)
    tiktoken_file, tokenizer_file = cache / O200K_FILE, cache / "tokenizer.json"
    if not tokenizer_file.is_file():
        import hashlib

        data = js_o200k()
        lines = tiktoken_lines(data)
        assert hashlib.sha256(lines).hexdigest() == O200K_SHA256
        tiktoken_file.write_bytes(lines)
        tokenizer_file.write_text(build_tokenizer_json(tiktoken_file, data["pat_str"], special_tokens(cache)))
    return cache
