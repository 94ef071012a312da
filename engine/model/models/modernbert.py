"""ModernBERT encoders (ModernBertModel: ModernBERT-base, modernbert-embed, gte-modernbert): rotary positions, pre-norm
layers whose attention is global on every global_attn_every_n_layers-th layer (from the first) and a local sliding
window on the others, a GeGLU MLP, LayerNorms and linears without biases unless the config says. ModernBertModel
embeds; its ModernBertForSequenceClassification cross-encoder (gte-reranker-modernbert-base) scores a text pair with
transformers' head (ClassificationHead) on the final norm's output pooled as `classifier_pooling` says (the first
token, or the tokens' mean: engine/model/classifier.py reads it).

A local layer's window is transformers' count: `local_attention` tokens in all, half on each side, so a row sees the
rows at most local_attention // 2 positions away; its rotary base is local_rope_theta, a global layer's
global_rope_theta. Attention runs as BERT's does (engine.model.layers.encoder_attention): each sequence whole, no
pages; the KV group declared for the scheduler's sake is never written.
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
from engine.model.layers.rotary import RotaryEmbedding, apply_rotary_
from engine.model.models.base import DecoderShape
from engine.model.models.encoder_base import EncoderModel, head_name, layer_name

# The hub's names of a layer's tensors -> ours (layers.N.<ours>)
LAYER_NAMES = {
    "attn_norm": "attn_norm",
    "attn.Wqkv": "qkv_proj",
    "attn.Wo": "o_proj",
    "mlp_norm": "mlp_norm",
    "mlp.Wi": "in_proj",
    "mlp.Wo": "down_proj",
}
# A masked-LM or classifier checkpoint's heads, which embeddings never read
SKIPPED = ("head.", "decoder.", "classifier.")
# A cross-encoder's head: the hub's names -> ours (its prediction head's dense and norm, then `classifier`)
CLASSIFIER_HEAD = {
    "head.dense.": "classification_head.dense.",
    "head.norm.": "classification_head.norm.",
    "classifier.": "classification_head.out_proj.",
}
ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


@dataclass(kw_only=True)
class ModernBertArgs(DecoderShape):
    """The encoder's shape; windows: each layer's tokens seen on either side (None: a global layer)."""

    windows: tuple[int | None, ...]
    global_rope_theta: float
    local_rope_theta: float
    norm_bias: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_activation: str
    num_labels: int = 0  # a cross-encoder's labels (0: an embedding model, no head)
    classifier_activation: str = "gelu"
    classifier_bias: bool = False


def read_rope_thetas(config: dict) -> tuple[float, float]:
    """(global, local) rotary bases: transformers 5's per-layer-type rope_parameters, or the hub's global_rope_theta
    and local_rope_theta (a null local one means the global one, as transformers 4 read it)."""
    rope = config.get("rope_parameters") or {}
    for kind, params in rope.items():
        if (params or {}).get("rope_type", "default") != "default":
            raise UnsupportedModel(
                f"ModernBERT {kind} rope_type {params['rope_type']!r} is not supported", param="model"
            )
    global_theta = (rope.get("full_attention") or {}).get("rope_theta") or config.get("global_rope_theta") or 160000.0
    local_theta = (rope.get("sliding_attention") or {}).get("rope_theta")
    if local_theta is None:
        local_theta = config.get("local_rope_theta", 10000.0) or global_theta
    return float(global_theta), float(local_theta)


class ModernBertModel(EncoderModel):
    """A bidirectional encoder whose final hidden states are pooled into embeddings; it never generates."""

    def __init__(self, args: ModernBertArgs) -> None:
        super().__init__(args)
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.embed_tokens = nn.Embedding(args.vocab_size, hidden)
        self.embed_norm = nn.LayerNorm(hidden, eps=eps, bias=args.norm_bias)
        self.layers = nn.ModuleList(
            [ModernBertLayer(args, first=i == 0, window=window) for i, window in enumerate(args.windows)]
        )
        self.final_norm = nn.LayerNorm(hidden, eps=eps, bias=args.norm_bias)
        if args.num_labels:
            self.classification_head = ClassificationHead(args)
        self.global_rotary: RotaryEmbedding | None = None  # built by init_rotary() once the weights are placed
        self.local_rotary: RotaryEmbedding | None = None

    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> ModernBertArgs:
        act = config.get("hidden_activation", "gelu")
        head_act = config.get("classifier_activation", "gelu")
        for key, value in (("hidden_activation", act), ("classifier_activation", head_act)):
            if value not in ACTIVATIONS:
                raise UnsupportedModel(f"{key} {value!r} is not supported ({', '.join(ACTIVATIONS)})", param="model")
        scores = config["architectures"][0].endswith("ForSequenceClassification")
        layers = config["num_hidden_layers"]
        every = config.get("global_attn_every_n_layers", 3)
        kinds = config.get("layer_types") or [
            "full_attention" if i % every == 0 else "sliding_attention" for i in range(layers)
        ]
        half = config.get("local_attention", 128) // 2
        global_theta, local_theta = read_rope_thetas(config)
        shape = DecoderShape.read(
            {**config, "rms_norm_eps": config.get("norm_eps", 1e-5)}, max_positions=config["max_position_embeddings"]
        )
        return ModernBertArgs(
            **shape,
            windows=tuple(None if kind == "full_attention" else half for kind in kinds),
            global_rope_theta=global_theta,
            local_rope_theta=local_theta,
            norm_bias=config.get("norm_bias", False),
            attention_bias=config.get("attention_bias", False),
            mlp_bias=config.get("mlp_bias", False),
            hidden_activation=act,
            # transformers' default: 2
            num_labels=(len(config.get("id2label") or {}) or config.get("num_labels") or 2) if scores else 0,
            classifier_activation=head_act,
            classifier_bias=config.get("classifier_bias", False),
        )

    def checkpoint_name(self, name: str) -> str | None:
        name = name.removeprefix("model.")  # a masked-LM or classifier checkpoint holds the encoder under model.
        if self.args.num_labels:
            head = head_name(name, CLASSIFIER_HEAD)
            if head is not None:
                return head
        if name.startswith(SKIPPED):
            return None
        if name.startswith("embeddings."):
            return name.replace("embeddings.tok_embeddings", "embed_tokens").replace("embeddings.norm", "embed_norm")
        return layer_name(name, "layers.", LAYER_NAMES) or name

    def init_rotary(
        self, max_positions: int, dtype: torch.dtype, device: torch.device, fused: bool | None = None
    ) -> None:
        """float32 tables on every device: transformers rotates ModernBERT's q and k in float32."""
        a = self.args
        self.global_rotary, self.local_rotary = (
            RotaryEmbedding(
                head_dim=a.head_dim,
                rope={"rope_type": "default", "rope_theta": theta},
                max_position_embeddings=a.max_position_embeddings,
                max_positions=max_positions,
                dtype=torch.float32,
                device=device,
            )
            for theta in (a.global_rope_theta, a.local_rope_theta)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: Any,
        backend: AttentionBackend | list[AttentionBackend],
    ) -> torch.Tensor:
        """The step's final hidden states [tokens, hidden]; each sequence's rows are its whole prompt."""
        assert self.global_rotary is not None and self.local_rotary is not None, "init_rotary() builds the tables"
        x = self.embed_norm(self.embed_tokens(input_ids))
        bounds = meta.qo_indptr.tolist()
        global_rotary, local_rotary = self.global_rotary.lookup(positions), self.local_rotary.lookup(positions)
        for layer in self.layers:
            x = layer(x, bounds, global_rotary if layer.window is None else local_rotary)
        return self.final_norm(x)


