"""Tensor-parallel shards of a model built on the meta device: which modules shrink to one rank's part, and which
part of each checkpoint tensor (a Source) that rank reads, so it loads its shard alone from the memory map.

Column-parallel (q|k|v and gate|up: this rank's heads and intermediate columns), row-parallel (o_proj, down_proj:
the matching input columns, the block's output all-reduced by the decoder layer), vocab-parallel (the embedding's
and the lm_head's rows, the logits gathered on rank 0). KV heads are split too, or, with fewer KV heads than ranks,
each rank keeps the one its query heads read. A row-parallel bias is added once: by rank 0, zeroed elsewhere.
Multi-head latent attention splits its query heads with their kv_b_proj rows; the latent and the rotary key are
every head's, so each rank computes them whole and holds the same latent pages.
Gated DeltaNet layers split by head as attention does: a rank holds whole key heads with their value heads. A
quantized checkpoint's packed tensors follow their float weight's slice in whole words, groups and blocks
(quant/shards.py). A LoRA adapter's matrices split with the weight they adapt (ShardPlan.lora_part).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from engine.errors import StartupError, UnsupportedModel
from engine.model.checkpoint import Source
from engine.model.layers.linear import FusedLinear
from engine.model.layers.mamba2 import GroupSplit
from engine.model.layers.mla import MLAttention
from engine.model.layers.parallel import TensorParallel, VocabParallelEmbedding

# The architectures whose families shard (each has a TP=2 parity test); others are refused at start-up. An
# image-text one's decoder shards as its text family's; its vision tower runs on rank 0 alone (TOWER_MODULES).
SHARDED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
    "Glm4MoeForCausalLM",
    "SeedOssForCausalLM",
    "Ministral3ForCausalLM",
    "SmolLM3ForCausalLM",
    "Ernie4_5ForCausalLM",
    "Ernie4_5_MoeForCausalLM",
    "Olmo2ForCausalLM",
    "Olmo3ForCausalLM",
    "Exaone4ForCausalLM",
    "GraniteForCausalLM",
    "GraniteMoeForCausalLM",
    "GraniteMoeSharedForCausalLM",
    "GraniteMoeHybridForCausalLM",
    "Phi3ForCausalLM",
    "PhimoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Glm4MoeLiteForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma4ForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3NextForCausalLM",
    "NemotronHForCausalLM",
    "FalconH1ForCausalLM",
    "GptOssForCausalLM",
    "Gemma3ForConditionalGeneration",
    "Gemma4ForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Mistral3ForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)


@dataclass
class ShardPlan:
    """What the loader needs of a shard: the part of each checkpoint tensor (by our parameter name) it reads, and
    the row-parallel biases only rank 0 keeps; what LoRA needs: each target's (out, in) on the whole model."""

    sources: dict[str, Source] = field(default_factory=dict)
    rank0_biases: list[str] = field(default_factory=list)
    lora_shapes: dict[str, tuple[int, int]] = field(default_factory=dict)

    def column(self, name: str, start: int, size: int, bias: bool) -> None:
        self.sources[f"{name}.weight"] = Source(0, ((start, size),))
        if bias:
            self.sources[f"{name}.bias"] = Source(0, ((start, size),))

    def fused_column(self, name: str, spans: list[tuple[int, int]], bias: bool) -> None:
        """A FusedLinear `name` a checkpoint may store fused under its own name (Phi-3's qkv_proj and gate_up_proj,
        Granite's shared input_linear): this rank's rows of each piece, `spans` in the whole tensor's rows."""
        self.sources[f"{name}.weight"] = Source(0, tuple(spans))
        if bias:
            self.sources[f"{name}.bias"] = Source(0, tuple(spans))

    def row(self, name: str, start: int, size: int, bias: bool) -> None:
        self.sources[f"{name}.weight"] = Source(1, ((start, size),))
        if bias:
            self.rank0_biases.append(f"{name}.bias")

    def lora_part(self, weight: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a LoRA pair (A [rank, in], B [out, rank]) on the projection whose weight is `weight`,
        cut as that weight is: a column-parallel one's output rows of B (A whole: every rank computes x A^T), a
        row-parallel one's input columns of A (B whole: the ranks' partial deltas sum in the block's all-reduce)."""
        source = self.sources.get(weight)
        if source is None:
            raise UnsupportedModel(
                f"it changes {weight.removesuffix('.weight')}, which tensor parallelism does not shard", param="model"
            )
        return (a, source.read(b)) if source.dim == 0 else (source.read(a), b)


def check_shardable(architecture: str, args: Any, size: int) -> None:
    """StartupError in one line when `size` ranks cannot split this model (shard_refusal)."""
    why = shard_refusal(architecture, args, size)
    if why is not None:
        raise StartupError(why, param="tensor_parallel_size")


def shard_refusal(architecture: str, args: Any, size: int) -> str | None:
    """Why `size` ranks cannot split this model, in one line (None: they can): a family not sharded yet, or a count
    (heads, KV heads, vocabulary, intermediate size, an expert's width) that `size` does not divide."""
    if size == 1:
        return None
    if architecture not in SHARDED_ARCHITECTURES:
        return (
            f"tensor_parallel_size={size}: {architecture} does not run tensor-parallel yet (it runs: "
            f"{', '.join(SHARDED_ARCHITECTURES)})"
        )
    counts = {
        "attention heads": args.num_q_heads,
        "vocabulary entries": args.vocab_size,
        "intermediate size": args.intermediate_size,
    }
    if getattr(args, "ple_dim", 0):  # Gemma 4's per-layer input embeddings, split by vocabulary rows
        counts["per-layer input vocabulary entries"] = args.ple_vocab
    routing = getattr(args, "routing", None)
    if routing is not None:
        counts["expert intermediate size"] = routing.intermediate_size
        if routing.shared_expert_size:
            counts["shared expert intermediate size"] = routing.shared_expert_size
    deltanet = getattr(args, "deltanet", None)
    if deltanet is not None:  # each rank holds whole Gated DeltaNet heads and their states
        counts["linear-attention key heads"] = deltanet.num_k_heads
        counts["linear-attention value heads"] = deltanet.num_v_heads
    mamba = getattr(args, "mamba", None)
    if mamba is not None and mamba.n_groups % size:  # more ranks than groups: each holds a part of one's heads
        counts["Mamba2 heads"] = mamba.num_heads
    for what, n in counts.items():
        if n % size:
            return f"tensor_parallel_size={size} does not divide the model's {n} {what}"
    if mamba is not None and mamba.n_groups % size and size % mamba.n_groups:
        groups = mamba.n_groups
        return f"tensor_parallel_size={size} neither divides nor is a multiple of the model's {groups} Mamba2 groups"
    # Every layer's KV heads (Gemma 4's global layers have their own count).
    for kv in sorted({args.num_kv_heads, *(kv for kv, _ in getattr(args, "layer_shapes", ()))}, reverse=True):
        if kv % size and size % kv:
            return f"tensor_parallel_size={size} neither divides nor is a multiple of the model's {kv} KV heads"
    return None


def shard_attention(attn: nn.Module, prefix: str, tp: TensorParallel, plan: ShardPlan, gated: bool = False) -> None:
    """A Llama-style attention (qkv_proj, o_proj, num_q / num_kv / head_dim) -> this rank's heads. gated: each
    q head's rows are [query | output gate] (Qwen3.5's gated attention), both kept with the head. The k and v
    projections are those qkv_proj stacks (Gemma 4: none on a shared-KV layer, no v_proj where keys are values)."""
    d, hidden = attn.head_dim, attn.o_proj.out_features
    q0, nq = tp.span(attn.num_q)
    k0, nk = tp.kv_heads(attn.num_kv)
    bias = attn.qkv_proj.bias is not None
    qd = 2 * d if gated else d
    kv = [name for name in ("k_proj", "v_proj") if name in attn.qkv_proj.shard_offsets]
    attn.qkv_proj = FusedLinear(hidden, {"q_proj": nq * qd, **dict.fromkeys(kv, nk * d)}, bias)
    plan.column(f"{prefix}.q_proj", q0 * qd, nq * qd, bias)
    for name in kv:
        plan.column(f"{prefix}.{name}", k0 * d, nk * d, bias)
    q_rows, kv_rows = attn.num_q * qd, attn.num_kv * d  # the whole model's, before this rank's below
    kv_spans = [(q_rows + i * kv_rows + k0 * d, nk * d) for i in range(len(kv))]
    plan.fused_column(f"{prefix}.qkv_proj", [(q0 * qd, nq * qd), *kv_spans], bias)
    o_bias = attn.o_proj.bias is not None
    attn.o_proj = nn.Linear(nq * d, hidden, bias=o_bias)
    plan.row(f"{prefix}.o_proj", q0 * d, nq * d, o_bias)
    attn.num_q, attn.num_kv = nq, nk


def shard_mla(attn: MLAttention, prefix: str, tp: TensorParallel, plan: ShardPlan) -> MLAttention:
    """A multi-head latent attention (engine/model/layers/mla.py) -> a new one over this rank's heads: their rows of
    q_proj or q_b_proj and of kv_b_proj (W_UK_h, W_UV_h), o_proj row-parallel. q_a_proj, kv_a_proj_with_mqa and their
    norms stay whole: every rank writes the same latent and rotary key, so its pages are full, not a part."""
    s = attn.shape
    h0, nh = tp.span(s.num_heads)
    qk, kv_rows = s.qk_head_dim, s.qk_nope_head_dim + s.v_head_dim
    plan.column(f"{prefix}.{'q_proj' if s.q_lora_rank is None else 'q_b_proj'}", h0 * qk, nh * qk, bias=False)
    plan.sources[f"{prefix}.kv_b_proj.weight"] = Source(0, ((h0 * kv_rows, nh * kv_rows),))
    plan.row(f"{prefix}.o_proj", h0 * s.v_head_dim, nh * s.v_head_dim, bias=s.attention_bias)
    return MLAttention(replace(s, num_heads=nh))


def shard_gated_mlp(mlp: nn.Module, prefix: str, tp: TensorParallel, plan: ShardPlan) -> None:
    """A gate|up + down MLP (gate_up_proj: FusedLinear of gate_proj and up_proj) -> this rank's columns; a
    non-gated one (up_proj, down_proj: Nemotron-H's relu^2) alike."""
    hidden, width = mlp.down_proj.out_features, mlp.down_proj.in_features
    start, n = tp.span(width)
    bias = mlp.down_proj.bias is not None
    if not hasattr(mlp, "gate_up_proj"):
        up_bias = mlp.up_proj.bias is not None
        mlp.up_proj = nn.Linear(hidden, n, bias=up_bias)
        plan.column(f"{prefix}.up_proj", start, n, up_bias)
        mlp.down_proj = nn.Linear(n, hidden, bias=bias)
        plan.row(f"{prefix}.down_proj", start, n, bias)
        return
    up_bias = mlp.gate_up_proj.bias is not None
    mlp.gate_up_proj = FusedLinear(hidden, {"gate_proj": n, "up_proj": n}, up_bias)
    for name in ("gate_proj", "up_proj"):
        plan.column(f"{prefix}.{name}", start, n, up_bias)
    plan.fused_column(f"{prefix}.gate_up_proj", [(start, n), (width + start, n)], up_bias)
    mlp.down_proj = nn.Linear(n, hidden, bias=bias)
    plan.row(f"{prefix}.down_proj", start, n, bias)


def shard_vocab(model: nn.Module, tp: TensorParallel, plan: ShardPlan) -> None:
    """The embedding's and the lm_head's rows -> this rank's part of the vocabulary (tied or not)."""
    vocab, hidden = model.model.embed_tokens.weight.shape
    start, n = tp.span(vocab)
    model.model.embed_tokens = VocabParallelEmbedding(n, hidden, start, tp)
    plan.sources["model.embed_tokens.weight"] = Source(0, ((start, n),))
    head_bias = model.lm_head.bias is not None
    model.lm_head = nn.Linear(hidden, n, bias=head_bias)
    plan.sources["lm_head.weight"] = Source(0, ((start, n),))
    if head_bias:
        plan.sources["lm_head.bias"] = Source(0, ((start, n),))
    model.tp = tp


def finish_shard(model: nn.Module, plan: ShardPlan, tp: TensorParallel) -> None:
    """After loading: the row-parallel biases count once in the all-reduced sum (rank 0's)."""
    if tp.rank:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name in plan.rank0_biases:
                params[name].zero_()


def shard_experts(moe: nn.Module, prefix: str, tp: TensorParallel, plan: ShardPlan) -> None:
    """A SparseMoE -> every expert's gate|up rows and down columns of this rank (tensor-parallel inside each
    expert: routing, on the replicated hidden state, is the same on every rank), and its shared expert(s) alike."""
    moe.experts = shard_expert_stack(moe.experts, f"{prefix}.experts", tp, plan)
    for name in ("shared_expert", "shared_experts"):
        if getattr(moe, name) is not None:
            shard_gated_mlp(getattr(moe, name), f"{prefix}.{name}", tp, plan)


def shard_expert_stack(old: nn.Module, name: str, tp: TensorParallel, plan: ShardPlan) -> nn.Module:
    """A StackedExperts (checkpoint name `name`) -> a new one of this rank's columns of every expert; the layer
    all-reduces its output."""
    start, n = tp.span(old.intermediate_size)
    if old.gate_up_proj_bias is not None:
        raise StartupError("tensor parallelism does not shard biased experts yet", param="tensor_parallel_size")
    width = old.intermediate_size
    # The hub's per-expert tensors, and fused ones: transformers 5's ([E, 2I, H] gate|up, [E, H, I] down) or
    # Qwen3-VL-MoE's hub layout ([E, H, 2I], [E, I, H]: the tensor's shape says which).
    for e in range(old.num_experts):
        for proj in ("gate_proj", "up_proj"):
            plan.sources[f"{name}.{e}.{proj}.weight"] = Source(0, ((start, n),))
        plan.sources[f"{name}.{e}.down_proj.weight"] = Source(1, ((start, n),))
    up = ((start, n), (width + start, n)) if old.gated else ((start, n),)
    plan.sources[f"{name}.gate_up_proj"] = Source(1, up, (2 if old.gated else 1) * width)
    plan.sources[f"{name}.down_proj"] = Source(2, ((start, n),), width)
    return type(old)(
        num_experts=old.num_experts,
        hidden_size=old.hidden_size,
        intermediate_size=n,
        activation=old.activation,
        gated=old.gated,
    )


def shard_deltanet(layer: nn.Module, prefix: str, tp: TensorParallel, plan: ShardPlan) -> nn.Module:
    """A Gated DeltaNet -> a new one over this rank's key heads and their value heads (a contiguous span of each,
    so value head j still reads key head j // (Hv / Hk)): q|k|v and the conv's channels, z, b, a, dt_bias and A_log
    by head; out_proj row-parallel; the gated norm (per value head's width) whole. Its state slots hold these heads."""
    s = layer.shape
    k0, nk = tp.span(s.num_k_heads)
    v0, nv = tp.span(s.num_v_heads)
    dk, dv, key_dim = s.head_k_dim, s.head_v_dim, s.num_k_heads * s.head_k_dim
    shard = type(layer)(replace(s, num_k_heads=nk, num_v_heads=nv))
    qkv = ((k0 * dk, nk * dk), (key_dim + k0 * dk, nk * dk), (2 * key_dim + v0 * dv, nv * dv))
    if hasattr(layer, "in_proj_qkvz"):  # Qwen3-Next: rows laid out per key head, so a rank's are one span
        group = s.num_v_heads // s.num_k_heads
        per_qkvz, per_ba = 2 * dk + 2 * group * dv, 2 * group
        plan.sources[f"{prefix}.in_proj_qkvz.weight"] = Source(0, ((k0 * per_qkvz, nk * per_qkvz),))
        plan.sources[f"{prefix}.in_proj_ba.weight"] = Source(0, ((k0 * per_ba, nk * per_ba),))
    else:
        plan.sources[f"{prefix}.in_proj_qkv.weight"] = Source(0, qkv)
        plan.sources[f"{prefix}.in_proj_z.weight"] = Source(0, ((v0 * dv, nv * dv),))
        for name in ("in_proj_b", "in_proj_a"):
            plan.sources[f"{prefix}.{name}.weight"] = Source(0, ((v0, nv),))
    plan.sources[f"{prefix}.conv1d.weight"] = Source(0, qkv)
    for name in ("dt_bias", "A_log"):
        plan.sources[f"{prefix}.{name}"] = Source(0, ((v0, nv),))
    plan.sources[f"{prefix}.out_proj.weight"] = Source(1, ((v0 * dv, nv * dv),))
    return shard


def shard_mamba2(layer: nn.Module, prefix: str, tp: TensorParallel, plan: ShardPlan) -> nn.Module:
    """A Mamba2 mixer -> a new one over this rank's groups (a contiguous span, with their heads): in_proj's z, x, B,
    C and dt rows and the conv's x, B and C channels by group; dt_bias, A_log and D by head; the gated norm's groups
    (each normalised on its own, so a rank's are whole); out_proj row-parallel. Its state slots hold these heads.
    With more ranks than groups, a rank holds an equal part of one group's heads and that group's B and C (the
    group's ranks compute them alike), its gated norm summed across the ranks (GroupSplit)."""
    s = layer.shape
    per, split = s.num_heads // s.n_groups, None
    if s.n_groups % tp.size == 0:
        g0, ng = tp.span(s.n_groups)
        h0, nh = g0 * per, ng * per
    else:  # more ranks than groups (Granite 4.0-H has one): a rank holds an equal part of one group's heads
        h0, nh = tp.span(s.num_heads)
        g0, ng = h0 // per, 1
        split = GroupSplit(tp=tp, group=g0, groups=s.n_groups, width=per * s.head_dim)
    p, n, inner, bc = s.head_dim, s.state_size, s.inner, s.n_groups * s.state_size
    shard = type(layer)(replace(s, num_heads=nh, n_groups=ng), split=split)
    xbc = ((h0 * p, nh * p), (inner + g0 * n, ng * n), (inner + bc + g0 * n, ng * n))
    in_proj = ((h0 * p, nh * p), *((inner + a, b) for a, b in xbc), (inner + s.conv_dim + h0, nh))
    bias = s.proj_bias
    plan.fused_column(f"{prefix}.in_proj", list(in_proj), bias)
    plan.sources[f"{prefix}.conv1d.weight"] = Source(0, xbc)
    if s.conv_bias:
        plan.sources[f"{prefix}.conv1d.bias"] = Source(0, xbc)
    for name in ("dt_bias", "A_log", "D"):
        plan.sources[f"{prefix}.{name}"] = Source(0, ((h0, nh),))
    if s.rms_norm:
        plan.sources[f"{prefix}.norm.weight"] = Source(0, ((h0 * p, nh * p),))
    plan.row(f"{prefix}.out_proj", h0 * p, nh * p, s.out_bias)
    return shard
