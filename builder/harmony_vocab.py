"""gpt-oss's o200k BPE file for openai-harmony, written at bake time from the model's own tokenizer.json.

openai-harmony (the harmony format's renderer and parser) loads its tokenizer from o200k_base.tiktoken: from
the folder in TIKTOKEN_ENCODINGS_BASE, sha256-checked, or else by downloading it, which a serverless worker
without internet cannot do. That file is "base64(token bytes) rank" per line, ranks 0..199997, and gpt-oss's
tokenizer.json holds the same tokens (byte-level BPE, id = rank) plus its specials; so the bake writes the file
into the model folder, and the sha256 check proves it is byte for byte the published one.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

from builder.errors import BakeError
from engine.text.o200k_file import O200K_FILE, O200K_RANKS, O200K_SHA256

__all__ = ["O200K_FILE", "O200K_RANKS", "O200K_SHA256", "tiktoken_vocab", "write_harmony_vocab"]


def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's bytes_to_unicode) inverted: each printable stand-in -> its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def tiktoken_vocab(tokenizer_json: Path, num_ranks: int) -> bytes:
    """The tiktoken BPE file of the first `num_ranks` ids of a byte-level BPE tokenizer.json."""
    model = json.loads(tokenizer_json.read_text(encoding="utf-8")).get("model", {})
    if model.get("type") != "BPE":
        raise BakeError(f"the tokenizer is {model.get('type')!r}, not the byte-level BPE harmony's o200k is")
    by_id = {i: token for token, i in model["vocab"].items() if i < num_ranks}
    if len(by_id) != num_ranks:
        raise BakeError(f"the tokenizer has {len(by_id)} tokens below id {num_ranks}; harmony's o200k has {num_ranks}")
    byte_of = _byte_of_char()
    try:
        lines = [base64.b64encode(bytes(byte_of[c] for c in by_id[i])) + b" %d\n" % i for i in range(num_ranks)]
    except KeyError as exc:
        raise BakeError(f"the tokenizer is not byte-level: token character {exc.args[0]!r} is no byte") from None
    return b"".join(lines)


def write_harmony_vocab(folder: Path) -> Path:
    """Writes O200K_FILE into `folder` from its tokenizer.json; one-line BakeError unless it is o200k exactly."""
    data = tiktoken_vocab(folder / "tokenizer.json", O200K_RANKS)
    digest = hashlib.sha256(data).hexdigest()
    if digest != O200K_SHA256:
        raise BakeError(
            f"the tokenizer's first {O200K_RANKS} tokens are not o200k's (sha256 {digest[:12]}..., "
            f"openai-harmony expects {O200K_SHA256[:12]}...), so the harmony format cannot be served"
        )
    path = folder / O200K_FILE
    path.write_bytes(data)
    return path
