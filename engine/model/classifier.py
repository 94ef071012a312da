"""Cross-encoder checkpoints: a model whose pooled final hidden state is scored by a head.

Three layouts, read from config.json as vLLM reads them:
- `*ForSequenceClassification` of a bidirectional encoder (BERT, RoBERTa, XLM-R, ModernBERT): the encoder's own head
  on its first token (engine/model/models/bert.py builds it: BERT's pooler and classifier, RoBERTa's classification
  head), or ModernBERT's on its first token or the mean of its tokens, as `classifier_pooling` says
  (engine/model/models/modernbert.py: `head` and `classifier`);
- `*ForSequenceClassification` of a decoder family the engine runs (Llama, Qwen3): the decoder plus `score.weight`
  `[num_labels, hidden]`, no bias, read at the last token (transformers pools the last non-pad token; a request
  here has no padding);
- Qwen3-Reranker (a Qwen3ForCausalLM checkpoint scored by its "yes" / "no" logits), which vLLM serves when
  config.json says `architectures: ["Qwen3ForSequenceClassification"]`, `classifier_from_token: ["no", "yes"]` and
  `is_original_qwen3_reranker: true` (its `--hf-overrides`): the head is one row, lm_head["yes"] - lm_head["no"],
  so that its sigmoid is the softmax of the two logits, the model card's score.

The labels' activation is vLLM's (get_cross_encoder_activation_function): the sentence-transformers one that
config.json names (`sentence_transformers.activation_fn`, else `sbert_ce_default_activation_function`), else a
sigmoid for one label and a softmax over several.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.errors import UnsupportedModel

SUFFIX = "ForSequenceClassification"
# The bidirectional encoders' classifiers (engine/model/models/bert.py runs them, head included).
ENCODER_CLASSIFIERS = (
    "BertForSequenceClassification",
    "RobertaForSequenceClassification",
    "XLMRobertaForSequenceClassification",
    "ModernBertForSequenceClassification",
)
# ModernBERT's `classifier_pooling`: what its head reads (the first token's final hidden state, or the tokens' mean)
MODERNBERT_POOLING = ("cls", "mean")
# The classifier architectures served (engine/model/models registers each on its family's class).
CLASSIFIERS = ("LlamaForSequenceClassification", "Qwen3ForSequenceClassification", *ENCODER_CLASSIFIERS)
# Bidirectional encoders: the ones engine/model/models runs (ENCODER_MODELS: bert.py, modernbert.py, nomic_bert.py)
# embed, bert.py's and modernbert.py's classifiers score; any other is refused by name (masked-LM and other heads,
# families not built yet).
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

# sentence-transformers' activation names (torch.nn.modules classes) -> the engine's
ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Tanh": "tanh",
}
# A head maps the pooled final hidden state [hidden] (float32) to the labels' logits [num_labels] (float32)
ScoreHead = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class Classifier:
    """How a cross-encoder scores: its head's source ("score": the checkpoint's score.weight; "tokens": rows of
    lm_head, the first subtracted from the second; "encoder": an encoder family's own head), how many labels it
    gives and their activation ("classify": vLLM's default, or one of ACTIVATIONS' values); pooling: the token its
    head reads (None: a decoder's last, an encoder's first) or "mean" (ModernBERT's classifier_pooling)."""

    source: str
    num_labels: int
    tokens: tuple[str, ...] = ()
    activation: str = "classify"
    pooling: str | None = None


def refuse_encoder(architecture: str) -> None:
    """One line for a bidirectional encoder, which the engine cannot run (nothing for any other architecture)."""
    served = ENCODER_MODELS + ENCODER_CLASSIFIERS
    if architecture not in served and any(architecture.startswith(name) for name in ENCODERS):
        raise UnsupportedModel(
            f"architecture {architecture!r} is a bidirectional encoder (BERT-like) the engine does not run: "
            f"of encoders it runs {', '.join(ENCODER_MODELS)} (embeddings) and {', '.join(ENCODER_CLASSIFIERS)} "
            "(scores)",
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
    activation = read_activation(config)
    if architecture in ENCODER_CLASSIFIERS:
        return _encoder_classifier(architecture, config, shapes, activation)
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
        return Classifier(source="tokens", num_labels=1, tokens=tuple(tokens), activation=activation)
    if "score.weight" not in shapes:
        raise UnsupportedModel(f"{architecture} checkpoint lacks score.weight", param="model")
    labels = shapes["score.weight"][0]
    named = config.get("num_labels") or len(config.get("id2label") or {}) or labels
    if named != labels:
        raise UnsupportedModel(f"config.json gives {named} labels, score.weight has {labels}", param="model")
    return Classifier(source="score", num_labels=labels, activation=activation)


def read_activation(config: dict) -> str:
    """The labels' activation as vLLM picks it: the sentence-transformers class config.json names, else "classify"
    (a sigmoid for one label, a softmax over several); UnsupportedModel for a class the engine lacks."""
    named = (config.get("sentence_transformers") or {}).get("activation_fn")
    named = named or config.get("sbert_ce_default_activation_function")
    if named is None:
        return "classify"
    if named not in ACTIVATIONS:
        raise UnsupportedModel(
            f"the cross-encoder's activation {named!r} (config.json) is not supported ({', '.join(ACTIVATIONS)})",
            param="model",
        )
    return ACTIVATIONS[named]


def _encoder_classifier(
    architecture: str, config: dict, shapes: dict[str, tuple[int, ...]], activation: str
) -> Classifier:
    # BERT: the pooler's dense and `classifier`; RoBERTa / XLM-R: `classifier.dense` and `classifier.out_proj`;
    # ModernBERT: `head.dense` and `classifier` (under model. or not)
    if architecture.startswith("ModernBert"):
        shapes = {name.removeprefix("model."): shape for name, shape in shapes.items()}
        needed: tuple[str, ...] = ("head.dense.weight", "classifier.weight")
    elif architecture.startswith("Bert"):
        needed = ("bert.pooler.dense.weight", "classifier.weight")
    else:
        needed = ("classifier.out_proj.weight",)
    missing = [name for name in needed if name not in shapes]
    if missing:
        raise UnsupportedModel(f"{architecture} checkpoint lacks {', '.join(missing)}", param="model")
    labels = shapes[needed[-1]][0]
    named = len(config.get("id2label") or {}) or config.get("num_labels") or labels
    if named != labels:
        raise UnsupportedModel(f"config.json gives {named} labels, {needed[-1]} has {labels}", param="model")
    pooling = None
    if architecture.startswith("ModernBert"):
        pooling = config.get("classifier_pooling", "cls")
        if pooling not in MODERNBERT_POOLING:
            raise UnsupportedModel(
                f"classifier_pooling {pooling!r} is not supported ({', '.join(MODERNBERT_POOLING)})", param="model"
            )
    return Classifier(source="encoder", num_labels=labels, activation=activation, pooling=pooling)


def attach_score(model: nn.Module, classifier: Classifier | None, hidden_size: int) -> None:
    """Give the model the `score` linear its checkpoint fills (on the model's current device, meta included)."""
    if classifier is not None and classifier.source == "score":
        model.score = nn.Linear(hidden_size, classifier.num_labels, bias=False)


def check_tokens(classifier: Classifier | None, model_path: str) -> None:
    """At bake time: a token-scored classifier's tokens are each one token of the vocabulary."""
    if classifier is not None and classifier.source == "tokens":
        for token in classifier.tokens:
            _token_id(model_path, token)


def score_head(model: nn.Module, classifier: Classifier, model_path: str) -> ScoreHead:
    """What scores the pooled hidden state: an encoder family's own head, or a decoder's matrix."""
    if classifier.source == "encoder":
        return model.classification_head
    return MatrixHead(head_weight(model, classifier, model_path))


class MatrixHead:
    """A decoder cross-encoder's head: its `[num_labels, hidden]` float32 matrix times the last hidden state."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.weight.to(pooled.device) @ pooled.float()


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


def activate(logits: torch.Tensor, activation: str = "classify") -> torch.Tensor:
    """The classifier's labels through its activation (vLLM's default, "classify": a sigmoid for one label, a
    softmax over several)."""
    if activation == "identity":
        return logits
    if activation == "tanh":
        return torch.tanh(logits)
    if activation == "sigmoid" or logits.numel() == 1:
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)
