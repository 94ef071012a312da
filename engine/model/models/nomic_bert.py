"""Nomic BERT encoders (NomicBertModel: nomic-embed-text-v1 / v1.5): BERT's post-norm layers with rotary positions in
place of position embeddings, a SwiGLU MLP and no linear biases. Embeddings only.

Two layouts of one model: transformers 5's (config keys hidden_size, ...; tensors layers.N.self_attn.q_proj, ...) and
the hub's remote-code one that the nomic-embed checkpoints hold (n_embd, n_layer, ...; encoder.layers.N.attn.Wqkv,
mlp.fc11 / fc12 / fc2, norm1 / norm2, emb_ln), mapped as transformers' conversion maps them: fc11 is the up
projection, fc12 the gate. Attention runs as BERT's does (engine.model.layers.encoder_attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.errors import UnsupportedModel
from engine.model.layers.activation import silu_and_mul
from engine.model.layers.encoder_attention import attend_within_sequences
from engine.model.layers.linear import FusedLinear
from engine.model.layers.rotary import RotaryEmbedding, apply_rotary_, rope_parameters
from engine.model.models.base import DecoderShape
from engine.model.models.encoder_base import EncoderModel, layer_name

# The remote-code config's keys -> transformers'
REMOTE_KEYS = {
    "n_embd": "hidden_size",
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "n_inner": "intermediate_size",
    "n_positions": "max_position_embeddings",
    "layer_norm_epsilon": "layer_norm_eps",
    "rotary_emb_base": "rope_theta",
}
# Remote-code options whose other values transformers' model lacks -> the value it runs
REMOTE_OPTIONS = {
    "activation_function": "swiglu",
    "prenorm": False,
    "parallel_block": False,
    "rotary_emb_fraction": 1.0,
    "rotary_emb_interleaved": False,
    "rotary_scaling_factor": None,
    "qkv_proj_bias": False,
    "mlp_fc1_bias": False,
    "mlp_fc2_bias": False,
    "use_rms_norm": False,
}
# Both layouts' names of a layer's tensors -> ours (layers.N.<ours>); q|k|v and gate|up stack in fused linears
LAYER_NAMES = {
    "self_attn.q_proj": "q_proj",
    "self_attn.k_proj": "k_proj",
    "self_attn.v_proj": "v_proj",
    "attn.Wqkv": "qkv_proj",
    "self_attn.o_proj": "o_proj",
    "attn.out_proj": "o_proj",
    "post_attention_layernorm": "attn_norm",
    "norm1": "attn_norm",
    "mlp.gate_proj": "gate_proj",
    "mlp.fc12": "gate_proj",
    "mlp.up_proj": "up_proj",
    "mlp.fc11": "up_proj",
    "mlp.down_proj": "down_proj",
    "mlp.fc2": "down_proj",
    "post_mlp_layernorm": "mlp_norm",
    "norm2": "mlp_norm",
}
# Heads and buffers a masked-LM or pre-training folder may hold that embeddings never read
SKIPPED = ("pooler.", "lm_head.", "cls.", "embeddings.position_ids", "embeddings.token_type_ids")


@dataclass(kw_only=True)
class NomicBertArgs(DecoderShape):
    """The encoder's shape and its rotary parameters."""

    type_vocab_size: int
    rope: dict


def transformers_config(config: dict) -> dict:
    """config.json in transformers' keys: a remote-code config renamed, its positions those it was trained on
    (max_trained_positions: 2048 of nomic-embed's 8192), refused in one line where it asks for an option
    transformers' model does not have."""
    for key, runs in REMOTE_OPTIONS.items():
        if key in config and config[key] != runs:
            raise UnsupportedModel(f"NomicBert {key}={config[key]!r} is not supported ({runs!r})", param="model")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"NomicBert hidden_act {act!r} is not supported (silu)", param="model")
    # A hub config written for both (nomic-embed-text-v1.5's today) says each thing twice: transformers' key wins.
    renamed = {REMOTE_KEYS[key]: value for key, value in config.items() if key in REMOTE_KEYS}
    renamed.update({key: value for key, value in config.items() if key not in REMOTE_KEYS})
    if config.get("max_trained_positions"):
        # NOTE: as vLLM serves them: positions past the trained ones would need the dynamic NTK scaling
        # (rotary_scaling_factor) that the remote code applies there, which transformers' model lacks.
        limit = min(renamed.get("max_position_embeddings", 2048), config["max_trained_positions"])
        renamed["max_position_embeddings"] = limit
    renamed["intermediate_size"] = renamed.get("intermediate_size") or 4 * renamed["hidden_size"]
    renamed.setdefault("rope_theta", 1000.0)  # NomicBertConfig's default base
    return renamed


