"""gpt-oss: a Llama-style decoder with biases on q/k/v/o, a learned sink logit per head, sliding-window attention
on the layers `layer_types` says (full on the rest), YaRN rope, and a mixture of experts on every layer: a biased
router (top-k, softmax over the chosen), and experts with biases and a clamped SwiGLU over interleaved gate/up.

transformers stores the experts transposed ([E, H, 2I] and [E, I, H]); they load into our [E, out, in] stacks.
MXFP4 checkpoints (`*_blocks` / `*_scales`) are the loader's business (engine/model/quant/mxfp4_experts.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from engine.errors import UnsupportedModel
from engine.model.checkpoint import Shard, Source
from engine.model.layers.activation import clamped_swiglu
from engine.model.layers.moe import SparseMoE, StackedExperts
from engine.model.layers.parallel import TensorParallel
from engine.model.layers.routing import Routing
from engine.model.models.moe_base import MoeArgs, MoeForCausalLM, read_moe_args
from engine.model.sharding import ShardPlan


@dataclass(kw_only=True)
class GptOssArgs(MoeArgs):
    """MoeArgs plus the experts' SwiGLU constants."""

    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


class GptOssExperts(StackedExperts):
    """Stacked experts with biases and the clamped SwiGLU; hub tensors are [E, in, out], ours [E, out, in]."""

    def checkpoint_shards(self, prefix: str) -> dict[str, Shard]:
        return {
            "experts.gate_up_proj": Shard(param=f"{prefix}.gate_up_proj", transposed=True),
            "experts.down_proj": Shard(param=f"{prefix}.down_proj", transposed=True),
        }


class GptOssForCausalLM(MoeForCausalLM):
    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> GptOssArgs:
        args = read_moe_args(config, names, expert_size_key="intermediate_size", norm_topk_prob=True)
        if not any(n.endswith("self_attn.sinks") for n in names):
            raise UnsupportedModel("gpt-oss checkpoint lacks self_attn.sinks", param="model")
        fields = {name: getattr(args, name) for name in MoeArgs.__dataclass_fields__}
        fields["routing"] = Routing(**{**args.routing.__dict__, "router_bias": True})
        fields["sinks"] = True
        return GptOssArgs(
            **fields,
            swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(config.get("swiglu_limit", 7.0)),
        )

    @classmethod
    def make_moe(cls, a: GptOssArgs) -> SparseMoE:
        r = a.routing
        act = partial(clamped_swiglu, alpha=a.swiglu_alpha, limit=a.swiglu_limit)
        experts = GptOssExperts(
            num_experts=r.num_experts,
            hidden_size=a.hidden_size,
            intermediate_size=r.intermediate_size,
            bias=True,
            activation=act,
        )
        return SparseMoE(routing=r, hidden_size=a.hidden_size, experts=experts)

    def shard(self, tp: TensorParallel) -> ShardPlan:
        """The Llama shard (biased q|k|v, o_proj's bias added once), each layer's experts (shard_mlp) and the sink
        logits of this rank's q heads: a sink joins its own head's softmax only."""
        plan = super().shard(tp)
        q0, nq = tp.span(self.args.num_q_heads)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.sinks = nn.Parameter(torch.empty(nq))
            plan.sources[f"model.layers.{i}.self_attn.sinks"] = Source(0, ((q0, nq),))
        return plan

    def shard_mlp(self, layer: nn.Module, prefix: str, tp: TensorParallel, plan: ShardPlan) -> None:
        """Each expert's intermediate columns of this rank. The hub's gate|up [E, H, 2I] interleaves gate and up
        column by column, so a rank's pairs are one span of 2n; down [E, I, H] splits by rows, its bias rank 0's."""
        old = layer.mlp.experts
        start, n = tp.span(old.intermediate_size)
        layer.mlp.experts = GptOssExperts(
            num_experts=old.num_experts,
            hidden_size=old.hidden_size,
            intermediate_size=n,
            bias=True,
            activation=old.activation,
        )
        name = f"{prefix}.experts"
        plan.sources[f"{name}.gate_up_proj"] = Source(2, ((2 * start, 2 * n),))
        plan.sources[f"{name}.gate_up_proj_bias"] = Source(1, ((2 * start, 2 * n),))
        plan.sources[f"{name}.down_proj"] = Source(1, ((start, n),))
        plan.rank0_biases.append(f"{name}.down_proj_bias")

    def checkpoint_name(self, name: str) -> str:
        """The hub's `mlp.router` is our MoE's `gate`."""
        return name.replace(".mlp.router.", ".mlp.gate.")
