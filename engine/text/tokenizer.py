"""The model's tokenizer and chat templates without transformers: `tokenizers` runs tokenizer.json, Jinja the
templates, both set up as transformers 5 sets them up (its `TokenizersBackend` and `apply_chat_template`).

Importing transformers and building its tokenizer cost about a second of every cold start; `tokenizers` and
`jinja2` load in a tenth of that. The bake saves the tokenizer through transformers (builder/bake.py), so
tokenizer.json already holds the pipeline transformers would run (post-processor, pre-tokenizer fixes); a
folder that was not baked falls back to transformers' AutoTokenizer. tests/engine/test_tokenizer.py holds
both to the same output.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

# transformers' named special tokens, in its order (all_special_tokens lists them first).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Appended to the final message when continuing it, so the rendered text can be cut right after it.
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# Names a message's reasoning goes under; templates read the first (gpt-oss ones read `thinking`).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# The manifest key with which the bake says it saved the tokenizer through transformers (and which version).
BAKE_MARK = "tokenizer_saved_by"


def saved_by_bake(folder: Path) -> bool:
    """Whether the bake's manifest says it saved the folder's tokenizer through transformers (BAKE_MARK)."""
    try:
        return BAKE_MARK in json.loads((Path(folder) / "manifest.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def load_tokenizer(model_path: str) -> Any:
    """A baked folder's tokenizer is ours; any other folder's is transformers' AutoTokenizer.

    Only the bake guarantees that tokenizer.json is what transformers runs: for a folder as the hub has it,
    transformers may pick a tokenizer class by the config's model_type whose pre-tokenizer replaces the
    file's, and the manifest says the bake saved it back.
    """
    folder = Path(model_path)
    if saved_by_bake(folder) and (folder / "tokenizer.json").is_file():
        return Tokenizer.from_folder(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


class Tokenizer:
    """The subset of transformers' tokenizer API the engine and worker call, with the same results."""

    def __init__(self, backend: Any, config: dict[str, Any], chat_template: str | dict[str, str] | None) -> None:
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.special_tokens_map = {
            name: _token_text(config[name]) for name in SPECIAL_TOKEN_NAMES if config.get(name) is not None
        }
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        extra = extra.values() if isinstance(extra, dict) else extra
        self.all_special_tokens = list(
            dict.fromkeys([*self.special_tokens_map.values(), *(_token_text(t) for t in extra)])
        )
        self.all_special_ids = [i for i in map(backend.token_to_id, self.all_special_tokens) if i is not None]
        self.added_tokens_decoder = backend.get_added_tokens_decoder()
        self.added_tokens_encoder = {t.content: i for i, t in sorted(self.added_tokens_decoder.items())}
        for name in SPECIAL_TOKEN_NAMES:  # eos_token, eos_token_id, ...: None when the config names none
            text = self.special_tokens_map.get(name)
            setattr(self, name, text)
            setattr(self, f"{name}_id", None if text is None else backend.token_to_id(text))

    @classmethod
    def from_folder(cls, folder: Path) -> Tokenizer:
        from tokenizers import Tokenizer as Backend

        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        backend = Backend.from_file(str(folder / "tokenizer.json"))
        # NOTE: a tokenizer.json may carry padding and truncation (sentence-transformers' exports: fixed 128), which
        # transformers turns off unless a call asks; on here they would pad every prompt and cut long ones silently.
        backend.no_padding()
        backend.no_truncation()
        return cls(backend, config, _chat_templates(folder, config))

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, text: str, pair: str, add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
        """Two texts as one sequence, joined by the tokenizer's pair template (transformers' `text_pair`): the ids
        and each one's text (token_type_ids: 0 for the first, 1 for the second, as the template says)."""
        encoding = self.backend_tokenizer.encode(text, pair, add_special_tokens=add_special_tokens)
        return encoding.ids, encoding.type_ids

    def decode(
        self,
        token_ids: int | list[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        text = self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        clean = clean_up_tokenization_spaces
        if clean is None:
            clean = self.clean_up_tokenization_spaces
        # transformers skips this WordPiece-era clean-up for BPE models: it would eat real spaces.
        if clean and type(self.backend_tokenizer.model).__name__ != "BPE":
            for before, after in (
                (" .", "."),
                (" ?", "?"),
                (" !", "!"),
                (" ,", ","),
                (" ' ", "'"),
                (" n't", "n't"),
                (" 'm", "'m"),
                (" 's", "'s"),
                (" 've", "'ve"),
                (" 're", "'re"),
            ):
                text = text.replace(before, after)
        return text

    def convert_ids_to_tokens(self, token_ids: int | list[int]) -> str | list[str]:
        if isinstance(token_ids, int):
            return self.backend_tokenizer.id_to_token(token_ids)
        return [self.backend_tokenizer.id_to_token(i) for i in token_ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """The template text: a name among the model's templates, the given text, or the model's default."""
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template is not None:
                return templates.get(chat_template, chat_template)
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError(f"this model has several chat templates and no default: {sorted(templates)}")
        if chat_template is not None:
            return chat_template
        if templates is None:
            raise ValueError("this model has no chat template")
        return templates

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list | None = None,
        documents: list | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> str | list[int]:
        """The conversation rendered with the template (as text, or its token ids when `tokenize`)."""
        template = self.get_chat_template(chat_template, tools)
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible")
        text = render_chat_template(
            template,
            conversation,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **{**self.special_tokens_map, **kwargs},
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def render_chat_template(
    template: str,
    conversation: list[dict[str, Any]],
    *,
    tools: list | None = None,
    documents: list | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    **kwargs: Any,
) -> str:
    """transformers' render_jinja_template for one conversation (no assistant masks)."""
    messages = [{k: v for k, v in _plain(m).items() if v is not None} for m in conversation]
    messages = [_alias_reasoning(m) for m in messages]
    final = None
    if continue_final_message:
        if not messages or not isinstance(messages[-1].get("content"), str):
            raise ValueError("continue_final_message needs a final message with text content")
        if "content" not in template:
            raise ValueError("continue_final_message is set but the chat template never reads `content`")
        final = messages[-1]["content"]
        messages[-1]["content"] = final + CONTINUE_TAG
    text = _compile(template).render(
        messages=messages,
        tools=_plain(tools),
        documents=_plain(documents),
        add_generation_prompt=add_generation_prompt,
        **_plain(kwargs),
    )
    if final is not None:
        tag = CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise ValueError("continue_final_message is set but the template dropped the final message")
        at = text.rindex(tag)
        # A template that keeps the message as given keeps the tag's space too; one that trims it does not.
        text = text[:at] if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()
    return text


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _plain(value: Any) -> Any:
    """What a template may see: JSON types only (templates are untrusted code run in a sandbox)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind in (bool, str, int, float):
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _token_text(token: Any) -> str:
    """A special token as tokenizer_config.json stores it: a string or a serialized AddedToken."""
    return token["content"] if isinstance(token, dict) else str(token)


def _chat_templates(folder: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    """chat_template.jinja and additional_chat_templates/*.jinja, else tokenizer_config.json's, as transformers
    reads them: one text, or a dict of named templates (the file's is "default")."""
    templates = {}
    if (folder / "chat_template.jinja").is_file():
        templates["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    for path in sorted((folder / "additional_chat_templates").glob("*.jinja")):
        templates[path.stem] = path.read_text(encoding="utf-8")
    if not templates:
        value = config.get("chat_template")
        if isinstance(value, list):
            return {t["name"]: t["template"] for t in value}
        return value
    return templates["default"] if list(templates) == ["default"] else templates


@lru_cache(maxsize=32)
def _compile(template: str) -> Any:
    """A template compiled in transformers' sandboxed Jinja environment (same options, filters and globals)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}` marks assistant text for training masks; rendering just keeps the text."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_keep"), [], [], body).set_lineno(lineno)

        def _keep(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """namespace() refusing underscore names, which could reach CPython internals."""

        def __init__(*args, **kwargs):
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace cannot hold the underscore name {name!r}")

    class Dict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters, which would change the prompt.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=lambda f: datetime.now().strftime(f),
        dict=Dict(),
        namespace=Namespace,
    )
    return env.from_string(template)
