"""GrammarCache: compiles each distinct StructuredSpec once, on its own thread, behind a bounded LRU cache.

Compiling a large schema can take a second; it runs here, off the engine loop, while other requests
decode. The cache holds futures, so concurrent requests with the same constraint share one compile.
xgrammar is imported on the first compile, and the tokenizer's token table is built then, once.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from engine.errors import InvalidRequest
from engine.sample.structured.rewrite import lengths_as_patterns
from engine.sample.structured.spec import JSON_MAX_WHITESPACE, StructuredSpec

log = logging.getLogger(__name__)

CACHE_SIZE = 256
# xgrammar's messages start with "[hh:mm:ss] /project/cpp/file.cc:123: " and C++ check noise.
_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: |Check failed: \(.*?\) is false: ")
# NOTE: xgrammar 0.2.8 writes the characters of a string with minLength / maxLength as [^"\\\r\n], which lets
# raw control characters (and tabs) into the JSON; the class of its plain strings excludes them, as JSON does.
# (rewrite.py turns such strings into patterns first; this catches any that keep the bound.)
_LENGTH_CHARS = r"[^\"\\\r\n]"
_JSON_CHARS = r"[^\0-\x1f\"\\]"


class GrammarCache:
    """submit(spec) -> Future of an xgrammar CompiledGrammar; a bad spec's future raises InvalidRequest.

    `max_whitespace`: the whitespace a JSON spec that allows whitespace may write in a row (None: any amount).
    """

    def __init__(
        self,
        *,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        capacity: int = CACHE_SIZE,
        threads: int = 2,
        max_whitespace: int | None = JSON_MAX_WHITESPACE,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_whitespace = max_whitespace
        self.vocab_size = vocab_size  # the model's: logits rows can be wider than the tokenizer's table
        self.stop_token_ids = sorted(stop_token_ids)
        self.capacity = capacity
        self.threads = threads
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._compiler: Any = None  # xgrammar.GrammarCompiler, built on the compile thread
        self.tokenizer_info: Any = None
        self.num_compiled = 0

    def submit(self, spec: StructuredSpec) -> Future:
        with self._lock:
            future = self._cache.get(spec.key)
            if future is not None:
                self._cache.move_to_end(spec.key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec.key] = future
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
            return future

    def get(self, spec: StructuredSpec) -> Any:
        """Compile now (or wait for the compile under way) and return the grammar; raises InvalidRequest."""
        return self.submit(spec).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: StructuredSpec) -> Any:
        compiler = self._ensure_compiler()
        try:
            grammar = self._build(compiler, spec, self.max_whitespace)
        except InvalidRequest:
            raise
        except Exception as exc:  # xgrammar reports every bad schema / regex / grammar as a plain error
            message = _NOISE.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
            raise InvalidRequest(
                f"{spec.param}: cannot compile the {_NAMES[spec.kind]}: {message}", param=spec.param
            ) from None
        self.num_compiled += 1
        return grammar

    def _ensure_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            self.tokenizer_info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
            # Our cache is the bounded one; xgrammar's own would grow without limit.
            self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=self.threads, cache_enabled=False)
        return self._compiler

    @staticmethod
    def _build(compiler: Any, spec: StructuredSpec, max_whitespace: int | None) -> Any:
        grammar = _grammar(spec, max_whitespace)
        if spec.prefix:
            import xgrammar as xgr

            tag = {"type": "structural_tag", "format": json.loads(spec.prefix)}
            grammar = xgr.Grammar.concat(xgr.Grammar.from_structural_tag(json.dumps(tag, ensure_ascii=False)), grammar)
        return compiler.compile_grammar(grammar)


def _grammar(spec: StructuredSpec, max_whitespace: int | None = JSON_MAX_WHITESPACE) -> Any:
    """The spec's constraint as an xgrammar Grammar (not yet compiled for the vocabulary)."""
    import xgrammar as xgr

    kind, value = spec.kind, spec.value
    # Whitespace between JSON tokens: bounded (or none at all when the spec allows none: xgrammar's compact form).
    spacing: dict[str, Any] = {
        "any_whitespace": spec.any_whitespace,
        "max_whitespace_cnt": max_whitespace if spec.any_whitespace else None,
    }
    if kind == "json":
        schema = json.dumps(lengths_as_patterns(json.loads(value)), ensure_ascii=False)
        grammar = xgr.Grammar.from_json_schema(schema, strict_mode=True, **spacing)
        return xgr.Grammar.from_ebnf(str(grammar).replace(_LENGTH_CHARS, _JSON_CHARS))
    if kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', **spacing)
    if kind == "regex":
        return xgr.Grammar.from_regex(value)
    if kind == "choice":
        # JSON string literals are EBNF string literals too (same escapes).
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(value))
        return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
    if kind == "grammar":
        # vLLM takes Lark grammars too; EBNF is told apart by its "::=".
        return xgr.Grammar.from_ebnf(value) if "::=" in value else xgr.Grammar.from_lark(value)
    if kind == "structural_tag":
        return _structural_tag(value)
    raise InvalidRequest(f"unknown constraint kind {kind!r}", param=spec.param)


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """xgrammar's token table for the model's vocabulary, special tokens blanked.

    NOTE: xgrammar reads an added special token such as <|im_start|> as its literal text, which a JSON string
    may hold; the detokenizer drops it (skip_special_tokens), so the text would no longer match the grammar.
    A blank entry is a token no grammar allows (padding ids past the tokenizer's table are blank too).
    """
    import xgrammar as xgr

    vocab = tokenizer.get_vocab()
    if hasattr(tokenizer, "backend_tokenizer"):
        vocab_type, add_prefix_space = _vocab_kind(xgr.TokenizerInfo, tokenizer, vocab)
    else:  # a tokenizer without a `tokenizers` pipeline (tiktoken, sentencepiece): xgrammar knows those
        detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        vocab_type, add_prefix_space = detected.vocab_type, detected.add_prefix_space
    special = set(getattr(tokenizer, "all_special_ids", ()))
    special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    encoded: list[str] = [""] * vocab_size
    for token, i in vocab.items():
        if i < vocab_size and i not in special:
            encoded[i] = token
    return xgr.TokenizerInfo(
        encoded, vocab_type, vocab_size=vocab_size, stop_token_ids=stop_token_ids, add_prefix_space=add_prefix_space
    )


