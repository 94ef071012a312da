"""Repetition, frequency and presence penalties from per-sequence running counts, as vLLM applies them.

Each penalised sequence keeps a PenaltyCounts: a [vocab] count of its output tokens and, for the repetition
penalty (which vLLM applies to prompt and output alike), a [vocab] mask of the tokens in its prompt. A step adds
the sequence's new token to its counts instead of listing its whole context again, so the cost of a step no
longer grows with the context (it is batch x vocabulary, like the logits themselves).

Owner: the counts are sampling state of one choice, like its RNG stream, so they live on the choice's
OutputState (the output side; the scheduler never reads them). They are a cache of seq.output_token_ids, which
stays the truth: only PenaltyCounts.sync writes them, and it catches up with whatever tokens were appended since
the last step (one in decode; the whole output for a state that is new). So they need nothing from the code
that appends, forks or preempts: preemption keeps the output tokens and so the counts; a beam's fork clones its
parent's (OutputState.fork); a choice of n starts empty and counts its own first token. A list that shrank or
whose last counted token changed (a rollback, as speculative decoding will make) is counted afresh.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from engine.sample.params import SamplingParams


class PenalisedRow(Protocol):
    """What the penalties read of a sampling row (engine.sample.logits_processor.SamplingRow)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    penalties: PenaltyCounts | None


class PenaltyCounts:
    """One sequence's output-token counts, the frequency and presence penalty they add up to, and under a repetition
    penalty the mask of tokens in its prompt or output; [vocab] each, on the logits' device. Empty until the first
    sync, which sizes them."""

    def __init__(self) -> None:
        self.counts: torch.Tensor | None = None  # [vocab] float32: occurrences of each token in the output
        # [vocab] float32: frequency * count + presence where a token occurs, +0.0 elsewhere (the amount to subtract).
        self.delta: torch.Tensor | None = None
        # [vocab] int32, -1 where the token is in the prompt or the output, else 0 (repetition penalty only): a bit
        # mask, because selecting by bit operations is exact and several times faster than torch.where on a CPU.
        self.seen: torch.Tensor | None = None
        self.num_counted = 0  # output tokens in `counts`
        self.last_token = -1  # output_token_ids[num_counted - 1], to notice a list that changed under us

    def fork(self) -> PenaltyCounts:
        """A copy for a forked sequence (a beam's child), which goes on counting on its own."""
        child = PenaltyCounts()
        child.counts, child.delta, child.seen = (
            None if t is None else t.clone() for t in (self.counts, self.delta, self.seen)
        )
        child.num_counted, child.last_token = self.num_counted, self.last_token
        return child

    def sync(self, row: PenalisedRow, vocab: int, device: torch.device) -> None:
        """Brings the state up to row's output tokens: the new ones only, unless the list is not the one counted."""
        output, n, p = row.output_token_ids, self.num_counted, row.params
        repetition = p.repetition_penalty != 1.0
        counts = self.counts
        if (
            counts is None
            or counts.shape[0] != vocab
            or counts.device != device
            or n > len(output)
            or (n and output[n - 1] != self.last_token)
            or (repetition and self.seen is None)
        ):
            self._rebuild(row, vocab, device, repetition)
        elif len(output) - n == 1:
            # Decode: one token, indexed by a Python int (no host list turned into a tensor).
            t = output[n]
            assert self.delta is not None  # counted state has its deltas
            counts[t] += 1
            # float32 arithmetic, as the list-based code: count * frequency, then + presence.
            self.delta[t] = counts[t] * p.frequency_penalty + p.presence_penalty
            if self.seen is not None:
                self.seen[t] = -1
        elif len(output) > n:
            assert self.delta is not None  # counted state has its deltas
            new = torch.tensor(output[n:], dtype=torch.long, device=device)
            counts.index_put_((new,), torch.ones(new.numel(), device=device), accumulate=True)
            self.delta[new] = counts[new] * p.frequency_penalty + p.presence_penalty
            if self.seen is not None:
                self.seen[new] = -1
        self.num_counted = len(output)
        self.last_token = output[-1] if output else -1

    def _rebuild(self, row: PenalisedRow, vocab: int, device: torch.device, repetition: bool) -> None:
        """Everything from the whole prompt and output: on first use, and for a list that changed (a rollback)."""
        output, p = row.output_token_ids, row.params
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self.delta = torch.zeros(vocab, dtype=torch.float32, device=device)
        if output:
            new = torch.tensor(output, dtype=torch.long, device=device)
            self.counts.index_put_((new,), torch.ones(new.numel(), device=device), accumulate=True)
            self.delta[new] = self.counts[new] * p.frequency_penalty + p.presence_penalty
        self.seen = None
        if repetition:
            self.seen = torch.zeros(vocab, dtype=torch.int32, device=device)
            known = row.prompt_token_ids + output
            if known:
                self.seen[torch.tensor(known, dtype=torch.long, device=device)] = -1


def has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def apply_penalties(out: torch.Tensor, rows: list[tuple[int, PenalisedRow]]) -> None:
    """In place on `out` [B, vocab]: repetition (prompt and output, once per token), then frequency and presence
    (output only) for each (row index, row). A row without its own PenaltyCounts is counted afresh.

    Branch-free passes over the penalised rows x vocabulary, with the list-based code's float32 arithmetic on the
    entries that occur, so the results equal it bit for bit (tests/engine/sample/penalty_oracle.py). On a 2-vCPU
    VM, torch.where with a data-dependent mask and nonzero() each cost several of these passes.
    """
    device, vocab = out.device, out.shape[1]
    states = [r.penalties if r.penalties is not None else PenaltyCounts() for _, r in rows]
    for state, (_, r) in zip(states, rows, strict=True):
        state.sync(r, vocab, device)
    params = [r.params for _, r in rows]
    rep = [j for j, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep:
        block = _block(out, [rows[j][0] for j in rep])
        sub = out if block is None else out.index_select(0, block)
        penalty = torch.tensor([params[j].repetition_penalty for j in rep], device=device)[:, None]
        # Bit operations in place on a few temporaries: large fresh tensors cost page faults on every step.
        bits = sub.view(torch.int32)
        sign = bits >> 31  # -1 where the sign bit is set: v <= 0 multiplies, v > 0 divides (+0.0 gives +0.0 either way)
        picked, multiplied = (sub / penalty).view(torch.int32), (sub * penalty).view(torch.int32)
        picked ^= multiplied.bitwise_xor_(picked).bitwise_and_(sign)
        picked ^= bits
        # Only the tokens seen in prompt or output change.
        picked &= torch.stack(_synced([states[j].seen for j in rep]))
        picked ^= bits
        if block is None:
            bits.copy_(picked)
        else:
            out.index_copy_(0, block, picked.view(torch.float32))
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        # Tokens that do not occur subtract +0.0, which leaves every value (-0.0 included) as it was.
        deltas = torch.stack(_synced([s.delta for s in states]))
        block = _block(out, [i for i, _ in rows])
        if block is None:
            out.sub_(deltas)
        else:
            out.index_copy_(0, block, out.index_select(0, block).sub_(deltas))


def _block(out: torch.Tensor, index: list[int]) -> torch.Tensor | None:
    """The rows `index` of `out` as an index tensor, or None when they are all of its rows in order."""
    return None if index == list(range(out.shape[0])) else torch.tensor(index, device=out.device)


def _synced(tensors: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """The tensors sync() built (`seen` where a repetition penalty asks for it, `delta` always)."""
    built = [t for t in tensors if t is not None]
    assert len(built) == len(tensors), "a penalty state read before sync"
    return built
