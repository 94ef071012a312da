"""OLMoE: OLMo's attention (one RMSNorm over all of q's heads and one over all of k's, q, k and v clipped to
+-clip_qkv: engine/model/models/olmo2.py) in a pre-norm decoder whose every MLP is a mixture of experts.
"""

from __future__ import annotations

from engine.model.layers.parallel import TensorParallel
from engine.model.models.llama import LlamaArgs
from engine.model.models.moe_base import MoeArgs, MoeForCausalLM, read_moe_args
from engine.model.models.olmo2 import OlmoAttention, shard_whole_qk_norms
from engine.model.sharding import ShardPlan


class OlmoeForCausalLM(MoeForCausalLM):
    @classmethod
    def read_args(cls, config: dict, names: set[str]) -> MoeArgs:
        args = read_moe_args(config, names, expert_size_key="intermediate_size", norm_topk_prob=None)
        args.clip_qkv = config.get("clip_qkv")
        return args

    @classmethod
    def make_attention(cls, args: LlamaArgs, index: int) -> OlmoAttention:
        assert isinstance(args, MoeArgs)
        return OlmoAttention(args, clip_qkv=args.clip_qkv)

    def shard(self, tp: TensorParallel) -> ShardPlan:
        plan = super().shard(tp)
        shard_whole_qk_norms(self, tp, plan)
        return plan