def _vocab_kind(info: Any, tokenizer: Any, vocab: dict[str, int]) -> tuple[Any, bool]:
    """(vocab type, add_prefix_space) as xgrammar's from_huggingface derives them for a fast tokenizer.

    NOTE: from_huggingface only takes transformers' own class, and the engine's tokenizer is not one (see
    engine/text/tokenizer.py), so its steps are repeated here with its helpers (xgrammar is pinned).
    """
    metadata = info._detect_metadata_from_hf(tokenizer.backend_tokenizer.to_str())
    from_vocab = info._detect_vocab_type_from_vocab(vocab)
    if from_vocab is not None and from_vocab != metadata["vocab_type"]:
        return from_vocab, info._detect_add_prefix_space_by_encoding(tokenizer, from_vocab)
    return metadata["vocab_type"], metadata["add_prefix_space"]


def _structural_tag(value: str) -> Any:
    import xgrammar as xgr

    tag = json.loads(value)
    if isinstance(tag, dict) and "structures" in tag:
        # vLLM's first format: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}.
        items = [
            xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
            for s in tag["structures"]
        ]
        return xgr.Grammar.from_structural_tag(items, tag.get("triggers", []))
    return xgr.Grammar.from_structural_tag(value)


_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regular expression",
    "choice": "choice list",
    "grammar": "grammar",
    "structural_tag": "structural tag",
}
