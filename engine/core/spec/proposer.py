"""The one interface every proposer implements: guesses for a batch of decoding sequences."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from engine.core.scheduling.sequence import Sequence


@dataclass(kw_only=True)
class Target:
    """What a proposer needs of the engine it proposes for (the target model's side)."""

    tokenizer: Any
    vocab_size: int
    recurrent: bool  # the model has recurrent-state layers (the runner replays a verify's accepted rows into them)
    dtype: torch.dtype
    device: torch.device
    kv_dtype: torch.dtype
    backend_name: str
    page_size: int
    num_pages: int  # the target's KV pool (its first group's), the draft pool's default size
    max_num_batched_tokens: int
    max_model_len: int
    model: Any = None  # the target model itself (an EAGLE-3 head reads its hidden states)
    model_path: str = ""  # its folder (an MTP head's weights are in its checkpoint)
    max_num_seqs: int = 256  # sequences the engine runs at once (a hybrid draft's state slots are at most these)


class Proposer(Protocol):
    """Proposes up to limits[i] next tokens for seqs[i] (fewer, or none, where it has no guess)."""

    name: str
    # Whether the proposals are a point mass (q = 1 on the proposed token), so verification needs no draft logits.
    deterministic: bool

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]: ...

    def retain(self, live: set[int]) -> None:
        """Forgets what it keeps for sequences whose seq_id is not in `live` (finished, aborted, preempted)."""
        ...

    def describe(self) -> dict: ...