class ClassificationHead(nn.Module):
    """A cross-encoder's head on its pooled final hidden state: transformers' prediction head (dense, activation,
    LayerNorm), then out_proj (its `classifier`) to the labels; the dropout between them is off at inference."""

    def __init__(self, args: ModernBertArgs) -> None:
        super().__init__()
        hidden = args.hidden_size
        self.dense = nn.Linear(hidden, hidden, bias=args.classifier_bias)
        self.act = ACTIVATIONS[args.classifier_activation]
        self.norm = nn.LayerNorm(hidden, eps=args.rms_norm_eps, bias=args.norm_bias)
        self.out_proj = nn.Linear(hidden, args.num_labels)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        """The labels' logits (float32) for one pooled hidden state [hidden]."""
        # NOTE: the bias gives the serving dtype: a CPU bf16 model's linears are packed and hold no `weight`
        x = pooled.to(self.out_proj.bias.dtype).unsqueeze(0)
        return self.out_proj(self.norm(self.act(self.dense(x))))[0].float()


class ModernBertLayer(nn.Module):
    """Pre-norm: x += attention(attn_norm(x)); x += MLP(mlp_norm(x)). The first layer has no attn_norm: it reads
    the embedding norm's output as it is."""

    def __init__(self, args: ModernBertArgs, *, first: bool, window: int | None) -> None:
        super().__init__()
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.num_heads, self.head_dim, self.window = args.num_q_heads, args.head_dim, window
        self.attn_norm = nn.Identity() if first else nn.LayerNorm(hidden, eps=eps, bias=args.norm_bias)
        self.qkv_proj = nn.Linear(hidden, 3 * self.num_heads * self.head_dim, bias=args.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=args.attention_bias)
        self.mlp_norm = nn.LayerNorm(hidden, eps=eps, bias=args.norm_bias)
        # GeGLU: the first half of in_proj's rows is activated, the second half gates it
        self.in_proj = nn.Linear(hidden, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, hidden, bias=args.mlp_bias)
        self.act = ACTIVATIONS[args.hidden_activation]

    def forward(self, x: torch.Tensor, bounds: list[int], rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.o_proj(self.attend(self.attn_norm(x), bounds, rotary))
        up, gate = self.in_proj(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down_proj(self.act(up) * gate)

    def attend(self, x: torch.Tensor, bounds: list[int], rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        cos, sin = rotary
        q, k = (apply_rotary_(t.float(), cos, sin).to(x.dtype) for t in (q, k))
        return attend_within_sequences(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), bounds, window=self.window
        )
