"""What a model needs on a GPU, read from its config before paying for one: weight bytes as the GPU path serves
them, KV bytes per token of each layer group, and the tokens of context that fit on the GPUs RunPod rents.

The model is built on the meta device (no weights are read). Weights count in DTYPE: that is how the GPU path
serves every format today except int4 (AWQ, GPTQ: tinygemm) and FP8 (per tensor or channel on sm89+, block-wise
on Hopper), which stay quantized: for those the figure is an upper bound. MXFP4 experts stay MXFP4 (17 bits per 32
weights), plus the few experts a step dequantises at a time (engine/model/quant/mxfp4_packed.py). A sliding-window group
holds at most its window per sequence, so it costs a fixed max_num_seqs * window tokens' worth; a hybrid model's
recurrent-state pool (Gated DeltaNet, Mamba2) takes two slots a sequence, at most half of what is left, as
engine/core/kv/plan.py sizes it; full-attention groups share the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.cuda.setup import reserve_bytes
from engine.model.checkpoint import safetensors_files, tensor_shapes
from engine.model.layers.moe import StackedExperts
from engine.model.loader import read_config
from engine.model.models import model_class
from engine.model.quant.mxfp4 import GROUP
from engine.model.quant.mxfp4_packed import experts_at_a_time

GB = 10**9
# The GPU sizes RunPod rents, as sold (decimal GB): 24 (RTX 4090, L4, A5000), 48 (A6000, L40S), 80 (A100,
# H100), 141 (H200).
GPU_SIZES_GB = (24, 48, 80, 141)
# The CUDA context, cuBLAS and FlashInfer workspaces: present before the KV budget is measured. An estimate.
CONTEXT_BYTES = 1 << 30
PAGE_SIZE = 16  # EngineConfig's default: the decode graphs' page tables are sized by it


@dataclass(frozen=True)
class GroupKV:
    """One KV layer group: its layers, bytes of K and V per token over them, and its window (None: full);
    latent_width: an MLA group's values per token and layer (0: K and V)."""

    layers: int
    bytes_per_token: int
    window: int | None
    latent_width: int = 0


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    weight_bytes: int
    groups: tuple[GroupKV, ...]
    reserve_bytes: int  # activations, sampler, graphs and slack (engine.cuda.setup.reserve_bytes)
    max_num_seqs: int
    scratch_bytes: int = 0  # packed MXFP4 experts: those a step dequantises at a time
    state_slot_bytes: int = 0  # one recurrent-state slot over every recurrent layer (0: none)
    state_layers: int = 0

    def state_pool_bytes(self, budget: int) -> int:
        """The state pool a KV budget of `budget` bytes gives (engine/core/kv/state_cache.py's sizing: two slots a
        sequence, max_num_seqs or fewer so that they take at most half, and its zero and scratch slots)."""
        if not self.state_slot_bytes:
            return 0
        seqs = max(1, min(self.max_num_seqs, budget // 2 // (2 * self.state_slot_bytes)))
        return (2 * seqs + 2) * self.state_slot_bytes

    @property
    def full_bytes_per_token(self) -> int:
        return sum(g.bytes_per_token for g in self.groups if g.window is None)

    @property
    def window_bytes(self) -> int:
        """What the window groups hold when every sequence has filled its window."""
        return sum(g.bytes_per_token * g.window * self.max_num_seqs for g in self.groups if g.window is not None)

    def tokens_that_fit(self, gpu_bytes: int, utilization: float) -> int:
        """Tokens of context (over all sequences) the KV pool holds on a GPU of `gpu_bytes`; 0 if the weights do
        not fit. A model without full-attention layers is bounded by its windows alone: -1 (unbounded)."""
        budget = int(gpu_bytes * utilization) - self.weight_bytes - self.reserve_bytes - self.scratch_bytes
        budget -= CONTEXT_BYTES
        budget -= self.state_pool_bytes(budget)
        budget -= self.window_bytes
        if budget <= 0:
            return 0
        return budget // self.full_bytes_per_token if self.full_bytes_per_token else -1


def plan_from_config(
    config: dict,
    names: set[str],
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None = None,
    *,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 2048,
) -> MemoryPlan:
    """The plan of the model `config` and its checkpoint's tensor `names` describe (names tell a family its
    biases and sinks), served in `dtype` with KV pages in `kv_dtype` (default: dtype)."""
    cls = model_class((config.get("architectures") or ["<none>"])[0])
    args = cls.read_args(config, names)
    with torch.device("meta"):
        model = cls(args)
    if bool(config.get("tie_word_embeddings")) and hasattr(model, "tie_weights"):
        model.tie_weights()
    elt = torch.empty((), dtype=dtype).element_size()
    kv_elt = torch.empty((), dtype=kv_dtype or dtype).element_size()
    weights = sum(p.numel() for p in model.parameters()) * elt  # parameters() counts a tied weight once
    scratch = 0
    if (config.get("quantization_config") or {}).get("quant_method") == "mxfp4":
        for experts in (m for m in model.modules() if isinstance(m, StackedExperts)):
            stacked = experts.gate_up_proj.numel() + experts.down_proj.numel()
            weights -= stacked * elt - stacked // GROUP * (GROUP // 2 + 1)  # 16 bytes of codes and a scale a group
            per_expert = stacked // experts.num_experts * elt
            scratch = max(scratch, per_expert * experts_at_a_time(experts.num_experts, per_expert))
    groups = tuple(
        GroupKV(
            len(g.layers),
            len(g.layers) * g.values_per_token * kv_elt,
            g.window,
            latent_width=g.latent.width if g.latent is not None else 0,
        )
        for g in model.kv_groups(config)
    )
    recurrent = model.recurrent_spec() if hasattr(model, "recurrent_spec") else None
    pages_per_seq = -(-int(args.max_position_embeddings) // PAGE_SIZE)
    reserve = reserve_bytes(
        args,
        dtype,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_pages_per_seq=pages_per_seq,
        graphs=True,
    )
    return MemoryPlan(
        weight_bytes=weights,
        groups=groups,
        reserve_bytes=reserve,
        max_num_seqs=max_num_seqs,
        scratch_bytes=scratch,
        state_slot_bytes=recurrent.slot_bytes(dtype) if recurrent is not None else 0,
        state_layers=len(recurrent.layers) if recurrent is not None else 0,
    )


def plan_for_folder(model_path: str, dtype: torch.dtype, kv_dtype: torch.dtype | None = None, **kw: int) -> MemoryPlan:
    names = set(tensor_shapes(safetensors_files(model_path)))
    return plan_from_config(read_config(model_path), names, dtype, kv_dtype, **kw)


def describe(plan: MemoryPlan, utilization: float) -> list[str]:
    """The plan as lines a user reads: weights, KV per token per group, tokens that fit on each GPU size."""
    lines = [
        f"weights {plan.weight_bytes / GB:.2f} GB; reserved for activations {plan.reserve_bytes / GB:.2f} GB "
        f"+ CUDA context about {CONTEXT_BYTES / GB:.2f} GB"
        + (f" + MXFP4 experts dequantised at a time {plan.scratch_bytes / GB:.2f} GB" if plan.scratch_bytes else "")
    ]
    for g in plan.groups:
        kind = "full attention" if g.window is None else f"window of {g.window} tokens"
        if g.latent_width:
            kind += f", multi-head latent: {g.latent_width} values per token per layer"
        lines.append(f"KV {g.bytes_per_token / 1024:.1f} KiB per token over {g.layers} layers ({kind})")
    if plan.state_slot_bytes:
        lines.append(
            f"recurrent state {2 * plan.state_slot_bytes / 2**20:.2f} MiB per sequence over {plan.state_layers} "
            "layers (its slot and one for prefix snapshots), from the same budget as the pages"
        )
    for size in GPU_SIZES_GB:
        fits = plan.tokens_that_fit(size * GB, utilization)
        text = "weights do not fit" if fits == 0 else ("windows only" if fits < 0 else f"{fits:,} tokens of context")
        lines.append(f"{size} GB GPU at GPU_MEMORY_UTILIZATION={utilization}: {text}")
    return lines
