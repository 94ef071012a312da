"""An EAGLE-3 draft head (`LlamaForCausalLMEagle3`, as the published heads for Llama-3.1 and Qwen3 are laid out):
one Llama decoder layer that reads the target's hidden states from three of its layers.

At position p the head takes the embedding of token p+1 and a feature of position p: for positions the target
computed, `fc` of the target's three captured hidden states; for the head's own guesses, its previous row's
pre-norm output. The layer's attention reads both, concatenated (2 x hidden wide); its logits cover the head's
draft vocabulary, mapped onto the target's ids by `d2t` (target = draft + d2t[draft]).

The head runs on the engine's ModelRunner like any model: the caller sets `features` (one row per input token)
before each forward, and reads `prenorm` after it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.errors import StartupError
from engine.model.kv_spec import KVGroupSpec, kv_groups
from engine.model.layers.norm import RMSNorm
from engine.model.models.llama import LlamaArgs, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# The fused projections' checkpoint shards: (fused module, shard) for each checkpoint matrix.
_FUSED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


def aux_layers(config: dict, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs the head reads: the config's, else EAGLE-3's (2, L // 2, L - 3)."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = tuple(ids) if ids else (2, num_target_layers // 2, num_target_layers - 3)
    if len(layers) != 3 or not all(isinstance(i, int) and 0 <= i < num_target_layers for i in layers):
        raise StartupError(
            f"the EAGLE-3 head reads layers {list(layers)}, but the model has {num_target_layers} layers",
            param="speculative.model",
        )
    return layers


class Eagle3DecoderLayer(LlamaDecoderLayer):
    """The head's one layer: its attention reads [embedding | feature] (2 x hidden wide); the feature has a norm of
    its own (hidden_norm)."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__(args, LlamaAttention(args, input_size=2 * args.hidden_size), LlamaMLP(args))
        self.hidden_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Eagle3Head(LlamaForCausalLM):
    """The head as a one-layer Llama (Eagle3DecoderLayer), plus fc, d2t and an lm_head over the draft vocabulary."""

    def __init__(self, args: LlamaArgs, target_hidden: int, draft_vocab: int, target_vocab: int) -> None:
        super().__init__(args, head_vocab=draft_vocab)
        self.fc = nn.Linear(3 * target_hidden, args.hidden_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.target_vocab = target_vocab
        self.features: torch.Tensor | None = None  # set by the caller before each forward: a row per token
        self.prenorm: torch.Tensor | None = None  # each row's pre-norm output, after a forward

    @classmethod
    def make_layer(cls, args: LlamaArgs, index: int) -> Eagle3DecoderLayer:
        return Eagle3DecoderLayer(args)

    def kv_groups(self, config: dict) -> list[KVGroupSpec]:
        return kv_groups([None], self.args.num_kv_heads, self.args.head_dim)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend | list[AttentionBackend],
    ) -> torch.Tensor:
        assert self.rotary is not None and self.features is not None
        cos, sin = (None, None) if self.fused_kernels else self.rotary.lookup(positions)
        layer = self.model.layers[0]
        feature = self.features if self.features.shape[-1] == self.args.hidden_size else self.fc(self.features)
        embeds = layer.input_layernorm(self.model.embed_tokens(input_ids))
        x = torch.cat([embeds, layer.hidden_norm(feature)], dim=-1)
        ((k_cache, v_cache),) = kv_caches
        b = self.layer_backends(backend, 1)[0]
        h = layer.self_attn(x, positions, cos, sin, k_cache, v_cache, b)
        h, residual = layer.post_attention_layernorm.add_forward(h, feature)
        h = layer.mlp(h)
        out, self.prenorm = self.model.norm.add_forward(h, residual)
        return out

    @property
    def carry(self) -> torch.Tensor | None:
        """What the head's next step is fed from each row: its pre-norm output."""
        return self.prenorm

    def compute_logits(self, hidden: torch.Tensor, exact_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits over the target's vocabulary: -inf on ids outside the draft vocabulary."""
        draft = self.lm_head(hidden).float()
        ids = torch.arange(draft.shape[-1], device=draft.device) + self.d2t
        logits = draft.new_full((draft.shape[0], self.target_vocab), float("-inf"))
        logits[:, ids] = draft
        return logits


def check_eagle3_head(folder: str, hidden_size: int, vocab_size: int, num_layers: int) -> tuple[dict, tuple[int, ...]]:
    """The head's config and the target layers it reads, from its config and its files' headers, when it fits a
    target of this shape; StartupError in one line when it does not (the bake and the start-up both ask)."""
    where = f"the EAGLE-3 head at {folder}"
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise StartupError(f"{where} has no readable config.json ({exc})", param="speculative.model") from None
    arch = (config.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise StartupError(
            f"{where} is a {arch}, not an EAGLE-3 head ({' or '.join(ARCHITECTURES)})", param="speculative.model"
        )
    shapes = _tensor_shapes(Path(folder), where)
    fc = shapes.get("fc.weight")
    target_hidden = config.get("target_hidden_size") or (fc[1] // 3 if fc is not None else config.get("hidden_size"))
    if target_hidden != hidden_size:
        raise StartupError(
            f"{where} reads hidden states of size {target_hidden}; the model's are {hidden_size}",
            param="speculative.model",
        )
    if config.get("vocab_size") != vocab_size:
        raise StartupError(
            f"{where} is for a vocabulary of {config.get('vocab_size')} tokens; the model has {vocab_size}",
            param="speculative.model",
        )
    return config, aux_layers(config, num_layers)


def load_eagle3_head(
    folder: str, target: nn.Module, dtype: torch.dtype, device: torch.device
) -> tuple[Eagle3Head, tuple[int, ...]]:
    """The head in `folder`, checked against the target model, and the target layers it reads; StartupError in
    one line when it does not fit."""
    where = f"the EAGLE-3 head at {folder}"
    t_args = target.args
    config, layers = check_eagle3_head(folder, t_args.hidden_size, t_args.vocab_size, t_args.num_layers)
    tensors = _read_tensors(Path(folder), where)
    args = LlamaArgs.from_config(
        {**config, "num_hidden_layers": 1}, {"model.layers.0." + n.removeprefix("midlayer.") for n in tensors}
    )
    target_hidden = t_args.hidden_size
    draft_vocab = config.get("draft_vocab_size") or config["vocab_size"]
    with torch.device("meta"):  # no throw-away vocabulary-sized tensors
        head = Eagle3Head(args, target_hidden, draft_vocab, t_args.vocab_size)
    shared = "embed_tokens.weight" not in tensors  # the published heads share the target's embedding
    if shared and args.hidden_size != target_hidden:
        raise StartupError(
            f"{where} has no embedding of its own and a hidden size of {args.hidden_size}: it cannot "
            f"share the model's ({target_hidden} wide)",
            param="speculative.model",
        )
    if shared:
        head.model.embed_tokens = nn.Identity()
    head = head.to_empty(device=device).to(dtype)
    _assign(head, tensors, where)
    if shared:
        head.model.embed_tokens = target.model.embed_tokens
    head.init_rotary(args.max_position_embeddings, dtype, device)
    head.eval().requires_grad_(False)
    return head, layers


def _tensor_shapes(folder: Path, where: str) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for file in _weight_files(folder, where):
        with safe_open(str(file), framework="pt") as f:
            shapes.update({name.removeprefix("model."): tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    return shapes


def _weight_files(folder: Path, where: str) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise StartupError(f"{where} has no .safetensors weights", param="speculative.model")
    return files


def _read_tensors(folder: Path, where: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in _weight_files(folder, where):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({name.removeprefix("model."): f.get_tensor(name) for name in f.keys()})
    return tensors


def _assign(head: Eagle3Head, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Copies every checkpoint tensor into its place (q / k / v and gate / up into their fused rows)."""
    params = dict(head.named_parameters()) | {"d2t": head.d2t}
    filled = set()
    for name, tensor in tensors.items():
        if name == "t2d":
            continue  # the reverse map: d2t says all the head needs
        place = "model.layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name
        place = {"norm.weight": "model.norm.weight", "embed_tokens.weight": "model.embed_tokens.weight"}.get(
            place, place
        )
        module, _, kind = place.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        if leaf in _FUSED:
            fused = head.get_submodule(f"{parent}.{_FUSED[leaf]}")
            offset, size = fused.shard_offsets[leaf]
            target = getattr(fused, kind).data[offset : offset + size]
            filled.add(f"{parent}.{_FUSED[leaf]}.{kind}")
        elif place in params:
            target = params[place].data
            filled.add(place)
        else:
            raise StartupError(
                f"{where} has tensor {name!r}, which an EAGLE-3 head does not have", param="speculative.model"
            )
        if tuple(target.shape) != tuple(tensor.shape):
            raise StartupError(
                f"{where}: {name} has shape {tuple(tensor.shape)}, the head needs {tuple(target.shape)}",
                param="speculative.model",
            )
        target.copy_(tensor)
    missing = sorted(set(params) - filled - {"model.embed_tokens.weight", "d2t"})
    if missing:
        raise StartupError(f"{where} lacks {', '.join(missing)}", param="speculative.model")
