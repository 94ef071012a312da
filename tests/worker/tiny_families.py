"""Tiny random-weight models of each family with the default model's tokenizer (the family's markup added as
tokens, special where the family's vocabulary has them special) and a chat template written to the family's
published format, served in process: a Runtime over an AsyncEngine on the CPU."""

from __future__ import annotations

import shutil
from pathlib import Path

from family_templates import LLAMA31, MISTRAL_V3, QWEN3, QWEN25

from worker.openai.responses.store import ResponseStore
from worker.runtime import Runtime
from worker.settings import baked_model_name, load_settings
from worker.shutdown import Drain

# family -> (transformers config class, chat template, added tokens: (text, special))
FAMILIES = {
    "qwen2": ("Qwen2Config", QWEN25, [("<tool_call>", False), ("</tool_call>", False)]),
    "qwen3": (
        "Qwen3Config",
        QWEN3,
        [("<tool_call>", False), ("</tool_call>", False), ("<think>", False), ("</think>", False)],
    ),
    "llama": (
        "LlamaConfig",
        LLAMA31,
        [("<|python_tag|>", True), ("<|start_header_id|>", True), ("<|end_header_id|>", True), ("<|eot_id|>", True)],
    ),
    "mistral": (
        "MistralConfig",
        MISTRAL_V3,
        [
            ("[TOOL_CALLS]", True),
            ("[AVAILABLE_TOOLS]", True),
            ("[/AVAILABLE_TOOLS]", True),
            ("[INST]", True),
            ("[/INST]", True),
            ("[TOOL_RESULTS]", True),
            ("[/TOOL_RESULTS]", True),
        ],
    ),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def build_family(family: str, baked: Path, folder: Path) -> Path:
    """A bake of `family`: random weights, the baked tokenizer plus the family's tokens and template, through
    the real builder (which saves the tokenizer the way the worker reads it). Returns the baked folder."""
    import torch
    import transformers as tf
    from tokenizers import AddedToken

    from builder.bake import bake
    from builder.sources import resolve

    config_class, template, added = FAMILIES[family]
    source = folder / "source"
    source.mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy(baked / name, source / name)
    tokenizer = tf.AutoTokenizer.from_pretrained(str(source))
    tokenizer.add_tokens([AddedToken(text, special=special, normalized=False) for text, special in added])
    tokenizer.chat_template = template
    tokenizer.save_pretrained(str(source))
    config = getattr(tf, config_class)(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).float().eval()
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(str(source))
    bake(resolve(str(source), None), folder / "model")
    return folder / "model"


def serve(folder: Path, **env: str) -> Runtime:
    """A Runtime over an in-process CPU engine for the folder; shut it down with runtime.engine.shutdown()."""
    from engine.config import EngineConfig
    from engine.core.async_engine import AsyncEngine

    settings = load_settings({"MODEL_PATH": str(folder), **env})
    engine = AsyncEngine(
        EngineConfig(
            model_path=str(folder),
            dtype="float32",
            num_kv_pages=128,
            max_model_len=2048,
            max_num_seqs=8,
            device="cpu",
            attention_backend="torch",
        )
    )
    return Runtime(
        settings=settings,
        engine=engine,
        model_names=[baked_model_name(str(folder))],
        created=0,
        responses=ResponseStore(4, 2**20),
        drain=Drain(engine, 1.0),
    )