class NomicBertModel(EncoderModel):
    """A bidirectional encoder whose final hidden states are pooled into embeddings; it never generates."""

    def __init__(self, args: NomicBertArgs) -> None:
        super().__init__(args)
        hidden = args.hidden_size
        self.word_embeddings = nn.Embedding(args.vocab_size, hidden)
        self.token_type_embeddings = nn.Embedding(args.type_vocab_size, hidden)
        self.embed_norm = nn.LayerNorm(hidden, eps=args.rms_norm_eps)
        self.layers = nn.ModuleList([NomicBertLayer(args) for _ in range(args.num_layers)])
        self.rotary: RotaryEmbedding | None = None  # built by init_rotary() once the weights are placed

    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> NomicBertArgs:
        config = transformers_config(config)
        shape = DecoderShape.read(
            {**config, "rms_norm_eps": config.get("layer_norm_eps", 1e-12)},
            max_positions=config.get("max_position_embeddings", 2048),
        )
        return NomicBertArgs(**shape, type_vocab_size=config.get("type_vocab_size", 2), rope=rope_parameters(config))

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        for prefix in ("nomic_bert.", "bert."):
            name = name.removeprefix(prefix)
        if name.startswith(SKIPPED):
            return None
        if name in ("emb_ln.weight", "emb_ln.bias"):
            return name.replace("emb_ln", "embed_norm")
        if name.startswith("embeddings."):
            return name.removeprefix("embeddings.").replace("LayerNorm", "embed_norm")
        name = name.removeprefix("encoder.")
        return layer_name(name, "layers.", LAYER_NAMES) or name

    def init_rotary(
        self, max_positions: int, dtype: torch.dtype, device: torch.device, fused: bool | None = None
    ) -> None:
        a = self.args
        self.rotary = RotaryEmbedding(
            head_dim=a.head_dim,
            rope=a.rope,
            max_position_embeddings=a.max_position_embeddings,
            max_positions=max_positions,
            dtype=dtype,
            device=device,
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
        assert self.rotary is not None, "init_rotary() builds the tables"
        types = torch.zeros_like(input_ids)  # one text: every token is segment 0
        x = self.embed_norm(self.word_embeddings(input_ids) + self.token_type_embeddings(types))
        bounds = meta.qo_indptr.tolist()
        rotary = self.rotary.lookup(positions)
        for layer in self.layers:
            x = layer(x, bounds, rotary)
        return x


class NomicBertLayer(nn.Module):
    """Post-norm: x = LN(x + attention(x)); x = LN(x + SwiGLU MLP(x)), attention both ways within each sequence."""

    def __init__(self, args: NomicBertArgs) -> None:
        super().__init__()
        hidden, eps, width = args.hidden_size, args.rms_norm_eps, args.num_q_heads * args.head_dim
        self.num_heads, self.head_dim = args.num_q_heads, args.head_dim
        self.qkv_proj = FusedLinear(hidden, {"q_proj": width, "k_proj": width, "v_proj": width}, bias=False)
        self.o_proj = nn.Linear(width, hidden, bias=False)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps)
        size = args.intermediate_size
        self.gate_up_proj = FusedLinear(hidden, {"gate_proj": size, "up_proj": size}, bias=False)
        self.down_proj = nn.Linear(size, hidden, bias=False)
        self.mlp_norm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, bounds: list[int], rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = self.attn_norm(x + self.o_proj(self.attend(x, bounds, rotary)))
        return self.mlp_norm(x + self.down_proj(silu_and_mul(self.gate_up_proj(x))))

    def attend(self, x: torch.Tensor, bounds: list[int], rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        cos, sin = rotary
        q, k = apply_rotary_(q, cos, sin), apply_rotary_(k, cos, sin)
        return attend_within_sequences(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), bounds)
