"""What the engine knows of a model once it is built (ModelSpec), and the start-up steps that derive it from the
config and the model: load_model runs them on the loaded model, check_checkpoint on the meta one at bake."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

import torch

from engine.model.classifier import Classifier, ScoreHead
from engine.model.kv_spec import KVGroupSpec
from engine.model.layers.parallel import TensorParallel
from engine.model.layers.recurrent_step import RecurrentSpec
from engine.model.models import CausalLM
from engine.model.pooling import PoolingConfig, read_pooling
from engine.model.vision.spec import VisionSpec


@dataclass(kw_only=True)
class ModelSpec:
    """What the engine needs to know about a loaded model (KV shapes, limits, stop tokens)."""

    architecture: str
    num_layers: int
    num_q_heads: int  # this rank's, under tensor parallelism (the heads its attention backends run)
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: set[int]
    dtype: torch.dtype
    kv_groups: list[KVGroupSpec]  # the KV cache's layer groups (one for a full-attention model)
    pooling: PoolingConfig  # how an embedding request pools the final hidden states
    # A hybrid model's recurrent layers and their per-sequence state shapes (None: every layer attends over pages)
    recurrent: RecurrentSpec | None = None
    # A cross-encoder's classifier and its head (pooled hidden -> logits): the model scores, never generates
    classifier: Classifier | None = None
    score_head: ScoreHead | None = None
    vision: VisionSpec | None = None  # a model that takes images (None: text only)
    encoder: bool = False  # a bidirectional encoder (BERT-like): it embeds, never generates


def start_spec(
    model: CausalLM,
    config: dict,
    model_path: str,
    *,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel | None,
    max_positions: int,
) -> ModelSpec:
    """The model's rotary tables and its ModelSpec (KV groups, pooling, recurrent state, images), built from the
    config: load_model's last step, and the bake's check on the meta model, so that the bake refuses what these
    refuse at start (a rope type or partial rotary factor the rotary does not run, an mrope_section, a KV group).
    The score head is load_model's to add: it reads the weights."""
    args = model.args
    encoder = bool(getattr(model, "encoder", False))
    model.init_rotary(max_positions, dtype, device)
    return ModelSpec(
        architecture=config["architectures"][0],
        num_layers=args.num_layers,
        num_q_heads=args.num_q_heads if tp is None else tp.span(args.num_q_heads)[1],
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        hidden_size=args.hidden_size,
        vocab_size=args.vocab_size,
        max_position_embeddings=_max_positions(model_path, args.max_position_embeddings, encoder),
        eos_token_ids=_eos_token_ids(config, model_path),
        dtype=dtype,
        kv_groups=_rank_groups(model.kv_groups(config), tp),
        pooling=_pooling(model_path, config, model.classifier, encoder),
        recurrent=model.recurrent_spec() if hasattr(model, "recurrent_spec") else None,
        classifier=model.classifier,
        vision=model.vision_spec() if hasattr(model, "vision_spec") else None,
        encoder=encoder,
    )


def _pooling(model_path: str, config: dict, classifier: Classifier | None, encoder: bool) -> PoolingConfig:
    # A cross-encoder scores its last token's hidden state as it is (its head reads it unnormalised); an encoder's
    # its first token's (ModernBERT's: or the tokens' mean, its classifier_pooling), the whole prompt run at once.
    if classifier is not None:
        method = classifier.pooling or ("cls" if encoder else "last")
        return PoolingConfig(method=method, normalize=False, source="classifier", whole_prompt=encoder)
    return replace(read_pooling(model_path, config), whole_prompt=encoder)


def _max_positions(model_path: str, limit: int, encoder: bool) -> int:
    """The longest prompt served: an encoder's sentence_bert_config.json `max_seq_length` where it is below the
    position table (sentence-transformers truncates there; here a longer prompt is refused unless the request
    truncates it: truncate_prompt_tokens)."""
    path = os.path.join(model_path, "sentence_bert_config.json")
    if not encoder or not os.path.isfile(path):
        return limit
    with open(path) as f:
        length = json.load(f).get("max_seq_length")
    return min(limit, int(length)) if isinstance(length, int) and length > 0 else limit


def _rank_groups(groups: list[KVGroupSpec], tp: TensorParallel | None) -> list[KVGroupSpec]:
    """The KV groups as one rank holds them: its KV heads (the page tables are every rank's); an MLA group's latent
    row whole (every rank's heads read the same latent)."""
    if tp is None:
        return groups
    return [g if g.latent is not None else replace(g, num_kv_heads=tp.kv_heads(g.num_kv_heads)[1]) for g in groups]


def _eos_token_ids(config: dict, model_path: str) -> set[int]:
    ids: set[int] = set()
    sources = [config.get("eos_token_id")]
    gen_path = os.path.join(model_path, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            sources.append(json.load(f).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return ids
