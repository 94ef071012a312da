"""BERT-family bidirectional encoders (BertModel; RobertaModel and XLMRobertaModel, whose positions start at
padding_idx + 1): absolute position and token-type embeddings, post-norm layers, GELU MLP. The *Model
architectures embed; their *ForSequenceClassification cross-encoders score a text pair with the head on its first
token (ClassificationHead), BERT reading the pair's token_type_ids (RoBERTa and XLM-R's tokenizers give none).

Each sequence's rows attend to each other both ways; the scheduler runs an encoder's prompt in one chunk
(PoolingConfig.whole_prompt), so a step's rows of a sequence are its whole prompt and attention needs no pages: the
rows are split by the step's qo_indptr and attended within each sequence (engine.model.layers.encoder_attention).
The KV group declared for the scheduler's sake is never written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.errors import UnsupportedModel
from engine.model.layers.encoder_attention import attend_within_sequences
from engine.model.models.base import DecoderShape
from engine.model.models.encoder_base import EncoderModel, head_name, layer_name

# The hub's names of a layer's tensors -> ours (layers.N.<ours>)
LAYER_NAMES = {
    "attention.self.query": "q_proj",
    "attention.self.key": "k_proj",
    "attention.self.value": "v_proj",
    "attention.output.dense": "o_proj",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "up_proj",
    "output.dense": "down_proj",
    "output.LayerNorm": "mlp_norm",
}
# Heads and buffers a sentence-transformers or masked-LM folder may hold that embeddings never read
SKIPPED = ("pooler.", "lm_head.", "cls.", "embeddings.position_ids")
# A cross-encoder's head: the hub's names -> ours (BERT's pooler and classifier; RoBERTa's classifier, whose folders may
# also hold a pooler its head never reads)
BERT_HEAD = {"pooler.dense.": "classification_head.dense.", "classifier.": "classification_head.out_proj."}
ROBERTA_HEAD = {
    "classifier.dense.": "classification_head.dense.",
    "classifier.out_proj.": "classification_head.out_proj.",
}
ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh")}


@dataclass(kw_only=True)
class BertArgs(DecoderShape):
    """The encoder's shape; max_position_embeddings is the positions usable (the table's rows less the offset)."""

    type_vocab_size: int
    position_offset: int  # RoBERTa / XLM-R: positions start at padding_idx + 1
    position_rows: int
    hidden_act: str
    num_labels: int = 0  # a cross-encoder's labels (0: an embedding model, no head)
    roberta: bool = False  # RoBERTa / XLM-R: its own head names, and no token_type_ids (their tokenizers give none)


class BertModel(EncoderModel):
    """A bidirectional encoder whose final hidden states are pooled into embeddings; it never generates."""

    def __init__(self, args: BertArgs) -> None:
        super().__init__(args)
        hidden = args.hidden_size
        self.word_embeddings = nn.Embedding(args.vocab_size, hidden)
        self.position_embeddings = nn.Embedding(args.position_rows, hidden)
        self.token_type_embeddings = nn.Embedding(args.type_vocab_size, hidden)
        self.embed_norm = nn.LayerNorm(hidden, eps=args.rms_norm_eps)
        self.layers = nn.ModuleList([EncoderLayer(args) for _ in range(args.num_layers)])
        self.reads_token_types = args.num_labels > 0 and not args.roberta  # BERT's pair segments
        if args.num_labels:
            self.classification_head = ClassificationHead(hidden_size=hidden, num_labels=args.num_labels)

    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> BertArgs:
        kind = config.get("position_embedding_type", "absolute")
        if kind != "absolute":
            raise UnsupportedModel(f"position_embedding_type {kind!r} is not supported (absolute)", param="model")
        act = config.get("hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise UnsupportedModel(f"hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})", param="model")
        architecture = config["architectures"][0]
        roberta = architecture.startswith(("Roberta", "XLMRoberta"))
        labels = len(config.get("id2label") or {}) or config.get("num_labels") or 2  # transformers' default: 2
        offset = config.get("pad_token_id", 1) + 1 if roberta else 0
        rows = config["max_position_embeddings"]
        shape = DecoderShape.read({**config, "rms_norm_eps": config.get("layer_norm_eps", 1e-12)}, max_positions=rows)
        shape["max_position_embeddings"] = rows - offset
        return BertArgs(
            **shape,
            type_vocab_size=config.get("type_vocab_size", 2),
            position_offset=offset,
            position_rows=rows,
            hidden_act=act,
            num_labels=labels if architecture.endswith("ForSequenceClassification") else 0,
            roberta=roberta,
        )

    def checkpoint_name(self, name: str) -> str | None:
        for prefix in ("bert.", "roberta."):
            name = name.removeprefix(prefix)
        if self.args.num_labels:
            head = head_name(name, ROBERTA_HEAD if self.args.roberta else BERT_HEAD)
            if head is not None:
                return head
        if name.startswith(SKIPPED):
            return None
        if name.startswith("embeddings."):
            return name.removeprefix("embeddings.").replace("LayerNorm", "embed_norm")
        return layer_name(name, "encoder.layer.", LAYER_NAMES) or name

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: Any,
        backend: AttentionBackend | list[AttentionBackend],
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The step's final hidden states [tokens, hidden]; each sequence's rows are its whole prompt.
        token_type_ids: each row's text of a pair (None: one text, every token segment 0)."""
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions + self.args.position_offset)
            + self.token_type_embeddings(types)
        )
        x = self.embed_norm(x)
        bounds = meta.qo_indptr.tolist()
        for layer in self.layers:
            x = layer(x, bounds)
        return x


class ClassificationHead(nn.Module):
    """A cross-encoder's head on its first token's final hidden state: tanh(dense(x)), then out_proj to the labels
    (BERT's pooler and classifier; RoBERTa's and XLM-R's classification head: the same layers, named apart)."""

    def __init__(self, *, hidden_size: int, num_labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, num_labels)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        """The labels' logits (float32) for one pooled hidden state [hidden]."""
        # NOTE: the bias gives the serving dtype: a CPU bf16 model's linears are packed and hold no `weight`
        x = first.to(self.dense.bias.dtype).unsqueeze(0)
        return self.out_proj(torch.tanh(self.dense(x)))[0].float()


class EncoderLayer(nn.Module):
    """Post-norm: x = LN(x + attention(x)); x = LN(x + MLP(x)), attention both ways within each sequence."""

    def __init__(self, args: BertArgs) -> None:
        super().__init__()
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.num_heads, self.head_dim = args.num_q_heads, args.head_dim
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim)
        self.k_proj = nn.Linear(hidden, self.num_heads * self.head_dim)
        self.v_proj = nn.Linear(hidden, self.num_heads * self.head_dim)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps)
        self.up_proj = nn.Linear(hidden, args.intermediate_size)
        self.down_proj = nn.Linear(args.intermediate_size, hidden)
        self.mlp_norm = nn.LayerNorm(hidden, eps=eps)
        self.act = ACTIVATIONS[args.hidden_act]

    def forward(self, x: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        x = self.attn_norm(x + self.o_proj(self.attend(x, bounds)))
        return self.mlp_norm(x + self.down_proj(self.act(self.up_proj(x))))

    def attend(self, x: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        """Each sequence's rows bounds[i]:bounds[i+1] attend to one another, both ways."""
        q, k, v = (
            p(x).view(-1, self.num_heads, self.head_dim).transpose(0, 1)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        return attend_within_sequences(q, k, v, bounds)
