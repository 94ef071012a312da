"""Tensor parallelism across the ranks of one machine: rank 0 is the engine (scheduler, sampler, detokenizer),
ranks 1..N-1 are model-runner processes it starts and owns (ranks.py), fed each step over torch.distributed
(wire.py) and running their shard of the model (follower.py)."""
