"""Cross-encoder checkpoints: a decoder whose last token's final hidden state is scored by a linear head.

Two layouts, read from config.json as vLLM reads them:
- `*ForSequenceClassification` of a decoder family the engine runs (Llama, Qwen3): the decoder plus `score.weight`
  `[num_labels, hidden]`, no bias, read at the last token (transformers pools the last non-pad token; a request
  here has no padding);
- Qwen3-Reranker (a Qwen3ForCausalLM checkpoint scored by its "yes" / "no" logits), which vLLM serves when
  config.json says `architectures: ["Qwen3ForSequenceClassification"]`, `classifier_from_token: ["no", "yes"]` and
  `is_original_qwen3_reranker: true` (its `--hf-overrides`): the head is one row, lm_head["yes"] - lm_head["no"],
  so that its sigmoid is the softmax of the two logits, the model card's score.

The labels' activation is vLLM's default: a sigmoid for one label, a softmax over several.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from torch import nn

from engine.errors import UnsupportedModel

SUFFIX = "ForSequenceClassification"
# The classifier architectures served (engine/model/models registers each on its decoder's class).
CLASSIFIERS = ("LlamaForSequenceClassification", "Qwen3ForSequenceClassification")
# Bidirectional encoders: the ones engine/model/models runs (ENCODER_MODELS: bert.py, modernbert.py, nomic_bert.py)
# embed; any other is refused by name (masked-LM and classification heads, families not built yet).
ENCODER_MODELS = ("BertModel", "RobertaModel", "XLMRobertaModel", "ModernBertModel", "NomicBertModel")
ENCODERS = (
    "Bert",
    "Roberta",
    "XLMRoberta",
    "ModernBert",
    "NomicBert",
    "DistilBert",
    "Electra",
    "DebertaV2",
    "GteModel",
    "GteNew",
    "NewModel",
    "JinaBert",
    "MPNet",
)


@dataclass(frozen=True)
class Classifier:
    """How a cross-encoder scores: its head's source ("score": the checkpoint's score.weight; "tokens": rows of
    lm_head, the first subtracted from the second) and how many labels it gives."""

    source: str
    num_labels: int
    tokens: tuple[str, ...] = ()


def refuse_encoder(architecture: str) -> None:
    """One line for a bidirectional encoder, which the engine cannot run (nothing for any other architecture)."""
    if architecture not in ENCODER_MODELS and any(architecture.startswith(name) for name in ENCODERS):
        raise UnsupportedModel(
            f"architecture {architecture!r} is a bidirectional encoder (BERT-like) the engine does not run: "
            f"of encoders it runs {', '.join(ENCODER_MODELS)} (embeddings only)",
            param="model",
        )


def read_classifier(config: dict, shapes: dict[str, tuple[int, ...]]) -> Classifier | None:
    """The checkpoint's classifier, or None for a plain decoder; UnsupportedModel (one line) for a layout the
    engine does not score."""
    architecture = (config.get("architectures") or [""])[0]
    if not architecture.endswith(SUFFIX):
        return None
    if architecture not in CLASSIFIERS:
        raise UnsupportedModel(
            f"architecture {architecture!r} is not supported (classifiers: {', '.join(CLASSIFIERS)})", param="model"
        )
    tokens = config.get("classifier_from_token")
    if config.get("is_original_qwen3_reranker") or tokens is not None:
        if not (
            config.get("is_original_qwen3_reranker")
            and isinstance(tokens, list)
            and len(tokens) == 2
            and all(isinstance(t, str) for t in tokens)
        ):
            raise UnsupportedModel(
                "classifier_from_token is supported as Qwen3-Reranker's: two tokens "
                '("no", "yes") with is_original_qwen3_reranker true',
                param="model",
            )
        if "score.weight" in shapes:
            raise UnsupportedModel(
                "a Qwen3-Reranker checkpoint (classifier_from_token) holds an lm_head, not score.weight", param="model"
            )
        return Classifier("tokens", 1, tuple(tokens))
    if "score.weight" not in shapes:
        raise UnsupportedModel(f"{architecture} checkpoint lacks score.weight", param="model")
    labels = shapes["score.weight"][0]
    named = config.get("num_labels") or len(config.get("id2label") or {}) or labels
    if named != labels:
        raise UnsupportedModel(f"config.json gives {named} labels, score.weight has {labels}", param="model")
    return Classifier("score", labels)


def attach_score(model: nn.Module, classifier: Classifier | None, hidden_size: int) -> None:
    """Give the model the `score` linear its checkpoint fills (on the model's current device, meta included)."""
    if classifier is not None and classifier.source == "score":
        model.score = nn.Linear(hidden_size, classifier.num_labels, bias=False)


def check_tokens(classifier: Classifier | None, model_path: str) -> None:
    """At bake time: a token-scored classifier's tokens are each one token of the vocabulary."""
    if classifier is not None and classifier.source == "tokens":
        for token in classifier.tokens:
            _token_id(model_path, token)


def head_weight(model: nn.Module, classifier: Classifier, model_path: str) -> torch.Tensor:
    """The `[num_labels, hidden]` matrix, in float32, that scores the last hidden state."""
    if classifier.source == "score":
        return model.score.weight.detach().float()
    no, yes = (_token_id(model_path, t) for t in classifier.tokens)
    lm_head = model.lm_head.weight.detach()
    return (lm_head[yes].float() - lm_head[no].float()).unsqueeze(0)


def _token_id(model_path: str, token: str) -> int:
    from tokenizers import Tokenizer

    path = os.path.join(model_path, "tokenizer.json")
    if not os.path.isfile(path):
        raise UnsupportedModel("classifier_from_token needs tokenizer.json to find its tokens", param="model")
    found = Tokenizer.from_file(path).token_to_id(token)
    if found is None:
        raise UnsupportedModel(
            f"classifier_from_token: {json.dumps(token)} is not one token of the vocabulary", param="model"
        )
    return found


def activate(logits: torch.Tensor) -> torch.Tensor:
    """vLLM's default activation of a classifier's labels."""
    return torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, dim=-1)
